#!/usr/bin/env bash
# The H200 calls still owed, most wanted first, in one warm lease (a call runs at most 600 s; 30 s
# idle between calls keeps the lease, and /tmp with it). The fifteenth session ran its own versions
# of one and two (BENCHMARKS.md); still owed:
#   1. device run, carry [".carry", ".whl"]:          bash bench/pending_gpu.sh one
#      the GPU tests whole (two earlier calls cut them at 120-170 s, all passing so far), then
#      FP8 against bf16 (bench.fp8_gpu) with the FP8_WIDE default in its W4 row
#   2. device run, carry [".carry"]:                  bash bench/pending_gpu.sh two
#      again once batch-invariant mode changes: its cost (bench.invariance_gpu), with the
#      quantization-only fidelity floor (bench.fp8_quant_gpu)
#   3./4. (issue 24's leftovers) carry [".ray1"], then [".ray2", ".whl", ".carry"]: three, four
#      (split first: RAY_PART_MIB=44 bash bench/ray_stage.sh split): the CLI on a 1M-row log beside
#      classify_batch (bench.cli_log), Ray Data beside in-process (bench.ray_data)
set -uo pipefail
export OUT=${OUT:-bench/results}
mkdir -p "$OUT"
step() { echo "=== $* ($(date +%T))"; }
case "${1:-}" in
one)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/accelerate*.whl .whl/psutil*.whl >/dev/null 2>&1  # (transformers' fp8 loader in one test)
  step GPU tests
  PREFIXSCORE_TEST_TOKENIZER=.carry PYTHONPATH=/tmp/site:$PWD timeout 240 python3 -m pytest -q \
    -p no:cacheprovider --tb=short -rfE tests/test_kernels_fp8.py tests/test_fp8_checkpoints.py \
    tests/test_invariance.py tests/test_many.py 2>&1 | tail -30 | tee "$OUT/gpu_tests.log"
  step fp8; timeout 300 python3 -m bench.fp8_gpu 2>&1 | tail -12
  ;;
two)
  step fp8 quant; timeout 120 python3 -m bench.fp8_quant_gpu 2>&1 | tail -3
  step invariance; timeout 300 python3 -m bench.invariance_gpu --e2e-only 2>&1 | tail -8
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
