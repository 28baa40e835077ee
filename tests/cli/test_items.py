"""`prefixscore embed-items` and `fit-item-encoder` (issue 34) on a tiny random Llama: the table it
writes (Parquet or safetensors) is the encoder's vectors under the catalogue's ids, which the Scorer
reads; a run interrupted and resumed writes the uninterrupted run's table; each user mistake is one
error line; and the fit command runs end to end."""
import csv
import json
from pathlib import Path

import pytest
import torch

from prefixscore import Scorer
from prefixscore.cli import commands as cli
from prefixscore.item_table import ItemTable
from prefixscore.train.item_encoder import ItemEncoder, ItemMap
from prefixscore.weights.loading import base_hash, load

DATA = Path(__file__).resolve().parents[1] / "data"
TEMPLATE = "Query: {query}\nItem: {item}\nRelevant:"

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: torch on one thread


@pytest.fixture(scope="module")
def llama(tiny_model):
    return str(tiny_model("llama"))


@pytest.fixture(scope="module")
def files(llama, tmp_path_factory):
    """(a 13-item catalogue CSV, an encoder file for the tiny llama, the encoder)."""
    d = tmp_path_factory.mktemp("items")
    with open(DATA / "catalogue.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))[:13]
    cat = d / "cat.csv"
    with open(cat, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["id", "label", "text"])
        w.writerows([r["id"], r["label"], r["text"]] for r in rows)
    loaded = load(llama, "cpu", torch.float32)
    m = ItemMap(64, scale=2.0, mu=torch.zeros(128), sd=torch.ones(128))
    torch.nn.init.normal_(m.linear.weight, std=0.02, generator=torch.Generator().manual_seed(0))
    enc = ItemEncoder(m.eval(), "mean", meta={"base_model": base_hash(loaded), "base_name": llama,
                                               "template": TEMPLATE, "chat": False, "labels": ["yes", "no"]})
    enc.save(d / "enc.safetensors")
    return cat, d / "enc.safetensors", enc, loaded, [r["text"] for r in rows], [r["id"] for r in rows]


def embed(capsys, llama, files, out, *extra):
    cat, enc, *_ = files
    capsys.readouterr()
    rc = cli.main(["embed-items", str(cat), "--encoder", str(enc), "-o", str(out), "--model", llama,
                   "--chunk-rows", "4", *map(str, extra)])
    return rc, capsys.readouterr()


def fails(capsys, args) -> str:
    """main() exits 2 with one 'prefixscore: error:' line and no traceback -> that line."""
    capsys.readouterr()
    assert cli.main(list(map(str, args))) == 2
    err = capsys.readouterr().err
    assert err.count("prefixscore: error:") == 1 and "Traceback" not in err, err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("ext", ["parquet", "safetensors"])
def test_embed_items_writes_the_encoders_vectors(llama, files, tmp_path, capsys, ext):
    _, _, enc, loaded, texts, ids = files
    out = tmp_path / f"items.{ext}"
    rc, _ = embed(capsys, llama, files, out)
    assert rc == 0
    table = ItemTable.load(out)
    assert table.ids == ids and not (tmp_path / f"items.{ext}.partial").exists()
    assert torch.allclose(table.vectors.float(), enc.embed(loaded, texts), atol=1e-6)
    assert table.meta["base_model"] == base_hash(loaded) and table.meta["pooling"] == "mean"
    sc = Scorer(llama, TEMPLATE, ["yes", "no"], chat=False, item_table=out)
    by_id = sc.score("red dress", [{"id": ids[2]}, {"id": ids[5]}])
    by_vec = sc.score("red dress", [table.vectors[2], table.vectors[5]])
    assert [r.scores for r in by_id] == [r.scores for r in by_vec]


def test_resume_after_an_interruption_writes_the_same_table(llama, files, tmp_path, capsys, monkeypatch):
    whole = tmp_path / "whole.safetensors"
    assert embed(capsys, llama, files, whole)[0] == 0
    out = tmp_path / "items.safetensors"
    real, calls = ItemEncoder.embed, []

    def interrupted(self, loaded, texts, progress=None):
        calls.append(len(texts))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, loaded, texts, progress)

    monkeypatch.setattr(ItemEncoder, "embed", interrupted)
    rc, (_, err) = embed(capsys, llama, files, out)
    assert rc == 130 and "--resume" in err and not out.exists()
    assert sorted(p.name for p in Path(f"{out}.partial").iterdir()) == [
        "chunk-000000.safetensors", "chunk-000001.safetensors", "run.json"]
    monkeypatch.setattr(ItemEncoder, "embed", real)
    line = fails(capsys, ["embed-items", files[0], "--encoder", files[1], "-o", out, "--model", llama,
                          "--chunk-rows", 4])
    assert "interrupted run: --resume continues it" in line
    line = fails(capsys, ["embed-items", files[0], "--encoder", files[1], "-o", out, "--model", llama,
                          "--chunk-rows", 5, "--resume"])
    assert "was started with chunk_rows 4, not 5" in line
    rc, (_, err) = embed(capsys, llama, files, out, "--resume")
    assert rc == 0 and "8 of 13 items kept" in err
    a, b = ItemTable.load(out), ItemTable.load(whole)
    assert a.ids == b.ids and torch.equal(a.vectors, b.vectors) and a.meta == b.meta
    assert not Path(f"{out}.partial").exists()


