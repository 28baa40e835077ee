"""The persistent block kernel (kernels/layer_triton.py): each phase against the four kernels it
is made of and the whole block against the torch reference, under the Triton interpreter (one
phase per launch: the interpreter runs programs one after another, so a grid barrier would spin
for ever); on CUDA, one launch of all four phases (three grid barriers) against the phases one
launch each, the four kernels and itself, eager and in a CUDA graph."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from tests.helpers import fix_interpreter  # noqa: E402

fix_interpreter()

from prefixscore.kernels.attention import attention_ref  # noqa: E402
from prefixscore.kernels.attention_o_triton import attention_o_residual_small  # noqa: E402
from prefixscore.kernels.gemm import gate_up_silu_ref, qkv_rope_ref  # noqa: E402
from prefixscore.kernels.gemm_triton import (  # noqa: E402
    gate_up_silu_small, linear_residual_small, qkv_rope_small)
from prefixscore.kernels.label_head import rms_norm as rms_norm_ref  # noqa: E402
from prefixscore.kernels.layer_triton import layer_config, layer_small  # noqa: E402
from prefixscore.kernels.options import DEFAULTS, KernelOptions  # noqa: E402
from prefixscore.kernels.triton_util import barrier_stalled  # noqa: E402
from tests.kernels.test_kernels_triton import make_plan  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
EPS = 1e-6
NAMES = ("q", "k", "v", "x1", "ssq1", "h", "x2", "ssq2")

# hidden, intermediate, Hq, Hkv, D, T, P, qkv bias, mlp bias, Qwen3's per-head norm, prefix ranges
CASES = [
    (128, 256, 4, 2, 32, 5, 7, True, False, False, False),  # Qwen2-like
    (96, 160, 4, 1, 32, 16, 20, False, True, True, True),  # K and N tails, GQA 4, a prefix bank
]


def make_block(case, dtype, seed):
    hid, inter, Hq, Hkv, D, T, P, qkv_bias, mlp_bias, qk_norm, ranges = case
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, s=1.0):
        return (torch.randn(*shape, generator=gen) * s).to(DEVICE, dtype)

    H = Hq + 2 * Hkv
    x = r(T, hid, s=2.0)
    pos = torch.arange(P, P + T)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    emb = torch.cat([pos[:, None] * inv[None]] * 2, -1)
    bs, be, own = (t.to(DEVICE) for t in make_plan(T, gen))
    if ranges:
        ps = torch.randint(0, P // 2, (T,), generator=gen, dtype=torch.int32)
        pe = (ps + torch.randint(1, P // 2 + 1, (T,), generator=gen, dtype=torch.int32)).clamp(max=P)
        prefix_range = (ps.to(DEVICE), pe.to(DEVICE))
    else:
        prefix_range = None
    return dict(
        x=x, ssq=x.float().square().sum(-1)[None].contiguous(),
        wqkv=r(H * D, hid, s=hid ** -0.5), bqkv=r(H * D) if qkv_bias else None,
        cos=emb.cos().to(DEVICE, dtype), sin=emb.sin().to(DEVICE, dtype),
        q_norm=r(D, s=0.3) + 1 if qk_norm else None, k_norm=r(D, s=0.3) + 1 if qk_norm else None,
        pk=r(P, Hkv, D), pv=r(P, Hkv, D), bs=bs, be=be, own=own, scale=D ** -0.5,
        wo=r(hid, Hq * D, s=(Hq * D) ** -0.5), wgu=r(2 * inter, hid, s=hid ** -0.5),
        bgu=r(2 * inter) if mlp_bias else None, wd=r(hid, inter, s=inter ** -0.5),
        bd=r(hid) if mlp_bias else None, Hq=Hq, Hkv=Hkv, D=D, prefix_range=prefix_range)


def run_layer(b, phases=((0, 3),), options=DEFAULTS):
    """The block through layer_small, in one launch per (first, last) -> the 8 intermediates."""
    out = None
    for ph in phases:
        _, _, out = layer_small(b["x"], b["ssq"], b["wqkv"], b["bqkv"], b["cos"], b["sin"], b["q_norm"],
                                b["k_norm"], EPS, b["pk"], b["pv"], b["bs"], b["be"], b["own"],
                                b["scale"], b["wo"], b["wgu"], b["bgu"], b["wd"], b["bd"], EPS, b["Hq"],
                                b["Hkv"], b["D"], b["prefix_range"], phases=ph, out=out, options=options)
    return out


def run_four(b):
    """The same block through the four skinny kernels it is made of."""
    q, k, v = qkv_rope_small(b["x"], b["wqkv"], b["bqkv"], b["cos"], b["sin"], b["Hq"], b["Hkv"], b["D"],
                             b["q_norm"], b["k_norm"], EPS, norm=(EPS, b["ssq"]))
    x1, s1 = attention_o_residual_small(q, k, v, b["pk"], b["pv"], b["bs"], b["be"], b["own"], b["scale"],
                                        b["wo"], b["x"], prefix_range=b["prefix_range"])
    h = gate_up_silu_small(x1, b["wgu"], b["bgu"], norm=(EPS, s1))
    x2, s2 = linear_residual_small(h, b["wd"], b["bd"], x1)
    return q, k, v, x1, s1, h, x2, s2


def run_reference(b):
    """model.Block's math in plain torch (HF's order: RMSNorm, then the linear)."""
    T, Hq, Hkv, D = b["x"].shape[0], b["Hq"], b["Hkv"], b["D"]
    q, k, v = qkv_rope_ref(rms_norm_ref(b["x"], None, EPS), b["wqkv"], b["bqkv"], b["cos"], b["sin"],
                           Hq, Hkv, D, b["q_norm"], b["k_norm"], EPS)
    o = attention_ref(q, k, v, b["pk"], b["pv"], b["bs"], b["be"], b["own"], b["scale"],
                      prefix_range=b["prefix_range"])
    x1 = b["x"] + torch.nn.functional.linear(o.reshape(T, -1), b["wo"])
    h = gate_up_silu_ref(rms_norm_ref(x1, None, EPS), b["wgu"], b["bgu"])
    return x1, x1 + torch.nn.functional.linear(h, b["wd"], b["bd"])


def assert_near(name, g, w):
    """On CUDA the persistent kernel's attention + O unit runs at other warps than its own kernel
    (and its down GEMM in fewer K splits), so sums round differently from there on: within 4 bf16
    steps (2^-5) at each tensor's scale, where a wrong input or epilogue is off by the whole value."""
    scale = w.float().abs().max().item()
    torch.testing.assert_close(g.float(), w.float(), rtol=2 ** -5, atol=2 ** -5 * scale, msg=name)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_each_phase_equals_its_kernel(case):
    """Each phase in a launch of its own, chained: every intermediate bitwise the four kernels'
    under the interpreter (it runs both at the same precision, so any difference is a different
    sum); on CUDA, QKV bitwise (the same unit at the same warps) and the rest near (assert_near)."""
    b = make_block(CASES[case], torch.bfloat16, 100 + case)
    got = run_layer(b, [(p, p) for p in range(4)])
    for i, (name, g, w) in enumerate(zip(NAMES, got, run_four(b))):
        assert g.shape == w.shape, name
        if CUDA and i >= 3:
            assert_near(name, g, w)
        else:
            assert torch.equal(g, w), (name, (g.float() - w.float()).abs().max())


