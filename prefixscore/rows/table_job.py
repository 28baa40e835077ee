"""Writing an item-embedding table a chunk at a time, resumably (`prefixscore embed-items`).

Chunk k of the catalogue (rows k*chunk_rows ...) is embedded and written as its own small table,
OUT.partial/chunk-NNNNNN.safetensors (item_table.write_table: written whole or not at all), beside
OUT.partial/run.json, the options the run was started with. When every chunk is there the table is
put together and written to OUT (moved into place whole), and OUT.partial is removed. After an
interruption `--resume` checks run.json against this run's options, keeps the chunks whose ids are
still the catalogue's rows there, and embeds the rest: each chunk is computed from the same rows in
the same passes as before, so a resumed table is the uninterrupted one, bit for bit.
"""
from __future__ import annotations

import json
import os
import shutil

import torch

from ..errors import InputError
from ..item_table import ItemTable, table_format, write_table

RUN_FORMAT = "prefixscore.embed_items.partial"
CHUNK_ROWS = 1024


def partial_dir(output: str) -> str:
    return output + ".partial"


def _chunk_path(output: str, k: int) -> str:
    return os.path.join(partial_dir(output), f"chunk-{k:06d}.safetensors")


class TableJob:
    """ids, texts: the catalogue's rows; options: what a resume must match (JSON values)."""

    def __init__(self, output: str, ids: list[str], texts: list[str], options: dict,
                 chunk_rows: int = CHUNK_ROWS, resume: bool = False, overwrite: bool = False):
        table_format(output)  # a .safetensors or .parquet name, else a ConfigError
        if chunk_rows < 1:
            raise InputError(f"--chunk-rows must be positive, got {chunk_rows}")
        self.output, self.ids, self.texts = output, ids, texts
        self.options = options | {"chunk_rows": chunk_rows, "rows": len(ids)}
        self.chunk_rows = chunk_rows
        self.chunks = (len(ids) + chunk_rows - 1) // chunk_rows
        part = partial_dir(output)
        if overwrite:
            shutil.rmtree(part, ignore_errors=True)
        elif os.path.exists(output) and not os.path.isdir(part):
            raise InputError(f"{output} exists: give another output name, or --overwrite to replace it"
                             + (" (--resume: it is complete, there is nothing to continue)" if resume else ""))
        elif os.path.isdir(part) and not resume:
            raise InputError(f"{part} holds an interrupted run: --resume continues it, --overwrite "
                             f"starts over")
        elif resume and not os.path.isdir(part):
            raise InputError(f"--resume: no interrupted run to continue ({part} does not exist)")
        self.done = self._kept() if resume else 0
        self.resumed = resume

    # ---- the partial run's record

    def _start(self) -> None:
        part = partial_dir(self.output)
        try:
            os.makedirs(part, exist_ok=True)
            with open(os.path.join(part, "run.json.tmp"), "w", encoding="utf-8") as f:
                json.dump({"format": RUN_FORMAT, "options": self.options}, f, indent=1)
            os.replace(os.path.join(part, "run.json.tmp"), os.path.join(part, "run.json"))
        except OSError as e:
            raise InputError(f"cannot write {part}: {e.strerror or e}") from None

    def _kept(self) -> int:
        """Check the interrupted run's record against this one -> the chunks kept (a prefix)."""
        path = os.path.join(partial_dir(self.output), "run.json")
        try:
            with open(path, encoding="utf-8") as f:
                rec = json.load(f)
            if rec.get("format") != RUN_FORMAT or not isinstance(rec.get("options"), dict):
                raise ValueError
        except (OSError, ValueError):
            raise InputError(f"--resume: {path} is not readable as the record of an embed-items run; "
                             f"--overwrite starts over") from None
        old = rec["options"]
        for k, v in self.options.items():
            if old.get(k) != v:
                raise InputError(f"--resume: {self.output} was started with {k} {old.get(k)!r}, not "
                                 f"{v!r}: run it as it was started, or --overwrite to start over")
        k = 0
        while k < self.chunks and os.path.isfile(_chunk_path(self.output, k)):
            lo = k * self.chunk_rows
            try:
                got = ItemTable.load(_chunk_path(self.output, k)).ids
            except Exception:  # a damaged chunk: computed again, with all after it
                break
            if got != self.ids[lo:lo + self.chunk_rows]:
                raise InputError(f"--resume: the catalogue's rows {lo + 1}-{lo + len(got)} are not the "
                                 f"items embedded before (the file changed): --overwrite starts over")
            k += 1
        for j in range(k, self.chunks):  # anything past the first gap is computed again
            if os.path.exists(_chunk_path(self.output, j)):
                os.remove(_chunk_path(self.output, j))
        return k

    # ---- the work

    @property
    def rows_done(self) -> int:
        return min(len(self.ids), self.done * self.chunk_rows)

    def run(self, embed, meta: dict, save_dtype=torch.float32, progress=None) -> ItemTable:
        """embed(texts, progress) -> [n, hidden] vectors; progress(n) after each n rows embedded.
        -> the whole table, written to the output."""
        if not self.resumed:
            self._start()  # (not before: a run refused after the checks leaves nothing behind)
        for k in range(self.done, self.chunks):
            lo, hi = k * self.chunk_rows, min(len(self.ids), (k + 1) * self.chunk_rows)
            vecs = embed(self.texts[lo:hi], progress)
            write_table(_chunk_path(self.output, k), self.ids[lo:hi], vecs.to(save_dtype))
            self.done = k + 1
        parts = [ItemTable.load(_chunk_path(self.output, k)).vectors for k in range(self.chunks)]
        table = ItemTable(list(self.ids), torch.cat(parts), meta, self.output)
        try:
            write_table(self.output, table.ids, table.vectors, meta)
        except OSError as e:
            raise InputError(f"cannot write {self.output}: {e.strerror or e}") from None
        shutil.rmtree(partial_dir(self.output), ignore_errors=True)
        return table
