"""The latency-target workload (issue 31): `prefixscore serve` under load against its SLO targets,
one fresh server, six phases, each bounded in time.

    python -m bench.slo --quick                                    # bundled model on CPU, short
    python -m bench.slo --server-cpus 0-9 --load-cpus 10-15 -- --model /tmp/q05 --device cuda --target-p99-ms 5

Flags after `--` go to `prefixscore serve` and to the in-process classifier. Before them the bench
puts bench.http's --max-connections 32768, the server's own default --max-queue (bench.http raises
it: here overload meets the server's admission as shipped), a --score-template (labels yes,no) when
they name none, and --max-score-tokens 2 x --score-tokens: flags after `--` win. One load process
per --load-cpus CPU by default. At 10x a fast server's capacity the generator may lag (HTTP/1.1:
connections are opened before a phase, and the overload phases pipeline up to --pipeline requests
on a busy one): its lateness, the sends pipelined, those that waited for a connection and those
never sent are reported beside the figures.

Method: bench.http's (its docstring). Open loop, Poisson arrivals, latency from each request's
scheduled send (no coordinated omission); the generator's lateness reported per phase; server and
load processes on disjoint CPUs (--server-cpus, --load-cpus). /v1/classify bodies are the real
queries of tests/data/intent_dev.csv; they carry X-Request-Timeout (--deadline-ms) after the
capacity phase.
  inproc    Classifier.classify(q), one call at a time, in a child pinned like the server
  capacity  bench.http's ramp and bisection (find_capacity): the highest rate that held
  open      50% and 80% of capacity: p50 / p99 / p99.9 (bench.http's driver)
  overload  2x and 10x capacity, --overload-s each: sent == answered (each status counted), no 200
            past its deadline (from its actual send), goodput = 200s within deadline /s over
            capacity, p99 of the 429/503 answers (from send) and of the 504s (past the deadline),
            Retry-After on every 429/503
  score     classify at 50% for --score-s; --score-n /v1/score requests of ~--score-tokens tokens
            (usage.prompt_tokens, sized by probing it), spaced: classify p99 of the requests sent
            while one runs against the rest's; the score requests' latency
            (SGLang's default apply_softmax false; --score-softmax 1: softmax over the labels)
  step      50% -> 150% -> 50% of capacity, --step-s each: classify + /v1/score requests of
            --step-items items, at level x (0.5, 1.5) x * --step-score-share / (a lone step request's
            latency, timed first: the score traffic is sized by what the server does for it, not by
            the classify rate, whose 1% overloaded the 50% level on the H200). 100 ms buckets: p99 per
            route (by send), 200s/s per route (by answer), shed share (non-200, by send), depth
            (the answers' `depth`; the gauge prefixscore_score_depth, scraped every 100 ms) ->
            $OUT/slo_step.png. Settling: after the step up, until score p99 stays within 110% of
            --target-p99-ms; after the step down, until depth stays at its maximum (--depth-max)
  fair      two clients (X-Client-Id) with the deadline for --overload-s: one at --fair-flood x
            capacity, one at --fair-light x: each one's share of its sends answered 200 within it
  lanes     real-time classify at 50% + --batch-conc batch requests ("priority": 1) kept in
            flight: real-time p99 over open's 50% p99; batch queries/s over the idle capacity
            (capacity - the real-time rate)
Then a summary (each figure beside its target: PASS / MISS / n/a; INVALID for a phase whose
generator fell behind its schedule by more than --lag-ms at p99: it measured itself) and $OUT/slo.json (or
bench/results/slo.json). What the server lacks (X-Request-Timeout, priority, /v1/score, depth) is
probed first; its figures are n/a.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
import traceback
from types import SimpleNamespace

import numpy as np

from .http import (OUT, TARGETS as HTTP_TARGETS, find_capacity, fmt_ms, fmt_rate, free_port, held, inprocess,
                   load_queries, merge, parse_cpus, print_header, print_row, start_server, stop_server)
from .loadgen import LoadGen, Scraper, http_post, post, scrape, status_name

TARGETS = {"p99_at_50_ms": HTTP_TARGETS["p99_at_50_ms"], "p99_at_80_ms": HTTP_TARGETS["p99_at_80_ms"],
           "goodput_share": 0.90, "reject_p99_ms": 5.0, "score_raise_ms": 2.0, "lanes_p99_ratio": 1.10,
           "batch_share": 0.80, "fair_share": 0.95}
SCORE_TEMPLATE = "Decide whether the item fits the query.\nQuery: {query}\nItem: {item}\nAnswer:"
WORDS = ("red", "wool", "coat", "blue", "silk", "dress", "black", "leather", "men", "women", "shoes", "cotton",
         "linen", "summer", "winter", "jacket", "green", "long", "short", "boots", "shirt", "denim", "white", "bag")
BUCKET_S = 0.1


def pctl(xs, *ps):
    """Nearest-rank percentiles (bench.http.pct's rule); None for an empty list."""
    xs = np.sort(np.asarray(xs, float))
    return [float(xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]) if len(xs) else None for p in ps]


