"""Item-embedding tables: a catalogue's items as soft tokens, looked up by id (DESIGN.md §9).

A scoring request may name an item by id ({"id": "sku-17"}) instead of sending its text or its
vector; the id is looked up here. Two file forms, one meaning (id -> one vector of the model's
hidden size, in the embedding space the model's own tokens live in):

    safetensors  tensor "embeddings" [N, hidden] (float16, bfloat16 or float32); metadata "ids":
                 a JSON list of N ids (absent: the row numbers "0" .. "N-1"), and any other
                 metadata the writer recorded ("base_model": the base weights it was made for,
                 weights.loading.base_hash, which a table must record; ...)
    Parquet      columns "id" (string or integer) and "embedding" (a list of floats per row);
                 the file's key-value metadata as the safetensors metadata

Ids are strings; an integer id is its decimal text. The safetensors form is memory-mapped, so the
front ends of a server share its pages; Parquet is read into memory.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from .errors import ConfigError, InputError

TENSOR = "embeddings"
FORMATS = (".safetensors", ".parquet")


def table_format(path: str) -> str:
    ext = os.path.splitext(str(path))[1].lower()
    if ext not in FORMATS:
        raise ConfigError(f"{path}: an item table is a .safetensors or a .parquet file")
    return ext[1:]


@dataclass
class ItemTable:
    """ids -> rows of `vectors` [N, hidden]."""
    ids: list[str]
    vectors: torch.Tensor
    meta: dict = field(default_factory=dict)
    path: str | None = None

    def __post_init__(self):
        if self.vectors.ndim != 2 or self.vectors.shape[0] != len(self.ids):
            raise ConfigError(f"{self.path or 'item table'}: {len(self.ids)} ids for embeddings of "
                              f"shape {tuple(self.vectors.shape)}")
        self.index = {k: i for i, k in enumerate(self.ids)}
        if len(self.index) != len(self.ids):
            dup = next(k for k in self.ids if self.ids.count(k) > 1)
            raise ConfigError(f"{self.path or 'item table'}: id {dup!r} appears more than once")

    @property
    def dim(self) -> int:
        return self.vectors.shape[1]

    def __len__(self) -> int:
        return len(self.ids)

    def __contains__(self, key) -> bool:
        return _key(key) in self.index

    def get(self, key, what: str = "item") -> torch.Tensor:
        """The vector of id `key`; InputError naming `what` if the table has no such id."""
        i = self.index.get(_key(key))
        if i is None:
            raise InputError(f"{what}: id {key!r} is not in the item table"
                             f"{f' {os.path.basename(self.path)}' if self.path else ''} "
                             f"({len(self.ids)} items)")
        return self.vectors[i]

    def check_model(self, loaded) -> "ItemTable":
        """This table, if made for a model of the loaded model's hidden size and its base weights
        (the base_model it records: weights.loading.base_hash; checked before an adapter is
        merged, as an adapter's base is): a ConfigError otherwise, a table that records none too."""
        from .weights.loading import base_hash

        hidden = loaded.model.config.hidden_size
        if self.dim != hidden:
            raise ConfigError(f"{self.path or 'item table'}: its vectors have {self.dim} values, "
                              f"the model's hidden size is {hidden}")
        made_for = self.meta.get("base_model")
        if not made_for:  # vectors for another model's embedding space would score as noise
            raise ConfigError(f"{self.path or 'item table'} does not record the base model it was "
                              f"made for: add the metadata key base_model = {base_hash(loaded)} if "
                              f"it was made for this one (prefixscore items records it)")
        if getattr(loaded.model, "merged_adapter", None) is None:
            if made_for != (this := base_hash(loaded)):
                raise ConfigError(f"{self.path or 'item table'} was made for base model {made_for}, "
                                  f"not this one ({this})")
        return self

    @classmethod
    def load(cls, path) -> "ItemTable":
        path = str(path)
        kind = table_format(path)
        if not os.path.isfile(path):
            raise ConfigError(f"{path}: no such item table")
        path = os.path.abspath(path)  # (a server's front ends map it again, from the same name)
        return (_load_safetensors if kind == "safetensors" else _load_parquet)(path)

    def save(self, path) -> None:
        write_table(path, self.ids, self.vectors, self.meta)


def _key(key) -> str:
    if isinstance(key, bool) or not isinstance(key, (str, int)):
        raise InputError(f"an item id is a string or an integer, got {type(key).__name__}")
    return str(key)


def _load_safetensors(path: str) -> ItemTable:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            meta = dict(f.metadata() or {})
            if TENSOR not in f.keys():
                raise ConfigError(f"{path}: no tensor {TENSOR!r} (an item table holds one, "
                                  f"[items, hidden])")
            vectors = f.get_tensor(TENSOR)
    except SafetensorError as e:
        raise ConfigError(f"{path}: not a readable safetensors file ({e})") from None
    ids = meta.pop("ids", None)
    try:
        ids = [str(i) for i in json.loads(ids)] if ids is not None else \
            [str(i) for i in range(vectors.shape[0])]
    except (json.JSONDecodeError, TypeError):
        raise ConfigError(f"{path}: metadata 'ids' is not a JSON list") from None
    if not vectors.dtype.is_floating_point:
        raise ConfigError(f"{path}: embeddings of dtype {vectors.dtype}; use float16, bfloat16 or float32")
    return ItemTable(ids, vectors, meta, path)


def _load_parquet(path: str) -> ItemTable:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("a Parquet item table needs pyarrow: pip install 'prefixscore[parquet]'") from None
    try:
        t = pq.read_table(path, columns=["id", "embedding"])
        kv = pq.read_schema(path).metadata or {}
    except Exception as e:  # pyarrow's own errors: a missing column, a damaged file
        raise ConfigError(f"{path}: not an item table ({type(e).__name__}: {e}); it needs columns "
                          f"'id' and 'embedding'") from None
    ids = [str(i) for i in t.column("id").to_pylist()]
    col = t.column("embedding").combine_chunks()
    if not len(ids):
        raise ConfigError(f"{path}: an empty item table")
    flat = np.array(col.flatten(), dtype=np.float32)  # (a copy: writable)
    if flat.size % len(ids) or col.null_count:
        raise ConfigError(f"{path}: the rows of 'embedding' are not all the same length")
    vectors = torch.from_numpy(flat.reshape(len(ids), -1))
    meta = {k.decode(): v.decode() for k, v in kv.items() if not k.startswith(b"ARROW")
            and k != b"pandas"}
    return ItemTable(ids, vectors, meta, path)


def write_table(path, ids, vectors, meta: dict | None = None) -> None:
    """Write a whole table (the formats above): ids, vectors [N, hidden] (tensor or array), string
    metadata. Written to a temporary name and moved into place, so a reader never sees half."""
    path = str(path)
    kind = table_format(path)
    ids = [_key(i) for i in ids]
    vectors = torch.as_tensor(vectors)
    meta = {str(k): str(v) for k, v in (meta or {}).items()}
    tmp = path + ".tmp"
    if kind == "safetensors":
        from safetensors.torch import save_file

        save_file({TENSOR: vectors.contiguous()}, tmp, metadata={**meta, "ids": json.dumps(ids)})
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        emb = pa.FixedSizeListArray.from_arrays(pa.array(vectors.float().numpy().ravel()), vectors.shape[1])
        t = pa.table({"id": pa.array(ids, pa.string()), "embedding": emb})
        pq.write_table(t.replace_schema_metadata(meta), tmp)
    os.replace(tmp, path)
