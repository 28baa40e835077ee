#!/usr/bin/env bash
# Issue 20's H200 run in one device call: LoRA fine-tuning time per epoch and memory (0.5B, 7B
# shapes) and adapter-vs-base latency. .whl/ holds peft, accelerate, psutil (bench/gpu_wheels.txt);
# .carry/ the tokenizer files and intent_dev.csv (as bench/serve_gpu.sh).
#   device run, carry [".whl", ".carry"]:  bash bench/finetune_gpu.sh
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-bench/results}
python3 -c 'import peft, prefixscore.train.lora' || exit 1
timeout 540 python3 -m bench.finetune_gpu --shapes 0.5B,7B --epochs 2 2>&1 | tee $OUT/finetune_gpu.log