def lat_stats(ms) -> dict:
    p50, p99, p999 = pctl(ms, 50, 99, 99.9)
    return {"n": len(ms), "p50_ms": p50, "p99_ms": p99, "p999_ms": p999,
            "max_ms": float(np.max(ms)) if len(ms) else None}


def statuses(st) -> dict:
    vals, counts = np.unique(st, return_counts=True)
    return {status_name(int(v)): int(c) for v, c in zip(vals, counts)}


# ---------------------------------------------------------------- probes, bodies

def probe(port, query) -> dict:
    """What the server supports of the contract, a request each."""
    f = {"deadline_header": post(port, "/v1/classify", {"query": query}, {"X-Request-Timeout": "0.000001"})[0],
         "priority": post(port, "/v1/classify", {"query": query, "priority": 1})[0]}
    f["score"], _, body = post(port, "/v1/score", score_body(query, 2, 4))
    body = body if isinstance(body, dict) else {}
    f = ({k: v == (504 if k == "deadline_header" else 200) for k, v in f.items()}
         | {f"{k}_status": v for k, v in f.items()})
    f["depth_field"], f["scored_field"] = "depth" in body, "scored" in body
    f["depth_gauge"] = any(k.startswith("prefixscore_score_depth") for k in scrape(port) or {})
    return f


def score_body(query, n_items, words) -> dict:
    """One query and n_items items of `words` words each, drawn per item from WORDS: items differ
    from their first words (a server may compute a prefix that items share once)."""
    return {"query": query, "items": [" ".join(random.Random(j).choices(WORDS, k=words)) for j in range(n_items)]}


def size_score(port, query, tokens, max_items, extra=None) -> tuple[dict, dict]:
    """A /v1/score body of about `tokens` tokens as the server counts them (usage.prompt_tokens):
    n items of w words, w scaled by the probes' counts (halved on a 413: over the server's limit)."""
    n = max(1, min(max_items, round(tokens / 64)))
    w, pts = max(1, tokens // n), []
    for _ in range(6):
        # extra: batch priority where the server has it, since depth control leaves items unscored
        # and uncounted (H200: probes of more words counted fewer tokens; step items of ~90, not 16)
        st, _, body = post(port, "/v1/score", {**score_body(query, n, w), **(extra or {})})
        if st not in (200, 413):
            raise RuntimeError(f"/v1/score answered {st}: {body}")
        pts.append((w, body["usage"]["prompt_tokens"] if st == 200 else None))
        best = max(((w_, p) for w_, p in pts if p is not None and p <= tokens), default=(0, 0))
        if best[1] >= 0.97 * tokens:
            break
        got = pts[-1][1]
        nxt = round(w * tokens / got) if got else w // 2
        w = max(1, min(nxt, w - 1) if got is None or got > tokens else max(nxt, w + 1))
        if w in dict(pts):
            break
    if not best[0]:
        raise RuntimeError(f"no /v1/score body of {n} items fits {tokens} tokens: probes {pts}")
    return score_body(query, n, best[0]), {"items": n, "words_per_item": best[0], "prompt_tokens": best[1],
                                           "probes": pts}


# ---------------------------------------------------------------- running streams

def classify_stream(queries, segments, deadline_s=None, priority=0, per_request=1, client=None) -> dict:
    hdr = ({"X-Request-Timeout": f"{deadline_s:g}"} if deadline_s else {}) | ({"X-Client-Id": client} if client else {})
    extra = {"priority": priority} if priority else {}
    qs = [queries[k:k + per_request] if per_request > 1 else queries[k] for k in range(0, len(queries), per_request)]
    return {"payloads": [http_post("/v1/classify", {"query": q, **extra}, hdr) for q in qs], "segments": segments}


def run(c, streams, seed, timeout=None, max_conns=None, hold_s=0.005, pipeline=1) -> dict:
    a = c.a
    return c.gen.streams(c.port, streams, timeout or a.timeout, max_conns or a.max_conns, a.conns, seed, a.spin_ms,
                         a.lag_ms, hold_s, pipeline)


def note(R) -> str:
    g = R["gen"]
    return (f"generator late p99 {g['late_p99_ms']:.2f} ms{' LAGGED' if g['lagged'] else ''}"
            + (f", {g['conn_limited']} sends waited for a connection" if g["conn_limited"] else "")
            + (f", {g['pipelined']} pipelined" if g.get("pipelined") else "")
            + (f", {g['not_sent']} never sent (no connection free in time)" if g["not_sent"] else ""))


def wait_idle(c, limit_s=60.0) -> float:
    """Seconds until a lone classify request is answered 200 within its deadline twice in a row:
    what the last phase left queued has drained (at most limit_s)."""
    t0, good = time.monotonic(), 0
    while good < 2 and time.monotonic() - t0 < limit_s:
        t = time.monotonic()
        st = post(c.port, "/v1/classify", {"query": c.queries[0]}, {"X-Request-Timeout": f"{c.deadline_s:g}"},
                  timeout=c.deadline_s + 5)[0]
        good = good + 1 if st == 200 and time.monotonic() - t <= c.deadline_s else 0
        time.sleep(0.05)
    return time.monotonic() - t0


# ---------------------------------------------------------------- phases

def phase_open(c) -> dict:
    a, out = c.a, {}
    for k, frac in enumerate((0.5, 0.8)):
        outs, dur = c.gen.open_loop(c.port, frac * c.cap, a.duration, a.max_requests, a.timeout, a.max_conns,
                                    a.conns, 200 + k, a.spin_ms)
        row = merge(outs, frac * c.cap, dur, a.lag_ms)
        row.update(phase=f"{frac:.0%} cap", held=held(row), p999_ms=pctl(np.concatenate(
            [np.frombuffer(o["lat"], np.float32)[np.frombuffer(o["status"], np.uint16) == 200] for o in outs]), 99.9)[0])
        print_row(row)
        out[f"{round(100 * frac)}"] = row
        time.sleep(a.pause)
    return out


def phase_overload(c) -> dict:
    a, out, dl_ms = c.a, {}, 1e3 * c.deadline_s
    for k, mult in enumerate((2, 10)):
        rate = mult * c.cap
        dur = min(a.overload_s, a.max_requests / rate)
        before = scrape(c.port) or {}
        R = run(c, [classify_stream(c.queries, [(0, dur, rate)], c.deadline_s)], 300 + k,
                timeout=c.deadline_s + 5, max_conns=a.overload_conns, hold_s=c.deadline_s + 0.01, pipeline=a.pipeline)
        after = scrape(c.port) or {}
        st, sent_ms, written = R["status"], R["lat"] - R["wrote"], R["wrote"] >= 0  # from the actual write
        ok, shed = st == 200, (st == 429) | (st == 503)
        in_time = ok & (sent_ms <= dl_ms)
        # each answer's wait: 429 and 503 from the send, 504 past the deadline
        wait = np.where(st == 504, sent_ms - dl_ms, sent_ms)
        rejects = {str(s): {"n": int((st == s).sum()), "retry_after": int(R["retry"][st == s].sum()),
                            "p50_ms": pctl(wait[st == s], 50)[0], "p99_ms": pctl(wait[st == s], 99)[0]}
                   for s in (429, 503, 504) if (st == s).any()}
        row = {"offered_rps": rate, "duration_s": dur, "scheduled": int(len(st)), "sent": int(written.sum()),
               "answered": int((st >= 100).sum()),
               "statuses": statuses(st), "late_200": int((ok & ~in_time).sum()),
               "goodput_rps": float(in_time.sum() / dur), "goodput_share": float(in_time.sum() / dur / c.cap),
               "ok": lat_stats(R["lat"][ok]), "rejects": rejects, "shed_429_503": int(shed.sum()),
               "reject_p99_ms": pctl(wait[shed | (st == 504)], 99)[0],
               "retry_after_missing": int((shed & (R["retry"] == 0)).sum()), "gen": R["gen"],
               "counters": {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)
                            and "_created" not in k and any(w in k for w in ("expired", "shed", "deadline", "reject"))}}
        out[f"x{mult}"] = row
        print(f"  x{mult} ({fmt_rate(rate)}/s, {dur:.1f} s): sent {row['sent']} of {row['scheduled']}, answered "
              f"{row['answered']} "
              f"{row['statuses']}; 200s past deadline {row['late_200']}; goodput {fmt_rate(row['goodput_rps'])}/s"
              f" ({row['goodput_share']:.0%} of capacity); shed p99 {fmt_ms(row['reject_p99_ms'])} ms "
              f"{ {s: fmt_ms(v['p99_ms']) for s, v in rejects.items()} }; 429/503 without Retry-After "
              f"{row['retry_after_missing']}; {note(R)}", flush=True)
        time.sleep(a.pause)
        if mult == 2:
            row["idle_after_s"] = wait_idle(c)
    return out


