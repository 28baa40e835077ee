"""How close any FP8 kernel can get to HF fp32's decisions (issue 23 item 3): HF fp32 on the
linear weights quantized per output channel to e4m3 and back (no kernel of ours), against HF fp32
on the unquantized weights, on bench.fp8_gpu's 500 requests and clear-margin rule -- the agreement
that quantization alone leaves, beside which bench.fp8_gpu's fp8 rows are read.

(Fifteenth session: a first version also timed each 7B layer's skinny GEMM in isolation from
Python; every one took ~85-135 us whatever its size, host-bound, so those rows were dropped --
bench.fp8_tune_gpu times launch configs in place, in graphs.)

    device run:  python -m bench.fp8_quant_gpu      (writes $OUT/fp8_quant_gpu.json)
"""
from __future__ import annotations

import copy
import json

import torch

from bench.gpu import OUT
from prefixscore.kernels import fp8 as F8


def quant(shape: str, n: int = 500) -> dict:
    """HF fp32 with e4m3-per-channel round-tripped linear weights vs HF fp32 (bench.fp8_gpu's
    requests and clear-margin rule)."""
    from bench.gpu import PREFIX, hf_model, hf_reference, random_suffixes

    hf = hf_model(shape)
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(100, 30000, (PREFIX,), generator=g).tolist()  # as bench.gpu.Synthetic
    sfx = random_suffixes(n, seed=123)
    hf32 = copy.deepcopy(hf).float()
    del hf
    ref = hf_reference(hf32, prefix, sfx)
    with torch.no_grad():
        for name, p in hf32.named_parameters():
            if p.dim() == 2 and "embed" not in name and "lm_head" not in name:
                p.copy_(F8.Fp8Weight.quantize(p).dequantize())
    got = hf_reference(hf32, prefix, sfx)
    del hf32
    torch.cuda.empty_cache()
    top2 = ref.topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.5
    want, dec = ref.argmax(-1), got.argmax(-1)
    return {"n": n, "agree_with_hf_fp32": int((dec == want).sum()),
            "max_abs_diff_vs_hf_fp32": float((got - ref).abs().max()),
            "flips_on_clear_margin": int(((dec != want) & clear).sum())}


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for shape in ("0.5B", "7B"):
        res[shape] = quant(shape)
        print("quant", shape, json.dumps(res[shape]), flush=True)
        (OUT / "fp8_quant_gpu.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
