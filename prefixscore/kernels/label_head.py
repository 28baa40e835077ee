"""Label head: gather read-out rows -> final RMSNorm -> projection onto the label tokens' rows of the
output embedding (N rows, never the vocabulary) -> restricted scores -> argmax.

hidden [T, H]; rows int [R] (flat positions to read out); norm_weight [H]; weight [N, H] (label-token
rows of the output head, ordered by vocabulary id so argmax ties resolve like HF's vocab argmax);
allowed bool [R, N] (which label tokens each row may choose among).
Returns (scores [R, N] fp32 with -inf outside `allowed`, best [R] int64 column index).
logprobs=True: log-softmax restricted to the allowed tokens; False: raw logits.
"""
from __future__ import annotations

import torch

from .options import KernelOptions, use_triton


def rms_norm(x, weight, eps):
    """HF Llama RMSNorm: normalise in fp32, cast back, then scale (weight None: unit weight)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(x.dtype) if weight is None else weight * xf.to(x.dtype)


def label_head_ref(hidden, rows, norm_weight, eps, weight, allowed, logprobs=True):
    h = rms_norm(hidden[rows], norm_weight, eps)
    logits = (h @ weight.t()).float()
    logits = logits.masked_fill(~allowed, float("-inf"))
    best = logits.argmax(-1)
    if logprobs:
        logits = torch.log_softmax(logits, dim=-1)
    return logits, best


def label_head(hidden, rows, norm_weight, eps, weight, allowed, logprobs=True, out=None, *,
               options: KernelOptions):
    """out: optional (scores, best) tensors to write the result into (a graph's output buffer);
    options: the engine's KernelOptions (kernels/options.py)."""
    if use_triton(hidden, options):
        from .label_head_triton import label_head_triton

        o = dict(out_scores=out[0], out_best=out[1]) if out is not None else {}
        return label_head_triton(hidden, rows, norm_weight, eps, weight, allowed, logprobs, **o,
                                 options=options)
    scores, best = label_head_ref(hidden, rows, norm_weight, eps, weight, allowed, logprobs)
    if out is None:
        return scores, best
    out[0].copy_(scores)
    out[1].copy_(best)
    return out