def phase_score(c) -> dict:
    D, n = c.a.score_s, c.a.score_n
    R = run(c, [classify_stream(c.queries, [(0, D, 0.5 * c.cap)], c.deadline_s),
                {"payloads": [http_post("/v1/score", c.score_body)], "at": [(k + 0.5) * D / n for k in range(n)],
                 "field": b'"prompt_tokens":'}], 400, timeout=max(c.a.timeout, 120.0))
    sc = R["stream"] == 1
    during = np.zeros(len(R["t"]), bool)
    for s, e in zip(R["t"][sc], R["done"][sc]):
        during |= (R["t"] >= s) & (R["t"] < e)
    cl = ~sc & (R["status"] == 200)
    w, wo = lat_stats(R["lat"][cl & during]), lat_stats(R["lat"][cl & ~during])
    row = {"score_ms": R["lat"][sc].tolist(), "score_status": R["status"][sc].tolist(),
           "score_prompt_tokens": R["value"][sc].tolist(), "classify_with": w, "classify_without": wo,
           "raise_ms": w["p99_ms"] - wo["p99_ms"] if w["n"] and wo["n"] else None,
           "classify_statuses": statuses(R["status"][~sc]), "gen": R["gen"]}
    print(f"  classify p99 {fmt_ms(w['p99_ms'])} ms sent while a score request ran (n={w['n']}), {fmt_ms(wo['p99_ms'])}"
          f" ms otherwise (n={wo['n']}), {row['classify_statuses']}; score ms {[round(x, 1) for x in row['score_ms']]}"
          f" status {row['score_status']}; {note(R)}", flush=True)
    time.sleep(c.a.pause)
    return row


