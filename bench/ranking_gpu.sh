#!/usr/bin/env bash
# Ranking at scale on the H200, in as few device calls as the 10-minute limit allows: the GPU tests
# of the kernels it touches, then W3's kernel arms, W3 text / W6 in process, and /v1/score with 8
# clients. Each stage writes its log and JSON under $OUT as it finishes.
#
#   bash bench/ranking_gpu.sh [tests] [arms] [ranking] [http] [fp8]   (default: all, in this order)
#
# Needs .whl/ (bench/gpu_wheels.txt) and .carry/ (SmolLM2's tokenizer files), as tests/gpu.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
stages=${*:-tests arms ranking http fp8}
[ -d /tmp/q05 ] || python3 -c 'from bench.gpu import real_form_model; real_form_model()'
for s in $stages; do
  echo "== $s $(date +%T)"
  case $s in
    tests) bash tests/gpu.sh -k "embedding or scorer or gemm or fused or rows or parity" ;;
    # the defaults (in-place residual, last layer for the read-out rows) against each arm
    arms) python3 -m bench.multi_item --requests 24 --ab prune_last_layer=0 attn.BLOCK_NI=64 \
            attn.BLOCK_M=64 ;;
    ranking) python3 -m bench.ranking -- --model /tmp/q05 --device cuda ;;
    http) python3 -m bench.ranking_http --server-cpus 0-9 --load-cpus 10-15 -- --model /tmp/q05 --device cuda ;;
    # W3 is compute-bound (GEMMs at the bf16 matmul rate): FP8 x FP8 past the skinny kernels
    fp8) OUT=$OUT/fp8 python3 -m bench.ranking -- --model /tmp/q05 --device cuda --dtype fp8 ;;
    *) echo "unknown stage $s"; exit 2 ;;
  esac 2>&1 | tee "$OUT/ranking_gpu_$s.log"
done
