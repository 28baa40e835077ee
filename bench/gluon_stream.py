"""Can a warp-specialized TMA ring keep HBM busy across grid barriers? (the Gluon re-plan's premise)

    python -m bench.gluon_stream [--layers 24] [--tokens 16]     (CUDA, sm_90; writes $OUT/gluon_stream.json)
    python -m bench.gluon_stream --compile-only      (any machine: the sm_90 builds, the reference's check)

Issue 35's Triton block in one launch (removed by issue 50; bench/README.md names a commit that
has it) lost to the four kernels because a program could preload the next phase's weights only
into registers, about 64 KB, so ~40% of each layer streamed after its barriers. The re-plan stages
weights in shared memory instead: one CTA per SM, a producer warp TMA-copies the weight tiles of the
CTA's coming units into a ring of STAGES buffers and never waits on activations, only on free
buffers, so it runs ahead across phases and layers; the consumer warps wait on the grid barrier,
load their activations and multiply from the ring. Before building the block on it, this measures
the premise on the 0.5B block's four weight matrices (QKV 1152 x 896, O 896 x 896, gate/up 9728 x
896, down 896 x 4864), 24 layers, T tokens:

  stream   no barriers: how fast the ring moves a layer's 29.8 MB (against a device copy's rate)
  barrier  a grid barrier after each phase, the activations loaded from memory after it and the
           phase's output stored before it: the four round trips a block cannot avoid

at a deep ring (~160 KB an SM, the design) and shallow ones. The premise holds if `barrier` stays
near `stream` at the deep ring: the barriers' latency then hides under the weight stream.

The math is real (each tile is an mma_v2 of T x 64 activations by a 64 x 64 weight tile, every
tile of a CTA summed into one accumulator) so the run checks itself: each CTA's sum against the
same sum in torch, which catches a tile read from the wrong stage or phase. Not a model: the sums
mean nothing, and attention's own work is left out (the O phase stands in for it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, mma_v2, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

HID, INTER, QKV_N = 896, 4864, 1152  # Qwen2.5-0.5B: 14 + 2 + 2 heads of 64
SHAPES = ((QKV_N, HID), (HID, HID), (2 * INTER, HID), (HID, INTER))  # (N, K) of each phase
BN, BK = 64, 64  # a weight tile: 8 KB of bf16, one 128-byte swizzled row per output column
SPIN_LIMIT = gl.constexpr(1 << 22)  # polls before a barrier gives up and raises FLAG (never a hang)
VARIANTS = ((0, 20), (1, 20), (1, 10), (1, 4))  # (barriers, ring stages): 20 stages = 160 KB an SM


@gluon.jit
def _produce(desc, bufs, ready, empty, it, l, g, G, N: gl.constexpr, K: gl.constexpr,
             BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
    """One phase of one layer: the CTA's contiguous share of the phase's tiles into the ring."""
    KT: gl.constexpr = K // BK
    TILES: gl.constexpr = (N // BN) * KT
    for i in range(g * TILES // G, (g + 1) * TILES // G):
        s = it % STAGES
        # a buffer is free once the consumer arrived on it (mbarriers start in phase 1 complete,
        # so the first pass over the ring does not wait)
        mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), desc.block_type.nbytes)
        tma.async_copy_global_to_shared(desc, [l * N + (i // KT) * BN, (i % KT) * BK], ready.index(s),
                                        bufs.index(s))
        it += 1
    return it


@gluon.jit
def _producer(w0, w1, w2, w3, bufs, ready, empty, L, G, BN: gl.constexpr, BK: gl.constexpr,
              STAGES: gl.constexpr, K3: gl.constexpr):
    g = gl.program_id(0)
    it = 0
    for l in range(L):
        it = _produce(w0, bufs, ready, empty, it, l, g, G, 1152, 896, BN, BK, STAGES)
        it = _produce(w1, bufs, ready, empty, it, l, g, G, 896, 896, BN, BK, STAGES)
        it = _produce(w2, bufs, ready, empty, it, l, g, G, 2 * K3, 896, BN, BK, STAGES)
        it = _produce(w3, bufs, ready, empty, it, l, g, G, 896, K3, BN, BK, STAGES)


@gluon.jit
def _consume(X, bufs, ready, empty, it, acc, g, G, N: gl.constexpr, K: gl.constexpr, XS: gl.constexpr,
             BT: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
    """One phase: for each of the CTA's tiles, its activations from memory (after the barrier, as
    a block's are) times the tile from the ring."""
    KT: gl.constexpr = K // BK
    TILES: gl.constexpr = (N // BN) * KT
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 4], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    xl: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    t = gl.arange(0, BT, layout=gl.SliceLayout(1, xl))
    kk = gl.arange(0, BK, layout=gl.SliceLayout(0, xl))
    for i in range(g * TILES // G, (g + 1) * TILES // G):
        s = it % STAGES
        # from L2 (.cg), as a block's activations are: another SM wrote them before the barrier
        x = gl.load(X + t[:, None] * XS + ((i % KT) * BK + kk)[None, :], cache_modifier=".cg")
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        b = bufs.index(s).permute((1, 0)).load(b_l)
        fence_async_shared()  # order the shared-memory read before the TMA that refills the buffer
        mbarrier.arrive(empty.index(s), count=1)
        acc = mma_v2(gl.convert_layout(x, a_l), b, acc)
        it += 1
    return it, acc


@gluon.jit
def _store_tile(P, acc, g, BT: gl.constexpr, BN: gl.constexpr):
    """CTA g's [BT, BN] fp32 accumulator to P[g]."""
    ol: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [4, 1], [1, 0])
    o = gl.convert_layout(acc, ol)
    r = gl.arange(0, BT, layout=gl.SliceLayout(1, ol))
    c = gl.arange(0, BN, layout=gl.SliceLayout(0, ol))
    gl.store(P + g * BT * BN + r[:, None] * BN + c[None, :], o)


