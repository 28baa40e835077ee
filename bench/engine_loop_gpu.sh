#!/usr/bin/env bash
# The engine loop on the H200 (issue 48), stage by stage, each bounded to fit one device call:
# the GPU tests of what the loop runs (graphs and their slots, vocabulary graphs, chunked query
# parts), bench.engine_loop in process, then bench.slo's long-score, overload and two-client
# phases through the server (issue 49's admission too).
#
#   bash bench/engine_loop_gpu.sh [tests] [inproc] [slo]   (default: all, in this order)
#
# Needs .whl/ (bench/gpu_wheels.txt) and .carry/ (SmolLM2's tokenizer files), as tests/gpu.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
stages=${*:-tests inproc slo}
[ -d /tmp/q05 ] || python3 -c 'from bench.gpu import real_form_model; real_form_model()'
for s in $stages; do
  echo "== $s $(date +%T)"
  case $s in
    tests) bash tests/gpu.sh -x -k "batch or score_run or scorer or embedding or many or slo" ;;
    inproc) python3 -m bench.engine_loop -- --model /tmp/q05 --device cuda ;;
    slo) python3 -m bench.slo --server-cpus 0-9 --load-cpus 10-15 --phases score,overload,fair \
           --rates 100,1000,3000,6000,9000,12000,15000 --refine 1 -- --model /tmp/q05 --device cuda \
           --target-p99-ms 5 ;;
    *) echo "unknown stage $s"; exit 2 ;;
  esac 2>&1 | tee "$OUT/engine_loop_gpu_$s.log"
done