def settle(ts, ys, t0, t1, ok) -> float | None:
    """Seconds from t0 until every bucket of [t0, t1) with a value is ok(value) (the end of the last
    one that was not); None without values, or when the last one was not."""
    seen = [(t, y) for t, y in zip(ts, ys) if t0 <= t < t1 and y is not None]
    bad = [t for t, y in seen if not ok(y)]
    return None if not seen or (bad and bad[-1] == seen[-1][0]) else bad[-1] + BUCKET_S - t0 if bad else 0.0


def phase_step(c) -> dict:
    T, cap = c.a.step_s, c.cap
    solo = [post(c.port, "/v1/score", c.step_body)[0] for _ in range(2)]  # warm
    t = []
    for _ in range(3):
        t0 = time.perf_counter()
        solo.append(post(c.port, "/v1/score", c.step_body)[0])
        t.append(time.perf_counter() - t0)
    lone_s = sorted(t)[1]
    per_level = c.a.step_score_share / lone_s  # score requests/s at level 1.0
    levels = ((0, T, 0.5), (T, 2 * T, 1.5), (2 * T, 3 * T, 0.5))
    scraper = Scraper(c.port, BUCKET_S)
    R = run(c, [classify_stream(c.queries, [(t0, t1, x * cap) for t0, t1, x in levels], c.deadline_s),
                {"payloads": [http_post("/v1/score", c.step_body)], "field": b'"depth":',
                 "segments": [(t0, t1, x * per_level) for t0, t1, x in levels]}], 500, timeout=max(c.a.timeout, 60.0))
    samples = scraper.stop()
    gauge = [(t - R["start"], max((v for k, v in m.items() if k.startswith("prefixscore_score_depth")), default=0))
             for t, m in samples]
    end = min(4 * T, max(3 * T, float(R["done"].max(initial=0))))  # and what answers after the steps
    edges = np.arange(int(math.ceil(end / BUCKET_S)) + 1) * BUCKET_S
    b_sent, b_done = np.digitize(R["t"], edges) - 1, np.digitize(R["done"], edges) - 1
    st, sc = R["status"], R["stream"] == 1
    s = {k: [] for k in ("t", "classify_p99_ms", "score_p99_ms", "classify_rps", "score_rps", "shed", "depth",
                         "depth_gauge")}
    for b in range(len(edges) - 1):
        sent, done = b_sent == b, b_done == b
        s["t"].append(round(b * BUCKET_S, 3))
        for route, m in (("classify", ~sc), ("score", sc)):
            s[f"{route}_p99_ms"].append(pctl(R["lat"][sent & m & (st == 200)], 99)[0])
            s[f"{route}_rps"].append(float((done & m & (st == 200)).sum() / BUCKET_S))
        s["shed"].append(float((st[sent] != 200).mean()) if sent.any() else None)
        d = R["value"][done & sc & (R["value"] > 0)]
        s["depth"].append(float(np.median(d)) if len(d) else None)
        g = [v for t, v in gauge if b * BUCKET_S <= t < (b + 1) * BUCKET_S and v > 0]  # 0: not set yet
        s["depth_gauge"].append(g[-1] if g else None)
    target = c.serve.target_p99_ms
    dmax = min(c.serve.depth_max, len(c.step_body["items"])) if c.serve.depth_max else None
    depth = s["depth_gauge"] if any(v is not None for v in s["depth_gauge"]) else s["depth"]
    row = {"levels": levels, "lone_score_ms": 1e3 * lone_s, "lone_statuses": solo, "score_rps_at_1": per_level,
           "series": s, "target_p99_ms": target, "depth_max": dmax,
           "statuses": {"classify": statuses(st[~sc]), "score": statuses(st[sc])},
           "depth_from": "gauge" if depth is s["depth_gauge"] else "answers",
           "score_p99_settle_s": settle(s["t"], s["score_p99_ms"], T, 2 * T, lambda y: y <= 1.1 * target)
           if target else None,
           "depth_settle_s": settle(s["t"], depth, 2 * T, 3 * T, lambda y: y >= dmax) if dmax else None,
           "scrapes": len(samples), "scrape_failures": scraper.failed, "gen": R["gen"]}
    print(f"  {row['statuses']}; score p99 within 110% of the target {fmt_ms(row['score_p99_settle_s'])} s after the "
          f"step up; depth ({row['depth_from']}) back at {dmax} {fmt_ms(row['depth_settle_s'])} s after the step "
          f"down; {len(samples)} scrapes; {note(R)}", flush=True)
    time.sleep(c.a.pause)
    return row