@gluon.jit
def _phase_end(Y, BAR, FLAG, acc, j, g, G, SYNC: gl.constexpr, BT: gl.constexpr, BN: gl.constexpr):
    """The phase's output out, then the grid barrier (bounded: a stall raises FLAG, never hangs)."""
    if SYNC:
        _store_tile(Y, acc, g, BT, BN)
        gl.thread_barrier()  # every consumer warp's stores before the one arrival
        gl.atomic_add(BAR, 1, sem="release", scope="gpu")
        n = 0
        while (gl.atomic_add(BAR, 0, sem="acquire", scope="gpu") < (j + 1) * G) & (n < SPIN_LIMIT):
            n += 1
        if n >= SPIN_LIMIT:
            gl.atomic_max(FLAG, 1)


@gluon.jit
def _consumer(X, Y, OUT, BAR, FLAG, bufs, ready, empty, L, G, SYNC: gl.constexpr, BT: gl.constexpr,
              BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, K3: gl.constexpr):
    g = gl.program_id(0)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 4], instr_shape=[16, 8])
    acc = gl.zeros([BT, BN], gl.float32, mma)
    it = 0
    for l in range(L):
        it, acc = _consume(X, bufs, ready, empty, it, acc, g, G, 1152, 896, K3, BT, BN, BK, STAGES)
        _phase_end(Y, BAR, FLAG, acc, 4 * l, g, G, SYNC, BT, BN)
        it, acc = _consume(X, bufs, ready, empty, it, acc, g, G, 896, 896, K3, BT, BN, BK, STAGES)
        _phase_end(Y, BAR, FLAG, acc, 4 * l + 1, g, G, SYNC, BT, BN)
        it, acc = _consume(X, bufs, ready, empty, it, acc, g, G, 2 * K3, 896, K3, BT, BN, BK, STAGES)
        _phase_end(Y, BAR, FLAG, acc, 4 * l + 2, g, G, SYNC, BT, BN)
        it, acc = _consume(X, bufs, ready, empty, it, acc, g, G, 896, K3, K3, BT, BN, BK, STAGES)
        _phase_end(Y, BAR, FLAG, acc, 4 * l + 3, g, G, SYNC, BT, BN)
    _store_tile(OUT, acc, g, BT, BN)


@gluon.jit
def stream_kernel(w0, w1, w2, w3, X, Y, OUT, BAR, FLAG, L, G, SYNC: gl.constexpr, BT: gl.constexpr,
                  BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, K3: gl.constexpr):
    bufs = gl.allocate_shared_memory(w0.dtype, [STAGES, BN, BK], w0.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    gl.warp_specialize([(_consumer, (X, Y, OUT, BAR, FLAG, bufs, ready, empty, L, G, SYNC, BT, BN, BK, STAGES, K3)),
                        (_producer, (w0, w1, w2, w3, bufs, ready, empty, L, G, BN, BK, STAGES, K3))],
                       [1], [40])


def tile_layout():
    return gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16)


