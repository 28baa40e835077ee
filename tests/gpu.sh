#!/usr/bin/env bash
# The GPU tests, on a CUDA machine (the H200): every test file whose tests run on the GPU when one
# is present (the kernels against their torch references, the engine against Hugging Face, graphs,
# FP8, batch invariance), with CUDA's compiler instead of Triton's interpreter.
#
#   bash tests/gpu.sh [pytest args]
#
# A machine with no package registry takes what its image lacks from .whl/ (wheels for Python
# 3.12, filled as bench/gpu_wheels.txt says), and the tiny test models take SmolLM2's tokenizer
# files from .carry/ (tokenizer.json, tokenizer_config.json, chat_template.jinja: copy them from
# the bundled model's converted folder, ~/.cache/prefixscore/SmolLM2-*), since the bundled GGUF
# is too large to carry. Tests that need the bundled model itself skip where it is not installed.
set -uo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
[ -d .carry ] && export PREFIXSCORE_TEST_TOKENIZER=${PREFIXSCORE_TEST_TOKENIZER:-$PWD/.carry}
python3 -c 'import torch; assert torch.cuda.is_available(), "no CUDA GPU here"' || exit 1
files=$(grep -rl --include='test_*.py' "cuda.is_available" tests | sort)
exec python3 -m pytest -q -p no:cacheprovider -rfE $files "$@"