def test_user_mistakes_are_one_line(llama, files, tiny_model, tmp_path, capsys):
    cat, enc, *_ = files
    base = ["embed-items", cat, "--encoder", enc, "--model", llama]
    out = tmp_path / "t.parquet"
    assert embed(capsys, llama, files, out)[0] == 0
    assert "exists: give another output name, or --overwrite" in fails(capsys, base + ["-o", out])
    assert "no column 'title'" in fails(capsys, base + ["-o", tmp_path / "u.parquet", "--text-column", "title"])
    assert "a .safetensors or a .parquet file" in fails(capsys, base + ["-o", tmp_path / "t.csv"])
    other = tiny_model("qwen2")
    line = fails(capsys, ["embed-items", cat, "--encoder", enc, "--model", other, "-o", tmp_path / "v.parquet"])
    assert "fitted for base model" in line and "--model" in line
    assert not (tmp_path / "v.parquet.partial").exists()  # a refused run leaves nothing behind
    assert "not a readable safetensors file" in fails(  # a table given as the encoder
        capsys, ["embed-items", cat, "--encoder", out, "--model", llama, "-o", tmp_path / "w.parquet"])
    assert "no interrupted run" in fails(capsys, base + ["-o", tmp_path / "x.parquet", "--resume"])
    assert "no such item encoder" in fails(
        capsys, ["embed-items", cat, "--encoder", tmp_path / "none.safetensors", "-o", tmp_path / "y.parquet"])
    assert ".safetensors file" in fails(capsys, ["fit-item-encoder", cat, "--queries", DATA / "intent_dev.csv",
                                                  "-o", tmp_path / "enc.bin", "--model", llama])


def test_fit_item_encoder_command(llama, files, tmp_path, capsys):
    cat = files[0]
    out, report = tmp_path / "enc.safetensors", tmp_path / "fit.json"
    capsys.readouterr()
    rc = cli.main(["fit-item-encoder", str(cat), "--queries", str(DATA / "intent_dev.csv"), "-o", str(out),
                   "--json", str(report), "--model", llama, "--template", TEMPLATE, "--no-chat",
                   "--max-queries", "12", "--candidates", "6", "--heldout-items", "0", "--epochs", "1", "-q"])
    stdout = capsys.readouterr().out
    assert rc == 0 and "heldout_queries" in stdout and "saved" in stdout
    enc = ItemEncoder.load(out)
    assert enc.meta["template"] == TEMPLATE and enc.meta["labels"] == ["yes", "no"]
    info = json.loads(report.read_text())
    assert set(info["agreement"]["heldout_queries"]) == {"trained", "untrained", "random_order"}
    assert info["eval_queries"] == 2 and info["candidates"] == 6