def phase_lanes(c) -> dict:
    a, D = c.a, c.a.lanes_s
    batch = classify_stream(c.queries, [], priority=1, per_request=a.batch_queries)
    batch.update(closed=a.batch_conc, until=D, cap=a.batch_conc + int(3 * c.cap * D) + 1000)
    R = run(c, [classify_stream(c.queries, [(0, D, 0.5 * c.cap)], c.deadline_s), batch], 600)
    rt, bt, ok = R["stream"] == 0, R["stream"] == 1, R["status"] == 200
    rts, rt_rps = lat_stats(R["lat"][rt & ok]), float((rt & ok).sum() / D)
    batch_qps = float((bt & ok & (R["done"] <= D)).sum() * a.batch_queries / D)
    row = {"realtime": rts, "realtime_rps": rt_rps, "realtime_statuses": statuses(R["status"][rt]),
           "p99_ratio": rts["p99_ms"] / c.p99_50 if rts["n"] and c.p99_50 else None, "batch_qps": batch_qps,
           "idle_capacity_qps": c.cap - rt_rps, "batch_share": batch_qps / (c.cap - rt_rps) if c.cap > rt_rps else None,
           "batch_statuses": statuses(R["status"][bt]), "batch": lat_stats(R["lat"][bt & ok]), "gen": R["gen"]}
    print(f"  real-time p99 {fmt_ms(rts['p99_ms'])} ms (x{fmt_ms(row['p99_ratio'])} of open's 50%), "
          f"{row['realtime_statuses']}; batch {fmt_rate(batch_qps)} queries/s = {fmt_ms(row['batch_share'])} of the "
          f"idle {fmt_rate(c.cap - rt_rps)}/s, {row['batch_statuses']}; {note(R)}", flush=True)
    return row


def phase_fair(c) -> dict:
    """Two clients (X-Client-Id), both with the deadline: one floods at --fair-flood x capacity, the
    other sends --fair-light x capacity; each one's 200s within the deadline over its sends."""
    a, dl_ms = c.a, 1e3 * c.deadline_s
    D = min(a.overload_s, a.max_requests / (a.fair_flood * c.cap))
    R = run(c, [classify_stream(c.queries, [(0, D, a.fair_flood * c.cap)], c.deadline_s, client="flood"),
                classify_stream(c.queries, [(0, D, a.fair_light * c.cap)], c.deadline_s, client="light")],
            700, timeout=c.deadline_s + 5, max_conns=a.overload_conns, hold_s=c.deadline_s + 0.01, pipeline=a.pipeline)
    st, sent_ms = R["status"], R["lat"] - R["wrote"]
    row = {"duration_s": D, "gen": R["gen"]}
    for k, name in enumerate(("flood", "light")):
        mine, sent = R["stream"] == k, (R["stream"] == k) & (R["wrote"] >= 0)
        in_time = mine & (st == 200) & (sent_ms <= dl_ms)
        row[name] = {"offered_rps": (a.fair_flood, a.fair_light)[k] * c.cap, "sent": int(sent.sum()),
                     "statuses": statuses(st[mine]), "in_time": int(in_time.sum()),
                     "in_time_share": float(in_time.sum() / max(1, sent.sum())),
                     "ok": lat_stats(R["lat"][in_time])}
    fl, li = row["flood"], row["light"]
    print(f"  flood {fmt_rate(fl['offered_rps'])}/s: {fl['statuses']}, {fl['in_time_share']:.0%} within "
          f"{dl_ms:g} ms; light {fmt_rate(li['offered_rps'])}/s: {li['statuses']}, {li['in_time_share']:.1%} "
          f"within it (p99 {fmt_ms(li['ok']['p99_ms'])} ms); {note(R)}", flush=True)
    return row


# ---------------------------------------------------------------- summary, plot

