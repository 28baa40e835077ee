#!/usr/bin/env bash
# The H200 calls the thirteenth and fourteenth sessions' work waits for (their device budget was
# spent by the twelfth session's runs): three calls of at most ~560 s in one warm lease (a call
# runs at most 600 s; the ray wheel travels in two parts, and /tmp/site stays while the lease is
# warm, 30 s between calls). Most wanted first.
#   (split here first: RAY_PART_MIB=44 bash bench/ray_stage.sh split, so each call fits 64 MiB)
#   1. device run, carry [".ray1", ".carry"]:        bash bench/pending_gpu.sh one
#      GPU tests (FP8 kernels compiled for sm_90, the fused bank, checkpoints, batch invariance
#      end to end), the fused two-classifier pass (bench.many_gpu), batch-invariant mode off/on
#      end to end and each kernel's batch invariance (bench.invariance_gpu)
#   2. device run, carry [".ray2", ".whl", ".carry"]: bash bench/pending_gpu.sh two
#      FP8 against bf16 (bench.fp8_gpu); ray installed; the CLI on a 1M-row log beside
#      classify_batch (bench.cli_log)
#   3. device run, carry [".carry"]:                  bash bench/pending_gpu.sh three
#      Ray Data beside in-process (bench.ray_data), Ray Serve beside `prefixscore serve`
#      (bench.ray_serve)
set -uo pipefail
export OUT=${OUT:-bench/results}
mkdir -p "$OUT"
step() { echo "=== $* ($(date +%T))"; }
case "${1:-}" in
one)
  step ray part 1; bash bench/ray_stage.sh part1
  step GPU tests
  PREFIXSCORE_TEST_TOKENIZER=.carry timeout 200 python3 -m pytest -q -p no:cacheprovider -x \
    tests/test_kernels_fp8.py tests/test_many.py tests/test_fp8_checkpoints.py tests/test_invariance.py 2>&1 | tail -6 \
    | tee "$OUT/gpu_tests.log"
  step many; timeout 100 python3 -m bench.many_gpu 2>&1 | tail -40
  step invariance; timeout 240 python3 -m bench.invariance_gpu 2>&1 | tail -14
  ;;
two)
  step fp8; timeout 330 python3 -m bench.fp8_gpu 2>&1 | tail -30
  step ray install; bash bench/ray_stage.sh install || exit 1
  export PYTHONPATH=/tmp/site:$PWD
  python3 -c "from bench.gpu import real_form_model; real_form_model()"  # /tmp/q05
  step cli_log; timeout 200 python3 -m bench.cli_log --rows 1000000 --model /tmp/q05 --device cuda 2>&1 | tail -12
  ;;
three)
  bash bench/ray_stage.sh install || exit 1  # (a no-op while the lease kept /tmp/site)
  export PYTHONPATH=/tmp/site:$PWD
  python3 -c "from bench.gpu import real_form_model; real_form_model()"  # /tmp/q05 (kept)
  step ray_data; timeout 200 python3 -m bench.ray_data --rows 1000000 --model /tmp/q05 --device cuda \
    --repeats 2 --cpus 8 2>&1 | tail -12
  step ray_serve; timeout 330 python3 -m bench.ray_serve --model /tmp/q05 --device cuda --n 1000 \
    --cpus 4 --variant haproxy --variant direct 2>&1 | tail -12
  ;;
*) echo "usage: bash bench/pending_gpu.sh one|two|three" >&2; exit 2 ;;
esac
