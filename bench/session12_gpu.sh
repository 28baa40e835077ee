#!/usr/bin/env bash
# Twelfth session's H200 call: the GPU tests of Classifier.many (one graph pool for several
# classifiers) and the serving run again after the front ends build their prompt at start-up.
#   device run, carry [".whl", ".carry"]:  bash bench/session12_gpu.sh
set -uo pipefail
export OUT=${OUT:-bench/results}
PREFIXSCORE_TEST_TOKENIZER=.carry timeout 120 python3 -m pytest -q -p no:cacheprovider \
  tests/test_many.py tests/test_batch.py 2>&1 | tail -5 | tee $OUT/gpu_tests.log
bash bench/serve_gpu.sh
