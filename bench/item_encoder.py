"""Item encoders (issue 34 item 3): how well one soft token per item ranks candidates as the item's
text does, on the bundled SmolLM2-135M-Instruct on CPU, with the Scorer's default template.

    python -m bench.item_encoder                         (the full run: about 20 minutes on 2 cores)
    python -m bench.item_encoder --queries 24 --eval-queries 8 --epochs 1 --tag smoke   (minutes)

Ranking set (train/ranking.py): the catalogue tests/data/catalogue.csv (496 items, 20% held out of
training), training queries drawn from tests/data/intent_train.csv, held-out queries from
tests/data/intent_dev.csv (another file: no query is both trained on and measured), 20 candidates
a query (trigram neighbours, items of the query's label, random items). Teacher: the Scorer's
text score, the margin logprob(yes) - logprob(no). Reported on the held-out queries, for candidates
from the whole catalogue and from the held-out items alone, each scored through the Scorer with
the item as an embedding:
  trained       the fitted map (fit-item-encoder's defaults unless flags say otherwise)
  untrained     the map at its start: the item's mean token embedding, rescaled to a token's norm
  random_order  the NDCG@10 a random order gets (the floor)
NDCG@10 takes its gains from the teacher's margins, graded 0 (the query's worst candidate) to 1
(its best); Spearman is over each query's candidates; both are means over queries. Writes
$OUT/item_encoder_cpu[_TAG].json (bench/results without OUT).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import torch

from prefixscore.cli.items import format_agreement
from prefixscore.train import ranking
from prefixscore.train.item_fit import FitOptions, fit_item_encoder

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"


def sample(path: Path, n: int, seed: int) -> tuple[list[str], list[str]]:
    q, labels = ranking.read_queries(path, "query", "label")
    order = list(range(len(q)))
    random.Random(seed).shuffle(order)
    return [q[i] for i in order[:n]], [labels[i] for i in order[:n]]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--queries", type=int, default=160, help="training queries (from intent_train)")
    p.add_argument("--eval-queries", type=int, default=60, help="held-out queries (from intent_dev)")
    p.add_argument("--candidates", type=int, default=20)
    p.add_argument("--heldout-items", type=float, default=0.2)
    p.add_argument("--tag", default="", help="suffix of the JSON file's name")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    d = FitOptions()
    for f in dataclasses.fields(FitOptions):  # the fit's options, fit-item-encoder's defaults
        p.add_argument("--" + f.name.replace("_", "-"), type=type(getattr(d, f.name)), default=getattr(d, f.name))
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    opts = FitOptions(**{f.name: getattr(a, f.name) for f in dataclasses.fields(FitOptions)})
    cat = ranking.read_catalogue(DATA / "catalogue.csv", label_column="label")
    tq, tl = sample(DATA / "intent_train.csv", a.queries, 1)
    eq, el = sample(DATA / "intent_dev.csv", a.eval_queries, 2)
    t0 = time.perf_counter()
    enc, info = fit_item_encoder(cat, tq, eval_queries=eq, query_labels=tl, eval_labels=el,
                                 candidates=a.candidates, heldout_items=a.heldout_items, opts=opts,
                                 log=lambda m: print(m, file=sys.stderr, flush=True))
    rep = {"bench_s": round(time.perf_counter() - t0, 1), "catalogue": "tests/data/catalogue.csv",
           "train_queries_from": "tests/data/intent_train.csv", "eval_queries_from": "tests/data/intent_dev.csv",
           "template": enc.meta["template"], "labels": enc.meta["labels"], **info,
           "env": {"command": "python -m bench.item_encoder " + " ".join(sys.argv[1:] if argv is None else argv),
                   "model": enc.meta["base_name"], "torch": torch.__version__,
                   "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                   "cpu": platform.processor() or platform.machine(), "python": platform.python_version()}}
    print(format_agreement(info))
    s = info["seconds"]
    print(f"\n{rep['bench_s']:.0f} s: teacher {s['teacher']:.0f} s, features {s['features']:.0f} s, "
          f"fit {s['fit']:.0f} s, evaluation {s['evaluate']:.0f} s ({torch.get_num_threads()} threads)")
    out = Path(os.environ.get("OUT") or Path(__file__).resolve().parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"item_encoder_cpu{'_' + a.tag if a.tag else ''}.json"
    with open(path, "w") as f:
        json.dump(rep, f, indent=1, ensure_ascii=False)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
