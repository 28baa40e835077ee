#!/usr/bin/env bash
# The kernels' GPU stages (issue 52), each logged under $OUT/<stage>.log with its JSON beside it:
#
#   tests       the GPU tests of the GEMMs, FP8, batch invariance and graphs (tests/gpu.sh's files
#               that touch them)
#   stream      bench.gluon_stream: can a TMA ring keep HBM busy across grid barriers?
#   timeline    bench.gpu --ab BATCH_INVARIANT --profile: W1 with batch-invariant mode off and on,
#               kernel by kernel
#   fp8         bench.fp8_gpu: bf16, fp8 and fp8 with the fp16 dot (KernelOptions.fp8_fp16),
#               fidelity against HF fp32, W1 / W4, the batch sweep (FP8_ARGS: e.g. --skip-7b)
#   invariance  bench.invariance_gpu --e2e-only: W1, W2 and the bits, mode off and on
#
#   timeline64  the same with 64 requests per replay (past the skinny GEMMs' T in the default mode)
#   w2          the same at 1,024 requests per replay (8,192 tokens, the largest graph; W2's rate within
#               4% in the default mode), and with down's and O's wide tiles 128 columns wide: the
#               batch-invariant GEMMs against cuBLAS
#
#   bash bench/kernels_gpu.sh [stage ...]      (default: tests stream timeline; JSON in $OUT/<stage>/;
#                                               STAGE_S: seconds a stage may take, default 600)
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
[ -d .carry ] && export PREFIXSCORE_TEST_TOKENIZER=${PREFIXSCORE_TEST_TOKENIZER:-$PWD/.carry}

stage() {  # name, command...
  local name=$1; shift
  echo "== $name: $*"
  local t0=$SECONDS
  mkdir -p "$OUT/$name"
  env OUT="$OUT/$name" timeout "${STAGE_S:-600}" "$@" >"$OUT/$name.log" 2>&1
  echo "== $name: exit $? after $((SECONDS - t0)) s"
  tail -25 "$OUT/$name.log"
}

for s in "${@:-tests stream timeline}"; do
  for name in $s; do
    case $name in
      tests) stage tests python3 -m pytest -q -p no:cacheprovider -rfE tests/test_invariance.py \
               tests/kernels/test_kernels_gemm.py tests/kernels/test_kernels_triton.py \
               tests/kernels/test_kernels_fp8.py tests/test_fp8_model.py \
               "tests/test_scorer.py::test_gpu_graph_copies_change_nothing" ;;
      stream) stage stream python3 -m bench.gluon_stream ;;
      timeline) stage timeline python3 -m bench.gpu --ab BATCH_INVARIANT --profile --ab-shapes 0.5B ;;
      timeline64) stage timeline64 python3 -m bench.gpu --ab BATCH_INVARIANT --profile --ab-shapes 0.5B \
                    --ab-batch 64 ;;
      w2) stage w2 python3 -m bench.gpu --ab-shapes 0.5B --ab-batch 1024 --profile --ab \
            "BATCH_INVARIANT;batch_invariant=1,down.BLOCK_N=128" ;;
      fp8) stage fp8 python3 -m bench.fp8_gpu ${FP8_ARGS:-} ;;
      invariance) stage invariance python3 -m bench.invariance_gpu --e2e-only ;;
      *) echo "no stage $name"; exit 2 ;;
    esac
  done
done
