"""W3 and W6 through `/v1/score` with several clients against the in-process Scorer (issue 34:
the server >= 90% of in-process items/s with 8 clients).

    python -m bench.ranking_http --server-cpus 0-9 --load-cpus 10-15 -- --model /tmp/q05 --device cuda
    python -m bench.ranking_http --requests 4 --items 10 --seconds 5 --clients 2   (a CPU smoke run)

  in-process  Scorer.score_batch over --requests requests (bench.ranking's: a ~50-token query and
              --items items of ~150 tokens of real query text; W6: the same queries, each item one
              embedding), mode softmax, in this process pinned to --server-cpus, repeated
              --repeats times (median items/s)
  /v1/score   `prefixscore serve --score-template` (the same template, --score-labels yes,no) pinned
              to --server-cpus; --clients threads pinned to --load-cpus, each a keep-alive
              connection sending the same requests round-robin (closed loop, apply_softmax true;
              W6 items as base64 float16 embeddings) for --seconds after a warm-up: items/s, and
              p50 / p99 per request
Checks: the server's scores of request 0 against the in-process ones (max |diff|). Flags after `--`
go to both the Scorer (--model, --device, --dtype) and `prefixscore serve`. Writes
$OUT/ranking_http.json (bench/results without OUT).
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import threading
import time

from bench.http import OUT, free_port, parse_cpus, start_server, stop_server
from bench.overlap import W3_TEMPLATE, model_flags, queries, texts_of


def closed_loop(port, bodies, clients, seconds, cpus):
    """-> (items/s, per-request ms) of `clients` threads sending bodies round-robin."""
    import httpx

    if cpus:
        os.sched_setaffinity(0, cpus)
    stop, ms, items, errors = time.monotonic() + seconds, [], [0], []
    lock = threading.Lock()

    def client(k):
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as c:
            i = k
            while time.monotonic() < stop:
                body = bodies[i % len(bodies)]
                t = time.perf_counter()
                r = c.post("/v1/score", content=body[0], headers={"content-type": "application/json"})
                dt = 1e3 * (time.perf_counter() - t)
                with lock:
                    if r.status_code != 200:
                        errors.append(r.text[:200])
                    else:
                        ms.append(dt)
                        items[0] += body[1]
                i += clients

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise SystemExit(f"{len(errors)} failed requests, first: {errors[0]}")
    return items[0] / (time.monotonic() - t0), ms


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--items", type=int, default=100)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--server-cpus", default=None)
    ap.add_argument("--load-cpus", default=None)
    ap.add_argument("model_flags", nargs=argparse.REMAINDER, help="-- --model PATH --device cuda ...")
    a = ap.parse_args(argv)
    m, flags = model_flags(a.model_flags, known=True)
    server_cpus, load_cpus = parse_cpus(a.server_cpus), parse_cpus(a.load_cpus)

    import numpy as np
    import torch

    from prefixscore import Scorer

    if server_cpus:
        os.sched_setaffinity(0, server_cpus)
    sc = Scorer(m.model, W3_TEMPLATE, ["yes", "no"], mode="softmax", device=m.device, dtype=m.dtype)
    qs, tok, device = queries(), sc.tokenizer, sc.engine.device
    w3 = [(texts_of(tok, qs, 50, 1, 97 * k)[0], texts_of(tok, qs, 150, a.items, 13 * k))
          for k in range(a.requests)]
    scale = sc.loaded.model.embed_tokens.weight.float().std().item()
    g = torch.Generator().manual_seed(0)
    vecs = (torch.randn(a.requests, a.items, sc.config.hidden_size, generator=g) * scale).half()
    w6 = [(q, list(vecs[k].float())) for k, (q, _) in enumerate(w3)]
    out = {"device": str(device), "model": sc.loaded.name, "requests": a.requests, "items": a.items,
           "clients": a.clients, "seconds": a.seconds}

    def rate(reqs):
        sc.score_batch(reqs)  # warm-up
        rates = []
        for _ in range(a.repeats):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            sc.score_batch(reqs)
            if device.type == "cuda":
                torch.cuda.synchronize()
            rates.append(len(reqs) * a.items / (time.perf_counter() - t))
        return statistics.median(rates)

    want = {"w3": [[r.scores[l] for l in sc.labels] for r in sc.score(*w3[0])],
            "w6": [[r.scores[l] for l in sc.labels] for r in sc.score(*w6[0])]}
    out["inprocess"] = {"w3": rate(w3), "w6": rate(w6)}
    del sc
    if device.type == "cuda":
        torch.cuda.empty_cache()
    bodies = {
        "w3": [(json.dumps({"query": q, "items": items, "apply_softmax": True}).encode(), a.items)
               for q, items in w3],
        "w6": [(json.dumps({"query": q, "apply_softmax": True, "items": [
            {"embedding": base64.b64encode(v.numpy().tobytes()).decode()} for v in vecs[k]]}).encode(),
            a.items) for k, (q, _) in enumerate(w3)]}  # (body, items)
    port = free_port()
    proc = start_server(["--score-template", W3_TEMPLATE, "--score-labels", "yes,no",
                         "--max-queries", str(max(4096, a.items)), "--max-body-bytes", str(64 << 20),
                         "--max-score-tokens", str(1 << 20), "--max-queue-ms", "60000", *flags],
                        port, server_cpus, 600)
    try:
        import httpx

        out["http"] = {}
        for w in ("w3", "w6"):
            got = httpx.post(f"http://127.0.0.1:{port}/v1/score", content=bodies[w][0][0], timeout=120,
                             headers={"content-type": "application/json"}).json()
            diff = float(np.abs(np.asarray(got["scores"]) - np.asarray(want[w])).max())
            closed_loop(port, bodies[w], a.clients, min(3.0, a.seconds), load_cpus)  # warm-up
            r, ms = closed_loop(port, bodies[w], a.clients, a.seconds, load_cpus)
            out["http"][w] = {"items_per_s": r, "p50_ms": statistics.median(ms),
                              "p99_ms": sorted(ms)[min(len(ms) - 1, int(0.99 * len(ms)))],
                              "requests": len(ms), "max_abs_vs_inprocess": diff,
                              "ratio": r / out["inprocess"][w]}
    finally:
        out["server_exit"] = stop_server(proc)
    print(f"{'workload':8s} {'in-process /s':>14s} {'/v1/score /s':>13s} {'ratio':>6s} {'p50 ms':>8s} "
          f"{'p99 ms':>8s}  ({a.clients} clients)")
    for w in ("w3", "w6"):
        h = out["http"][w]
        print(f"{w:8s} {out['inprocess'][w]:14.0f} {h['items_per_s']:13.0f} {h['ratio']:6.2f} "
              f"{h['p50_ms']:8.1f} {h['p99_ms']:8.1f}  max |diff| {h['max_abs_vs_inprocess']:.1e}")
    print("targets (H200, 0.5B): W3 in-process >= 5,500 items/s, /v1/score >= 0.90 of it; W6 >= 20,000")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "ranking_http.json").write_text(json.dumps(out, indent=1))
    print(f"wrote {OUT / 'ranking_http.json'}")


if __name__ == "__main__":
    main()
