#!/usr/bin/env bash
# The serving issue's H200 run in one device call (about 6 minutes): wheels the machine lacks from
# .whl/, the 0.5B-shape random model with SmolLM2's tokenizer from .carry/ (bench.gpu's real form),
# then text-vs-ids in process (bench.overlap) and the HTTP/gRPC open-loop runs (bench.http).
# .whl/: bench/gpu_wheels.txt says how to fill it; .carry/: tokenizer.json, tokenizer_config.json,
# chat_template.jinja of the bundled model's converted folder (~/.cache/prefixscore/SmolLM2-*).
#   device run, carry [".whl", ".carry"]:  bash bench/serve_gpu.sh
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-bench/results}
# Fail in seconds, not after the model is built: every module a server process imports.
python3 -c 'import fastapi, uvicorn, httptools, zmq, msgspec, grpc, prometheus_client
import prefixscore.serve.http, prefixscore.serve.grpc_server, prefixscore.serve.engine_proc' || exit 1
nproc; nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c 'from bench.gpu import real_form_model; real_form_model()' || exit 1
MODEL="--model /tmp/q05 --device cuda"
timeout 150 python3 -m bench.overlap --repeats 5 -- $MODEL 2>&1 | tee $OUT/overlap.log
timeout 330 python3 -m bench.http --configs 1,8 --server-cpus 0-9 --load-cpus 10-15 --load-procs 6 \
  --rates 2000,6000,12000,20000,28000,36000,45000 --duration 3 --refine 1 --serial 1000 \
  -- $MODEL 2>&1 | tee $OUT/http.log
mv $OUT/http.json $OUT/http_http.json 2>/dev/null; mv $OUT/http_latency.png $OUT/http_latency_http.png 2>/dev/null
timeout 120 python3 -m bench.http --proto grpc --configs 8 --server-cpus 0-9 --load-cpus 10-15 \
  --load-procs 6 --rates 2000,6000 --duration 2 --refine 0 --at 0.5 --serial 1000 \
  -- $MODEL 2>&1 | tee $OUT/grpc.log
mv $OUT/http.json $OUT/http_grpc.json 2>/dev/null
ls -la $OUT
