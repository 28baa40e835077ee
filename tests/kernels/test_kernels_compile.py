"""Every Triton kernel compiles to an sm_90 cubin (H100/H200) with the production launch configs,
on this machine, GPU or not: the interpreter tests run the kernels' math but never the compiler.
tests/aot_compile.py does the work in a subprocess (it needs TRITON_INTERPRET unset, which the
other kernel tests set for this process)."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Found without importing triton: the other kernel tests must import it first, after setting
# TRITON_INTERPRET (a triton imported without it leaves their kernels uninterpreted).
_spec = importlib.util.find_spec("triton")
PTXAS = (Path(_spec.submodule_search_locations[0]) / "backends" / "nvidia" / "bin" / "ptxas"
         if _spec else None)


@pytest.mark.skipif(PTXAS is None or not PTXAS.exists(), reason="no triton, or its wheel ships no ptxas")
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).parent / "aot_compile.py"
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                       timeout=900)
    compiled = [l for l in r.stdout.splitlines() if l.startswith("ok ")]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # every kernel family, in its production configs
    for family in ("skinny 0.5B", "skinny 7B", "attention T=", "attention (batch-invariant)",
                   "attention+O", "label head",
                   "rms_norm", "rope_qk", "silu_mul", "embed_rope"):
        assert any(l.startswith("ok " + family) for l in compiled), family
    # batch-invariant wide tiles, checked against spills, for both weight formats
    assert {"fp8=False", "fp8=True"} <= {w for l in compiled if "wide=4096" in l for w in l.split()}


@pytest.mark.skipif(PTXAS is None or not PTXAS.exists(), reason="no triton, or its wheel ships no ptxas")
def test_gluon_stream_probe_compiles_for_sm90():
    """bench/gluon_stream.py (the Gluon re-plan's premise; on the GPU: python -m bench.gluon_stream):
    the interpreter does not run Gluon, so its CPU coverage is this build of every variant, and the
    torch sums it checks the kernel against, checked against the dealing tile by tile."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "bench.gluon_stream", "--compile-only"], env=env, cwd=root,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    built = [l for l in r.stdout.splitlines() if l.startswith("ok gluon_stream sync=")]
    assert len(built) == 4 and all("tma 4" in l for l in built), r.stdout
    assert "ok gluon_stream reference" in r.stdout, r.stdout  # its sums against the tile-by-tile ones
