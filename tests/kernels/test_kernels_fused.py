"""Fused block kernels (kernels/fused_triton.py) against their torch references, under the Triton
interpreter on CPU (TRITON_INTERPRET=1) or for real on CUDA. Fresh random inputs per case."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from prefixscore.kernels import fused, fused_triton  # noqa: E402
from prefixscore.kernels.label_head import rms_norm as rms_norm_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # abs+rel; bf16: one rounding step of values ~1


def close(a, b, dtype):
    assert torch.isfinite(a.float()).all()
    torch.testing.assert_close(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H", [(1, 64), (7, 896), (33, 200)])
def test_rms_norm(T, H, dtype):
    g = torch.Generator().manual_seed(T * H)
    x = (torch.randn(T, H, generator=g) * 3).to(DEV, dtype)
    w = torch.rand(H, generator=g).add(0.5).to(DEV, dtype)
    for weight in (w, None):  # None: unit weight (the block's norms, folded into the next linear)
        out = torch.full_like(x, float("nan"))
        fused_triton.rms_norm_triton(x, weight, 1e-5, out)
        close(out, rms_norm_ref(x, weight, 1e-5), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,Hq,Hkv,D,qk_norm", [(5, 4, 2, 64, False), (3, 14, 2, 64, True),
                                                 (9, 7, 1, 128, False), (1, 2, 2, 32, True)])
def test_rope_qk(T, Hq, Hkv, D, qk_norm, dtype):
    g = torch.Generator().manual_seed(T + Hq * D)
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g).to(DEV, dtype)
    pos = torch.randint(0, 4000, (T,), generator=g).float()
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    emb = torch.cat([pos[:, None] * inv] * 2, -1)
    cos, sin = emb.cos().to(DEV, dtype), emb.sin().to(DEV, dtype)
    qn = kn = None
    if qk_norm:
        qn = torch.rand(D, generator=g).add(0.5).to(DEV, dtype)
        kn = torch.rand(D, generator=g).add(0.5).to(DEV, dtype)
    q, k, v = fused_triton.rope_qk_triton(qkv, cos, sin, Hq, Hkv, D, qn, kn, 1e-6)
    rq, rk, rv = fused.rope_qk_ref(qkv, cos, sin, Hq, Hkv, D, qn, kn, 1e-6)
    close(q, rq, dtype)
    close(k, rk, dtype)
    assert torch.equal(v, rv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,I", [(1, 128), (6, 1536), (3, 4864)])
def test_silu_mul(T, I, dtype):
    g = torch.Generator().manual_seed(T * I)
    gu = torch.randn(T, 2 * I, generator=g).mul(3).to(DEV, dtype)
    close(fused_triton.silu_mul_triton(gu), fused.silu_mul_ref(gu), dtype)
    # into rows of a larger output (gemm.gate_up_silu's chunks): those rows only, poison around
    out = torch.full((T + 4, I), float("nan"), device=DEV, dtype=dtype)
    fused_triton.silu_mul_triton(gu, out=out[2:2 + T])
    close(out[2:2 + T], fused.silu_mul_ref(gu), dtype)
    assert out[:2].isnan().all() and out[2 + T:].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H,D", [(1, 64, 64), (9, 896, 64), (40, 200, 96)])
def test_embed_rope(T, H, D, dtype):
    """Gathers are copies: bitwise equal to the reference; the sums of squares are fp32 sums."""
    g = torch.Generator().manual_seed(T * H + D)
    V, npos = 1000, 300
    emb = torch.randn(V, H, generator=g).to(DEV, dtype)
    ct, st = (torch.randn(npos, D, generator=g).to(DEV, dtype) for _ in range(2))
    tok = torch.randint(0, V, (T,), generator=g, dtype=torch.int32).to(DEV)
    pos = torch.randint(0, npos, (T,), generator=g, dtype=torch.int32).to(DEV)
    x, ssq, cos, sin = fused_triton.embed_rope_triton(tok, pos, emb, ct, st)
    rx, _, rcos, rsin = fused.embed_rope_ref(tok, pos, emb, ct, st)
    assert torch.equal(x, rx) and torch.equal(cos, rcos) and torch.equal(sin, rsin)
    assert ssq.shape == (1, T) and ssq.dtype == torch.float32
    torch.testing.assert_close(ssq[0], rx.float().pow(2).sum(-1), atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("n", [1, 4095, 4097, 10000])
def test_copy_bytes(n):
    """The graphs' copy kernel (engine.GraphRunner): the first n bytes, nothing past them; on CUDA
    from pinned host memory to the GPU and back, as the engine uses it."""
    g = torch.Generator().manual_seed(n)
    src = torch.randint(0, 256, (n + 7,), generator=g, dtype=torch.uint8)
    if DEV == "cuda":
        src = src.pin_memory()
        dev = torch.zeros(n + 7, dtype=torch.uint8, device="cuda")
        fused_triton.copy_bytes(src, dev, n)
        back = torch.zeros(n + 7, dtype=torch.uint8).pin_memory()
        fused_triton.copy_bytes(dev, back, n)
        torch.cuda.synchronize()
    else:
        back = torch.zeros(n + 7, dtype=torch.uint8)
        fused_triton.copy_bytes(src, back, n)
    assert torch.equal(back[:n], src[:n]) and not back[n:].any()
