#!/usr/bin/env bash
# The H200 calls that issue 23's work waits for, most wanted first, in one warm lease (a call runs
# at most 600 s; 30 s idle between calls keeps the lease, and /tmp with it).
#   1. device run, carry [".carry"]:                  bash bench/pending_gpu.sh one
#      GPU tests (FP8 kernels, checkpoints, batch invariance end to end, the fused bank), then FP8
#      against bf16 (bench.fp8_gpu: fidelity, W1, W4, the W2 sweep, invariance of each)
#   2. device run, carry [".carry"]:                  bash bench/pending_gpu.sh two
#      batch-invariant mode off/on end to end and each kernel's batch invariance
#      (bench.invariance_gpu), the fused two-classifier pass (bench.many_gpu)
#   3./4. (issue 24's leftovers) carry [".ray1"], then [".ray2", ".whl", ".carry"]: three, four
#      (split first: RAY_PART_MIB=44 bash bench/ray_stage.sh split): the CLI on a 1M-row log beside
#      classify_batch (bench.cli_log), Ray Data beside in-process (bench.ray_data)
set -uo pipefail
export OUT=${OUT:-bench/results}
mkdir -p "$OUT"
step() { echo "=== $* ($(date +%T))"; }
case "${1:-}" in
one)
  step GPU tests
  PREFIXSCORE_TEST_TOKENIZER=.carry timeout 170 python3 -m pytest -q -p no:cacheprovider --tb=short -rfE \
    tests/test_kernels_fp8.py tests/test_fp8_checkpoints.py tests/test_invariance.py tests/test_many.py 2>&1 \
    | tail -40 | tee "$OUT/gpu_tests.log"
  step fp8; timeout 380 python3 -m bench.fp8_gpu 2>&1 | tail -40
  ;;
two)
  step GPU tests
  PREFIXSCORE_TEST_TOKENIZER=.carry timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=short -rfE \
    tests/test_invariance.py tests/test_many.py tests/test_kernels_fp8.py \
    tests/test_fp8_checkpoints.py::test_block_convention_matches_transformers 2>&1 | tail -30
  step fp8 kernels; timeout 210 python3 -m bench.fp8_skinny_gpu --budget 100 2>&1 | grep -v '"grid"' | tail -24
  step invariance; timeout 230 python3 -m bench.invariance_gpu 2>&1 | tail -20
  ;;
three)
  step ray part 1; bash bench/ray_stage.sh part1
  ;;
four)
  bash bench/ray_stage.sh install || exit 1
  export PYTHONPATH=/tmp/site:$PWD
  python3 -c "from bench.gpu import real_form_model; real_form_model()"  # /tmp/q05
  step cli_log; timeout 200 python3 -m bench.cli_log --rows 1000000 --model /tmp/q05 --device cuda 2>&1 | tail -12
  step ray_data; timeout 200 python3 -m bench.ray_data --rows 1000000 --model /tmp/q05 --device cuda \
    --repeats 2 --cpus 8 2>&1 | tail -12
  ;;
*) echo "usage: bash bench/pending_gpu.sh one|two|three|four" >&2; exit 2 ;;
esac
