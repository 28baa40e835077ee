#!/usr/bin/env bash
# Issue 35 on the H200: the GPU tests of the persistent block and the FP8 kernels, then
# bench.layer (the one launch against the four kernels, the --sweep variants, each phase alone, the
# per-phase critical path), then bench.latency's W1 and bucket rows for both paths, then
# bench.fp8_gpu (W1/W4 and fidelity with e4m3 weights multiplied in bf16 and in fp16:
# KernelOptions.fp8_fp16), then bench.gluon_stream (the Gluon re-plan's premise; last: its kernel
# waits on mbarriers that no spin limit bounds). Each stage is bounded (a grid that hangs would
# otherwise hold the machine until the call's limit) and writes its log and JSON under $OUT as it
# finishes. All of them pass a device call's 600 s: split them over calls, e.g. "tests layer",
# "latency gluon", "fp8".
#
#   bash bench/persistent_gpu.sh [tests] [layer] [latency] [fp8] [gluon]   (default: all, in this order)
#
# Needs .whl/ (bench/gpu_wheels.txt) and .carry/ (SmolLM2's tokenizer files), as tests/gpu.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
for s in ${*:-tests layer latency fp8 gluon}; do
  echo "== $s $(date +%T)"
  case $s in
    tests) timeout -s KILL 150 bash tests/gpu.sh -k "test_kernels_layer or persistent or depend_on_the_bucket or fp8" ;;
    layer) timeout -s KILL 200 python3 -m bench.layer --tokens 8,16 --quick --sweep ;;
    latency) timeout -s KILL 300 python3 -m bench.latency --skip-7b --quick ;;
    fp8) timeout -s KILL 560 python3 -m bench.fp8_gpu --quick ;;
    gluon) timeout -s KILL 120 python3 -m bench.gluon_stream ;;
    *) echo "unknown stage $s"; exit 2 ;;
  esac 2>&1 | tee "$OUT/persistent_gpu_$s.log"
  echo "== $s rc=${PIPESTATUS[0]} $(date +%T)"
done
