"""W2 on the GPU: correctness against HF, then requests/s over batch sizes up to 4096 next to the
weight and FLOP floors, and the latency-vs-batch plot (bench/gpu.py's batch sweep).
Writes $OUT/throughput.json and $OUT/throughput.png.

    python -m bench.throughput [--quick] [--skip-7b]
"""
import sys

from .gpu import main

if __name__ == "__main__":
    main(["--part", "throughput", *sys.argv[1:]])
