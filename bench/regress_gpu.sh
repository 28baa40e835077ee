#!/usr/bin/env bash
# No regression against a baseline commit, on one GPU machine: W1 and W2 (bench.gpu --quick
# --skip-7b: correctness against HF, one request, the batch sweep, the real-form classify(query)
# call) and HTTP one request at a time (bench.http's serial phase, default --workers, real form),
# for the baseline's tree and this one, alternated so each figure sits beside its peer.
#
#   mkdir -p .base && git archive <commit> | tar -x -C .base      # here; .base is git-ignored
#   bash bench/regress_gpu.sh .base                                # there; carry .base .whl .carry
#   PARTS=gpu bash bench/regress_gpu.sh .base                      # W1 and W2 only (PARTS=http: HTTP)
#
# $OUT/base/ and $OUT/head/ get each tree's gpu.json and http.json; the table at the end sets the
# pairs side by side.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
HEAD_DIR=$PWD BASE_DIR=$(cd "${1:?the baseline tree}" && pwd)
SITE=/tmp/site  # the carried wheels (gpu_env.sh)
ln -sfn "$HEAD_DIR/.carry" "$BASE_DIR/.carry"
[ -e /tmp/q05/config.json ] || python3 -c 'from bench.gpu import real_form_model; real_form_model()'
http_flags=(--configs auto --rates 1000 --duration 2 --refine 0 --at 0.5 --serial 1000
            --server-cpus 0-9 --load-cpus 10-15 -- --model /tmp/q05 --device cuda)

in_tree() {  # tree, name, python args...
  local tree=$1 name=$2; shift 2
  mkdir -p "$OUT/$name"
  (cd "$tree" && OUT="$OUT/$name" PYTHONPATH="$SITE:$tree" python3 "$@") 2>&1 | tail -40
  rm -f "$OUT/$name"/*.png
}

for part in ${PARTS:-gpu http}; do
  for name in base head; do
    tree=$HEAD_DIR; [ $name = base ] && tree=$BASE_DIR
    echo "== $part, $name ($tree)"
    if [ $part = gpu ]; then
      in_tree "$tree" $name -m bench.gpu --quick --skip-7b
    else
      in_tree "$tree" $name -m bench.http "${http_flags[@]}"
    fi
  done
done

python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])


def load(name, file):
    p = out / name / file
    return json.loads(p.read_text()) if p.exists() else {}


def figures(name):
    g, h = load(name, "gpu.json"), load(name, "http.json")
    s = (g.get("shapes") or [{}])[0]
    rf = (g.get("real_form") or {}).get("classify_call", {})
    w2 = s.get("sweep", {}).get("4096", {})
    serial = next((c.get("serial", {}) for c in h.get("configs") or []), {})
    return {"W1 GPU replay p50 ms": s.get("w1_gpu_replay", {}).get("p50_ms"),
            "W1 engine call p50 ms": s.get("w1_engine_call", {}).get("p50_ms"),
            "real-form classify(query) p50 ms": rf.get("p50_ms"),
            "W2 4096 GPU ms": w2.get("gpu_ms"),
            "W2 4096 req/s (whole call)": w2.get("req_per_s_call"),
            "HTTP one at a time p50 ms": serial.get("p50_ms"),
            "in process p50 ms": (h.get("inproc") or {}).get("p50_ms")}


base, head = figures("base"), figures("head")
print(f"\n{'figure':36s} {'base':>10s} {'head':>10s}")
for k in base:
    f = lambda v: f"{v:10.3f}" if isinstance(v, (int, float)) else f"{str(v):>10s}"
    print(f"{k:36s} {f(base[k])} {f(head[k])}")
(out / "regress.json").write_text(json.dumps({"base": base, "head": head}, indent=1))
EOF
