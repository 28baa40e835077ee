"""Helpers the tests share (plain functions and data; the fixtures are in conftest.py): tiny random
models, random and real queries, and test-only patches. Test modules import them as
`from tests.helpers import ...` (tests/ is a package, so its subfolders mirror prefixscore/)."""
import csv
import os
import random
import string
from pathlib import Path

import torch

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
# The dev set (12 KB) ships in tests/data, so a clone runs its tests wherever it lies.
DEV_CSV = Path(__file__).resolve().parent / "data" / "intent_dev.csv"


def dev_queries():
    with open(DEV_CSV, newline="", encoding="utf-8") as f:
        return [row["query"] for row in csv.DictReader(f)]


def tiny_hf_config(arch: str, **kw):
    from transformers import AutoConfig

    base = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                pad_token_id=0)
    if arch == "qwen3":
        base["head_dim"] = 32  # Qwen3 sets head_dim explicitly (≠ hidden / heads)
    if arch == "llama":
        base["tie_word_embeddings"] = True
    base.update(kw)
    return AutoConfig.for_model(arch, **base)


def make_tiny_model(path, arch, tokenizer, seed=0, **kw):
    """A random tiny model of `arch` saved as a HF folder (safetensors) with the SmolLM2 tokenizer."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_hf_config(arch, **kw)
    cfg.eos_token_id = tokenizer.eos_token_id
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init so logits are well separated
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


class Lowering:
    """A tokenizer that edits text in Python before its Rust backend sees it (lower-cases it): its
    backend disagrees with its own call, so prompt.py must keep the call."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, text, **kw):
        return self.inner([t.lower() for t in text] if isinstance(text, list) else text.lower(), **kw)


def random_queries(n, seed):
    rng = random.Random(seed)
    words = ["dress", "jeans", "shirt", "trench", "coat", "skirt", "tee", "hoodie", "knit", "women",
             "men", "blue", "red", "oversized", "vintage", "连衣裙", "牛仔裤", "卫衣", "毛衣", "风衣",
             "2024新款", "size", "xl", "cotton", "😀", "black", "summer", "¿", "camisa", "ジーンズ"]
    out = []
    for _ in range(n):
        k = rng.randint(1, 6)
        q = " ".join(rng.choice(words) for _ in range(k))
        if rng.random() < 0.2:
            q = "".join(rng.choice(string.printable[:94]) for _ in range(rng.randint(1, 30)))
        if rng.random() < 0.1:
            q = "  " + q
        out.append(q)
    return out


def fix_interpreter():
    """Two defects of Triton 3.6's CPU interpreter, patched for the tests (nothing when it is off):
    - triton#9171: with numpy >= 2.4 the interpreter's scalars are (1,)-shaped arrays whose int()
      raises, so every runtime loop bound (`range(0, P, BLOCK)`) fails. Fixed upstream after 3.6.
    - An fp32 -> bf16 cast (`x.to(tl.bfloat16)`) truncates the mantissa (cast_impl passes no
      rounding mode), where the GPU rounds to nearest even: a kernel that rounds several times
      (SiLU * up from rounded gate and up) drifts 2-3 bf16 steps towards zero. Rounded by torch here.
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    _fix_bf16_casts()
    import numpy as np
    from triton.runtime import interpreter

    orig = getattr(interpreter, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_index_fixed", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patched._index_fixed = True
    interpreter._patch_lang_tensor = patched


def _fix_bf16_casts():
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    orig = builder.cast_impl
    if getattr(orig, "_rounds", False):
        return

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            f = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            bits = f.to(torch.bfloat16).view(torch.int16).numpy()
            return interpreter.TensorHandle(bits.view(interpreter._get_np_dtype(dst_type)), dst_type.scalar)
        return orig(self, src, dst_type)

    cast_impl._rounds = True
    builder.cast_impl = cast_impl


def eager_graphs(monkeypatch):
    """CUDA graphs on the CPU, for GraphRunner's bookkeeping (buffers, buckets, padding): capture
    records each bucket's body and a replay calls it eagerly. -> wire(runner), which points the
    runner's graphs at its bodies (call it after making the runner); wire.captured lists the
    buckets captured, in order. On a host with a GPU (KernelOptions' copies in the graph on) every
    bucket copies around its replay, as with graph_copies off."""
    import contextlib

    from prefixscore import graphs
    from prefixscore.graphs import GraphRunner

    if os.environ.get("TRITON_INTERPRET") != "1":  # (a GPU host: the in-graph copy kernel would
        monkeypatch.setattr(graphs, "GRAPH_COPY_MAX_BYTES", -1)  # get CPU tensors: copy around)

    class EagerGraph:
        body = None

        def replay(self):
            self.body()

        def pool(self):
            return None

    def stub(**attrs):
        return type("Stub", (), {k: (lambda self, *a, v=v: v) for k, v in attrs.items()})()

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", EagerGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g, pool=None, stream=None: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a: stub(wait_stream=None))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: stub(synchronize=None))
    monkeypatch.setattr(torch.cuda, "Event", lambda *a: stub(record=None, synchronize=None))
    body = GraphRunner._body
    captured = []

    def recording(self, T, slot):
        captured.append(T)
        body(self, T, slot)

    monkeypatch.setattr(GraphRunner, "_body", recording)

    def wire(runner):
        for T, graphs in runner.slot_graphs.items():
            for slot, g in enumerate(graphs):
                g.body = (lambda T=T, slot=slot: body(runner, T, slot))
        return runner

    wire.captured = captured
    return wire