@pytest.mark.parametrize("case", range(len(CASES)))
def test_rotated_dealing_is_the_same_block(case):
    """layer.rotate (each phase's units dealt first to the programs idle in the phase before)
    moves units between programs, never changes one: every intermediate bitwise the same."""
    b = make_block(CASES[case], torch.bfloat16, 400 + case)
    phases = [(0, 3)] if CUDA else [(p, p) for p in range(4)]
    rotated = run_layer(b, phases, KernelOptions(tune={"layer.rotate": 1}))
    for name, g, w in zip(NAMES, rotated, run_layer(b, phases)):
        assert torch.equal(g, w), name


@pytest.mark.parametrize("case", range(len(CASES)))
def test_block_matches_reference(case):
    """In fp32 (IEEE dots), the block against the torch reference: within 1e-4 of the values."""
    b = make_block(CASES[case], torch.float32, 200 + case)
    phases = [(0, 3)] if CUDA else [(p, p) for p in range(4)]
    got = run_layer(b, phases)
    x1, x2 = run_reference(b)
    torch.testing.assert_close(got[3], x1, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[6], x2, atol=1e-4, rtol=1e-4)
    # the row sums of squares the next block's norm reads, by column tile
    torch.testing.assert_close(got[7].sum(0), x2.square().sum(-1), atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("dims", [(896, 4864, 14, 2, 64, 28), (3584, 18944, 28, 4, 128, 112)])
@pytest.mark.parametrize("grid", [132, 264])
def test_config_fits_the_grid(dims, grid):
    """No phase has more units than the grid has programs (a program would run two in turn), and
    the workspace holds every phase's split-K partials."""
    hid, inter, Hq, Hkv, D, nt0 = dims
    cfg = layer_config(16, hid, inter, Hq, Hkv, D, nt0, torch.bfloat16, torch.device("cpu"), grid,
                       DEFAULTS)
    tiles = {"C0": 6, "C2": 6, "C3": 6}  # SKINNY_KEYS' TILES
    for c in ("C0", "C2", "C3"):
        t = cfg[c]
        assert t[tiles[c]] * t[2] <= grid and t[2] * t[3] * t[1] >= (inter if c == "C3" else hid)
    assert cfg["C1"][4] * cfg["C1"][5] <= grid
    assert cfg["units"] <= grid and cfg["ws"] >= 16 * cfg["C3"][2] * hid


def test_barrier_stalled_reads_and_clears_the_flag():
    """A barrier that gave up leaves 1 in its buffer's last counter: reported once (for the device
    named with or without its index), then cleared."""
    from prefixscore.kernels.triton_util import _counters

    buf = _counters(torch.device(DEVICE))
    assert not barrier_stalled(DEVICE)
    buf[-1] = 1
    assert barrier_stalled(torch.device(DEVICE)) and buf[-1].item() == 0
    assert not barrier_stalled(DEVICE)


def replayed(fn):
    """fn's output from a CUDA graph of it, replayed three times (warmed up first, as a capture
    wants)."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    return got


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("T", [1, 8, 16])
def test_gpu_one_launch(T):
    """One launch, three grid barriers: bitwise the four phases launched apart (the same units),
    the same on every run and in a CUDA graph replay, and near the four kernels (assert_near)."""
    case = (896, 4864, 14, 2, 64, T, 40, True, False, False, False)
    b = make_block(case, torch.bfloat16, 300 + T)
    one = run_layer(b)
    apart = run_layer(b, [(p, p) for p in range(4)])
    for name, g, w in zip(NAMES, one, apart):
        assert torch.equal(g, w), name
    assert all(torch.equal(g, w) for g, w in zip(one, run_layer(b)))
    for name, g, w in zip(NAMES, replayed(lambda: run_layer(b)), one):
        assert torch.equal(g, w), name
    for name, g, w in zip(NAMES, one, run_four(b)):
        assert_near(name, g, w)
    assert not barrier_stalled(torch.device("cuda"))  # every barrier opened (none gave up)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_chained_blocks_with_trigger_and_rotation():
    """Three blocks in a row, each reading the one before's x2 and its sums of squares, eager and
    replayed in a CUDA graph: with layer.trigger (the next launch's programs start before this one
    ends, and must still read its writes) and layer.rotate, bitwise the default launches'."""
    case = (896, 4864, 14, 2, 64, 8, 40, True, False, False, False)
    b = make_block(case, torch.bfloat16, 500)

    def chain(options):
        x, ssq = b["x"], b["ssq"]
        for _ in range(3):
            x, ssq, _ = layer_small(x, ssq, b["wqkv"], b["bqkv"], b["cos"], b["sin"], None, None, EPS,
                                    b["pk"], b["pv"], b["bs"], b["be"], b["own"], b["scale"], b["wo"],
                                    b["wgu"], b["bgu"], b["wd"], b["bd"], EPS, b["Hq"], b["Hkv"], b["D"],
                                    options=options)
        return x

    want = chain(DEFAULTS)
    fast = KernelOptions(tune={"layer.trigger": 1, "layer.rotate": 1})
    assert torch.equal(chain(fast), want)
    assert torch.equal(replayed(lambda: chain(fast)), want)
    assert not barrier_stalled(torch.device("cuda"))
