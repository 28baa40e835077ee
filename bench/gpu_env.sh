# Sourced by bench/*_gpu.sh on the GPU machine: the wheels its image lacks from .whl/ (as
# bench/gpu_wheels.txt says) on PYTHONPATH, then the repository, and $OUT for results.
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