def summary(out) -> list[dict]:
    """Each figure beside its target: PASS / MISS; n/a where the phase or the feature is missing."""
    ph, t, rows = out.get("phases", {}), TARGETS, []

    def add(figure, value, shown, target="", ok=None, lagged=False):
        """lagged: the phase's generator fell behind its schedule (late p99 > --lag-ms): it
        measured itself as much as the server, so the figure is INVALID, neither met nor missed."""
        verdict = "n/a" if value is None else "-" if ok is None else "INVALID" if lagged else \
            "PASS" if ok else "MISS"
        rows.append({"figure": figure, "value": value, "shown": "n/a" if value is None else shown, "target": target,
                     "verdict": verdict})

    def trio(r, last="p999_ms"):
        return " / ".join(fmt_ms(r.get(k)) for k in ("p50_ms", "p99_ms", last))

    cap = out.get("capacity", {})
    add("capacity, classify req/s", cap.get("rps"), f"{'≥ ' * bool(cap.get('lower_bound'))}{fmt_rate(cap.get('rps'))}")
    ip = out.get("inproc", {})
    add("in-process classify p50 / p99 / max ms", ip.get("p99_ms"), trio(ip, "max_ms"))
    for frac in ("50", "80"):
        r, lim = ph.get("open", {}).get(frac, {}), t[f"p99_at_{frac}_ms"]
        add(f"HTTP at {frac}%: p50 / p99 / p99.9 ms", r.get("p99_ms"), trio(r), f"p99 ≤ {lim:g}",
            (r.get("p99_ms") or 0) <= lim)
    for m in ("x2", "x10"):
        r = ph.get("overload", {}).get(m, {})
        g = r.get("gen", {})
        lag = bool(g.get("lagged"))
        add(f"{m}: generator late p99 ms (sends that waited for a connection)", g.get("late_p99_ms"),
            f"{fmt_ms(g.get('late_p99_ms'))} ({g.get('conn_limited')})", "on time", not g.get("lagged"))
        add(f"{m}: answered / sent (of scheduled)", r.get("answered"),
            f"{r.get('answered')} / {r.get('sent')} ({r.get('scheduled')})", "all",
            r.get("answered") == r.get("sent"), lagged=lag)
        add(f"{m}: 200s past their deadline", r.get("late_200"), str(r.get("late_200")), "0",
            r.get("late_200") == 0, lagged=lag)
        add(f"{m}: goodput / capacity", r.get("goodput_share"),
            f"{fmt_rate(r.get('goodput_rps'))}/s = {100 * r.get('goodput_share', 0):.0f}%",
            f"≥ {t['goodput_share']:.0%}", r.get("goodput_share", 0) >= t["goodput_share"], lagged=lag)
        add(f"{m}: p99 of 429/503 (from send), 504 (past deadline), ms", r.get("reject_p99_ms"),
            fmt_ms(r.get("reject_p99_ms")) + "".join(f" {k}: {fmt_ms(v['p99_ms'])}"
                                                     for k, v in r.get("rejects", {}).items()),
            f"≤ {t['reject_p99_ms']:g}", (r.get("reject_p99_ms") or 0) <= t["reject_p99_ms"], lagged=lag)
        add(f"{m}: 429/503 without Retry-After", r.get("retry_after_missing") if r.get("shed_429_503") else None,
            f"{r.get('retry_after_missing')} of {r.get('shed_429_503')}", "0",
            r.get("retry_after_missing") == 0, lagged=lag)
    r = ph.get("score", {})
    add("score into classify: classify p99 raised by, ms", r.get("raise_ms"),
        f"{fmt_ms(r.get('raise_ms'))} ({fmt_ms(r.get('classify_with', {}).get('p99_ms'))} vs "
        f"{fmt_ms(r.get('classify_without', {}).get('p99_ms'))})", f"≤ {t['score_raise_ms']:g}",
        (r.get("raise_ms") or 0) <= t["score_raise_ms"])
    add(f"score request of {out.get('score_body', {}).get('prompt_tokens')} tokens: ms", max(r["score_ms"]) if r.get(
        "score_ms") else None, ", ".join(f"{x:.1f}" for x in r.get("score_ms", ())))
    r = ph.get("step", {})
    add("step up: score p99 back within 110% of target, s", r.get("score_p99_settle_s"),
        fmt_ms(r.get("score_p99_settle_s")))
    add("step down: depth back at its maximum, s", r.get("depth_settle_s"), fmt_ms(r.get("depth_settle_s")))
    r = ph.get("lanes", {})
    add("lanes: real-time p99 / p99 at 50%", r.get("p99_ratio"), f"x{fmt_ms(r.get('p99_ratio'))} "
        f"({fmt_ms(r.get('realtime', {}).get('p99_ms'))} ms)", f"≤ x{t['lanes_p99_ratio']:g}",
        (r.get("p99_ratio") or 0) <= t["lanes_p99_ratio"])
    add("lanes: batch throughput / idle capacity", r.get("batch_share"), f"{100 * (r.get('batch_share') or 0):.0f}% "
        f"({fmt_rate(r.get('batch_qps'))} q/s)", f"≥ {t['batch_share']:.0%}",
        (r.get("batch_share") or 0) >= t["batch_share"])
    fair = ph.get("fair", {})
    r = fair.get("light", {})
    add("fair: the light client's sends answered 200 within the deadline", r.get("in_time_share"),
        f"{100 * (r.get('in_time_share') or 0):.1f}% of {r.get('sent')}", f"≥ {t['fair_share']:.0%}",
        (r.get("in_time_share") or 0) >= t["fair_share"], lagged=bool(fair.get("gen", {}).get("lagged")))
    print("\nsummary (n/a: the phase did not run or the server lacks the feature: see features and errors in the JSON)")
    w, v = max(len(r["figure"]) for r in rows), max(len(r["shown"]) for r in rows)
    for r in [{"figure": "figure", "shown": "value", "target": "target", "verdict": "verdict"}] + rows:
        print(f"  {r['figure']:<{w}s}  {r['shown']:>{v}s}  {r['target']:>9s}  {r['verdict']}")
    return rows