def launch_args(ws, T, G, sync, stages, dev):
    """The kernel's arguments for weights ws (one [L * N, K] matrix per phase) and a grid of G."""
    descs = [TensorDescriptor.from_tensor(w, [BN, BK], tile_layout()) for w in ws]
    L = ws[0].shape[0] // QKV_N
    x = torch.randn(16, INTER, device=dev).to(torch.bfloat16)
    x[T:] = 0  # rows past T: padding, as in a block's 16-row tile
    bufs = dict(X=x, Y=torch.zeros(G, 16, BN, device=dev), OUT=torch.zeros(G, 16, BN, device=dev),
                BAR=torch.zeros(1, dtype=torch.int32, device=dev), FLAG=torch.zeros(1, dtype=torch.int32, device=dev))
    args = (*descs, bufs["X"], bufs["Y"], bufs["OUT"], bufs["BAR"], bufs["FLAG"], L, G)
    consts = dict(SYNC=sync, BT=16, BN=BN, BK=BK, STAGES=stages, K3=INTER)
    return args, consts, bufs


def reference(ws, x, G):
    """Each CTA's sum over its tiles of x[:, k-tile] @ W[tile]^T (fp32, the kernel's dealing), and
    the same sum over |x| and |W| (the scale of its rounding error)."""
    out, mag = torch.zeros(2, G, 16, BN, device=x.device)
    for w, (N, K) in zip(ws, SHAPES):
        L, KT = w.shape[0] // N, K // BK
        tiles = (N // BN) * KT
        # CTA g holds tiles [g * tiles // G, (g + 1) * tiles // G); tile i = n * KT + k
        owner = torch.searchsorted(torch.arange(G + 1, device=x.device) * tiles // G,
                                   torch.arange(tiles, device=x.device), right=True) - 1
        for o, f in ((out, lambda v: v), (mag, torch.abs)):
            wt = f(w.float()).view(L, N // BN, BN, KT, BK)
            xt = f(x[:, :K].float()).view(16, KT, BK)
            prod = torch.einsum("tkb,lnckb->lnktc", xt, wt).reshape(L, tiles, 16, BN)
            o.index_add_(0, owner, prod.sum(0))
    return out, mag


def check(G, sync, stages, dev, layers=2):
    """The kernel's sums against torch's on 2 layers (the ring wraps within each): the products are
    exact in fp32, so the two differ only by fp32 rounding of n_adds terms, at most
    n_adds * 2^-24 * sum|terms| apiece; one tile from the wrong stage moves a sum by about
    sqrt(64) |x| |w|, some 10x that bound at 2 layers (it would hide under it at 24)."""
    gen = torch.Generator(device=dev).manual_seed(1)
    ws = [(torch.randn(layers * N, K, generator=gen, device=dev) * 0.05).to(torch.bfloat16) for N, K in SHAPES]
    args, consts, bufs = launch_args(ws, 16, G, sync, stages, dev)
    stream_kernel[(G,)](*args, **consts, num_warps=4)
    torch.cuda.synchronize()
    ref, mag = reference(ws, bufs["X"], G)
    n_adds = layers * (sum((N // BN) * (K // BK) for N, K in SHAPES) // G + 4) * BK
    excess = ((bufs["OUT"] - ref).abs() - n_adds * 2 ** -24 * mag).max().item()
    return excess <= 0 and not bufs["FLAG"].item(), (bufs["OUT"] - ref).abs().max().item()


def time_us(fn, reps=20, back_to_back=10):
    """GPU µs per call, median over reps: back_to_back calls between two events, so the GPU never
    waits on the host's launches after the first."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(back_to_back):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / back_to_back)
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--compile-only", action="store_true", help="build the variants for sm_90, no GPU needed")
    a = p.parse_args(argv)
    if a.compile_only:
        return compile_only()
    dev = torch.device("cuda")
    G = torch.cuda.get_device_properties(dev).multi_processor_count
    gen = torch.Generator(device=dev).manual_seed(0)
    ws = [(torch.randn(a.layers * N, K, generator=gen, device=dev) * 0.05).to(torch.bfloat16) for N, K in SHAPES]
    nbytes = sum(w.numel() * 2 for w in ws)
    copy_dst = [torch.empty_like(w) for w in ws]
    copy_us = time_us(lambda: [d.copy_(w) for d, w in zip(copy_dst, ws)])
    rows = [dict(variant="device copy (read + write)", us_per_layer=copy_us / a.layers,
                 read_GBps=nbytes / copy_us / 1e3)]
    print(f"{a.layers} layers, {nbytes / 1e6:.0f} MB of weights, T={a.tokens}, {G} CTAs")
    print(f"{'variant':34s} {'us/layer':>9s} {'GB/s read':>10s}  check")
    print(f"{rows[0]['variant']:34s} {rows[0]['us_per_layer']:9.2f} {rows[0]['read_GBps']:10.0f}")
    out_dir = Path(os.environ.get("OUT", "bench/results"))
    for sync, stages in VARIANTS:
        name = f"{'barrier' if sync else 'stream'}, {stages} stages ({stages * BN * BK * 2 >> 10} KB)"
        try:
            ok, err = check(G, sync, stages, dev)
            args, consts, bufs = launch_args(ws, a.tokens, G, sync, stages, dev)

            def run():
                bufs["BAR"].zero_()
                stream_kernel[(G,)](*args, **consts, num_warps=4)

            us = time_us(run)
            row = dict(variant=name, sync=sync, stages=stages, us_per_layer=us / a.layers,
                       read_GBps=nbytes / us / 1e3, ok=ok, max_abs_err=err,
                       barrier_stalled=bool(bufs["FLAG"].item()))
        except Exception as e:  # a variant that fails to build or run is noted, not fatal
            row = dict(variant=name, sync=sync, stages=stages, error=f"{type(e).__name__}: {str(e)[:300]}")
        rows.append(row)
        if "error" in row:
            print(f"{name:34s} failed: {row['error']}")
        else:
            print(f"{name:34s} {row['us_per_layer']:9.2f} {row['read_GBps']:10.0f}  "
                  f"{'ok' if row['ok'] else 'WRONG'} (max err {row['max_abs_err']:.1e})"
                  f"{', BARRIER STALLED' if row['barrier_stalled'] else ''}")
    res = dict(device=torch.cuda.get_device_name(dev), layers=a.layers, tokens=a.tokens, ctas=G,
               weight_bytes=nbytes, rows=rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gluon_stream.json").write_text(json.dumps(res, indent=1))
    print(f"wrote {out_dir / 'gluon_stream.json'}")


def check_reference(G=5, layers=2):
    """reference() against the producer's dealing spelled out tile by tile (CPU): the sums a correct
    kernel must match, so a GPU run's WRONG means the kernel."""
    gen = torch.Generator().manual_seed(0)
    ws = [(torch.randn(layers * N, K, generator=gen) * 0.05).to(torch.bfloat16) for N, K in SHAPES]
    x = torch.randn(16, INTER, generator=gen).to(torch.bfloat16)
    ref, mag = reference(ws, x, G)
    want = torch.zeros(G, 16, BN)
    for g in range(G):
        for l in range(layers):
            for w, (N, K) in zip(ws, SHAPES):
                KT = K // BK
                tiles = (N // BN) * KT
                for i in range(g * tiles // G, (g + 1) * tiles // G):
                    r, c = l * N + (i // KT) * BN, (i % KT) * BK
                    want[g] += x[:, c:c + BK].float() @ w[r:r + BN, c:c + BK].float().t()
    assert torch.allclose(ref, want, rtol=0, atol=1e-6 * mag.max().item()), (ref - want).abs().max()
    assert (mag >= ref.abs()).all()
    print("ok gluon_stream reference", flush=True)


def compile_only():
    """Each variant through the whole pipeline to an sm_90 cubin (no GPU: the interpreter does not
    run Gluon). Prints shared memory and the ring's TMA and mbarrier counts. Then the reference's
    check (check_reference)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    desc = TensorDescriptor.from_tensor(torch.empty(QKV_N, HID, dtype=torch.bfloat16), [BN, BK], tile_layout())
    import inspect
    params = list(inspect.signature(stream_kernel.fn).parameters)
    for sync, stages in VARIANTS:
        consts = dict(SYNC=sync, BT=16, BN=BN, BK=BK, STAGES=stages, K3=INTER)
        sig = {p: "constexpr" if p in consts else "i32" for p in params}
        sig.update({w: mangle_type(desc) for w in ("w0", "w1", "w2", "w3")},
                   X="*bf16", Y="*fp32", OUT="*fp32", BAR="*i32", FLAG="*i32")
        src = GluonASTSource(stream_kernel, sig, constexprs={(params.index(k),): v for k, v in consts.items()},
                             attrs={(params.index(p),): [["tt.divisibility", 16]] for p in ("X", "Y", "OUT", "BAR", "FLAG")})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        ptx = k.asm["ptx"]
        assert k.asm.get("cubin") and "cp.async.bulk.tensor" in ptx
        print(f"ok gluon_stream sync={sync} stages={stages}: shared {k.metadata.shared} B, "
              f"tma {ptx.count('cp.async.bulk.tensor')}, mbarrier {ptx.count('mbarrier.')}", flush=True)
    check_reference()


if __name__ == "__main__":
    main()
