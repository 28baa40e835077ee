"""W1 / W4 on the GPU: correctness against HF, one-request latency next to the peers and floors, and
the kernel profile (bench/gpu.py without its batch sweep). Writes $OUT/latency.json.

    python -m bench.latency [--quick] [--skip-7b]
"""
import sys

from .gpu import main

if __name__ == "__main__":
    main(["--part", "latency", *sys.argv[1:]])