def plot(step, path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not importable: no step plot (pip install matplotlib)")
        return None
    s = step["series"]

    def y(key, k=1.0):
        return [np.nan if v is None else k * v for v in s[key]]

    fig, ax = plt.subplots(4, 1, figsize=(9, 9), sharex=True)
    for k, route in enumerate(("classify", "score")):
        ax[0].plot(s["t"], y(f"{route}_p99_ms"), f"C{k}.-", ms=3, label=route)
        ax[1].plot(s["t"], s[f"{route}_rps"], f"C{k}-", label=route)
    if step.get("target_p99_ms"):
        ax[0].axhline(step["target_p99_ms"], color="red", ls=":", lw=1, label="target")
    ax[0].set_yscale("log")
    ax[2].plot(s["t"], y("shed", 100), "C3-")
    ax[3].plot(s["t"], y("depth"), "C0.", ms=3, label="answers' depth")
    ax[3].plot(s["t"], y("depth_gauge"), "C1-", label="gauge (/metrics)")
    for a_, label in zip(ax, ("p99 ms (by send)", "200s/s (by answer)", "shed % (non-200)", "depth (items)")):
        a_.set_ylabel(label, fontsize=8)
        a_.grid(True, alpha=0.3)
        for t0, _, _ in step["levels"][1:]:
            a_.axvline(t0, color="gray", ls="--", lw=0.8)
        if a_.get_legend_handles_labels()[0]:
            a_.legend(fontsize=7)
    ax[3].set_xlabel("s from the phase start; 100 ms buckets")
    ax[0].set_title("prefixscore serve: step load 50% -> 150% -> 50% of capacity", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


# ---------------------------------------------------------------- main

FULL = {"rates": "100,300,1000,3000,6000,10000,15000,20000,30000,40000,50000,65000,80000", "duration": 5.0,
        "refine": 2, "stop_p99_ms": 200.0, "serial": 1000, "overload_s": 10.0, "score_s": 12.0, "score_n": 3,
        "score_tokens": 8192, "step_s": 5.0, "step_items": 256, "step_item_tokens": 16, "step_score_share": 0.5,
        "lanes_s": 10.0, "batch_conc": 64, "pause": 1.0, "lag_ms": 1.0, "fair_flood": 5.0,
        "fair_light": 0.05}
QUICK = {"rates": "2,4,8,16,32", "duration": 2.0, "refine": 1, "stop_p99_ms": 5000.0, "serial": 30, "overload_s": 3.0,
         "score_s": 6.0, "score_n": 2, "score_tokens": 512, "step_s": 3.0, "step_items": 16, "step_item_tokens": 8,
         "step_score_share": 0.5, "lanes_s": 4.0, "batch_conc": 4, "pause": 0.5, "lag_ms": 25.0, "fair_flood": 5.0,
         "fair_light": 0.05}
PHASES = ("open", "overload", "score", "step", "lanes", "fair")


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"short phases at low rates (a CPU trial): {QUICK}")
    for k, v in FULL.items():  # rates, duration, refine, stop_p99_ms, lag_ms, pause: bench.http's
        ap.add_argument("--" + k.replace("_", "-"), type=type(v), default=None, help=f"default {v}")
    for flag, kind, default, text in (
            ("--phases", str, ",".join(PHASES), "the phases after capacity"),
            ("--deadline-ms", float, None, "X-Request-Timeout of classify (default max(50, 10 x in-process p99))"),
            ("--batch-queries", int, 1, "queries per batch request (lanes)"),
            ("--max-requests", int, 3_000_000, "at most this many per phase"),
            ("--load-procs", int, None, "default one per --load-cpus CPU, else max(2, CPUs // 4)"),
            ("--server-cpus", str, None, "pin the server and the in-process phase: 0-9"),
            ("--load-cpus", str, None, "pin the load processes: 10-15"),
            ("--conns", int, 64, "keep-alive connections opened before a phase"),
            ("--max-conns", int, 1024, "client connections at most"),
            ("--overload-conns", int, 16384, "client connections at most, overload phases"),
            ("--pipeline", int, 8, "overload and fair phases: with no connection idle, a send goes out "
             "behind up to N - 1 others on a busy one (HTTP/1.1 pipelining) rather than wait for one"),
            ("--timeout", float, 10.0, "client timeout (s)"), ("--spin-ms", float, 1.0, "the pacer's spin"),
            ("--queries", str, None, "CSV with a query column"), ("--ready-timeout", float, 600.0, "s"),
            ("--score-softmax", int, 0, "1: score and step bodies ask apply_softmax (softmax over "
             "the scorer's labels); 0: SGLang's default, each label's share of the vocabulary")):
        ap.add_argument(flag, type=kind, default=default, help=text)
    ap.add_argument("serve_flags", nargs=argparse.REMAINDER, help="-- then flags for prefixscore serve")
    a = ap.parse_args()
    for k, v in (QUICK if a.quick else FULL).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.serve_flags = a.serve_flags[1:] if a.serve_flags[:1] == ["--"] else a.serve_flags
    a.rates, a.phases = [float(r) for r in a.rates.split(",")], [p for p in a.phases.split(",") if p]
    a.server_cpus, a.load_cpus = parse_cpus(a.server_cpus), parse_cpus(a.load_cpus)
    if a.load_procs is None:
        a.load_procs = len(a.load_cpus) if a.load_cpus else max(2, (os.cpu_count() or 2) // 4)
    return a


def serve_options(flags):
    """The server flags this bench reads (the depth range's default: the server's own, if known)."""
    p = argparse.ArgumentParser(add_help=False)
    for flag, kind, default in (("--target-p99-ms", float, None), ("--depth-max", int, None),
                                ("--max-queries", int, 256), ("--score-template", str, None)):
        p.add_argument(flag, type=kind, default=default)
    o = p.parse_known_args(flags)[0]
    if o.depth_max is None:
        try:
            from prefixscore.serve.config import ScheduleOptions

            o.depth_max = ScheduleOptions().depth_max
        except (ImportError, AttributeError):
            pass
    return o


def main():
    a = parse_args()
    queries, serve = load_queries(a.queries), serve_options(a.serve_flags)
    if a.load_cpus:  # the parent's /metrics scraper stays off the server's CPUs
        os.sched_setaffinity(0, a.load_cpus)
    try:
        from prefixscore.serve.config import FrontendConfig

        flags = ["--max-queue", str(FrontendConfig().max_queue)]
    except (ImportError, AttributeError, TypeError):
        flags = []
    flags += [] if serve.score_template else ["--score-template", SCORE_TEMPLATE, "--score-labels", "yes,no"]
    flags += ["--max-score-tokens", str(max(8192, 2 * a.score_tokens)), *a.serve_flags]
    meta = {"serve_flags": flags, "cpus": os.cpu_count(), "load_procs": a.load_procs, "targets": TARGETS,
            "args": {k: sorted(v) if isinstance(v, set) else v for k, v in vars(a).items()}}
    out = {"meta": meta, "phases": {}, "errors": {}}
    print(f"{os.cpu_count()} CPUs; server on {a.server_cpus or 'any'}, {a.load_procs} load processes on "
          f"{a.load_cpus or 'any'}", flush=True)
    r = inprocess(a.serve_flags, queries, a.serial, a.server_cpus)  # bench.http's phase
    ip = out["inproc"] = r["inproc"]
    out["engine"] = r["engine"]
    out["deadline_ms"] = a.deadline_ms or max(50.0, 10 * ip["p99_ms"])
    print(f"in-process classify(q): p50 {ip['p50_ms']:.3f}  p99 {ip['p99_ms']:.3f}  max {ip['max_ms']:.3f} ms "
          f"({ip['n']} calls); request deadline {out['deadline_ms']:g} ms", flush=True)
    c = SimpleNamespace(gen=LoadGen(a.load_procs, "http", queries, a.load_cpus), a=a, port=free_port(), queries=queries,
                        deadline_s=out["deadline_ms"] / 1e3, serve=serve, p99_50=None)
    proc = None
    try:
        t = time.monotonic()
        proc = start_server(flags, c.port, a.server_cpus, a.ready_timeout)
        f = out["features"] = probe(c.port, queries[0])
        print(f"server ready in {time.monotonic() - t:.1f} s; features {f}", flush=True)
        try:
            if f["score"]:
                c.score_body, sb = size_score(c.port, queries[0], a.score_tokens, serve.max_queries,
                                              {"priority": 1} if f["priority"] else None)
                out["score_body"] = sb
                words = max(1, round(a.step_item_tokens * sb["items"] * sb["words_per_item"] / sb["prompt_tokens"]))
                c.step_body = score_body(queries[1], min(a.step_items, serve.max_queries), words)
                for body in (c.score_body, c.step_body):
                    body["apply_softmax"] = bool(a.score_softmax)
                print(f"score body: {sb}; step: {len(c.step_body['items'])} items of {words} words", flush=True)
        except Exception as e:  # the score phases are then n/a
            f["score"], out["errors"]["score_body"] = False, f"{type(e).__name__}: {e}"
        c.gen.serial(c.port, 20, a.timeout)  # warm the server
        print_header()
        rows, c.cap, lower, why = find_capacity(c.gen, a, (c.port, None))
        out["capacity"] = {"rps": c.cap, "lower_bound": lower, "ramp_stop": why, "rows": rows}
        print(f"  capacity {'≥ ' * lower}{fmt_rate(c.cap)} req/s ({why})", flush=True)
        if not c.cap:
            raise RuntimeError("no rate held: no capacity to run the phases at")
        for name, fn, missing in (("open", phase_open, None), ("overload", phase_overload, None),
                                  ("score", phase_score, None if f["score"] else "no /v1/score"),
                                  ("step", phase_step, None if f["score"] else "no /v1/score"),
                                  ("lanes", phase_lanes, None if f["priority"] else "no priority field"),
                                  ("fair", phase_fair, None if f["deadline_header"] else "no X-Request-Timeout")):
            if name not in a.phases or missing:
                out["errors"][name] = missing or "not asked for (--phases)"
                continue
            print(f"== {name}", flush=True)
            try:
                out["phases"][name] = fn(c)
            except Exception as e:
                traceback.print_exc()
                out["errors"][name] = f"{type(e).__name__}: {e}"
            out["phases"].get(name, {})["idle_after_s"] = w = wait_idle(c)
            print(f"  server idle again {w:.1f} s after the phase", flush=True)
            c.p99_50 = out["phases"].get("open", {}).get("50", {}).get("p99_ms")
    except Exception as e:
        traceback.print_exc()
        out["errors"]["run"] = f"{type(e).__name__}: {e}"
    finally:
        if proc is not None:
            out["exit_code"] = stop_server(proc)
        c.gen.close()
    out["summary"] = summary(out)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "slo.json").write_text(json.dumps(out, indent=1, default=lambda o: getattr(o, "tolist", lambda: str(o))()))
    print(f"wrote {OUT / 'slo.json'}")
    if "step" in out["phases"] and plot(out["phases"]["step"], OUT / "slo_step.png"):
        print(f"wrote {OUT / 'slo_step.png'}")


if __name__ == "__main__":
    main()
