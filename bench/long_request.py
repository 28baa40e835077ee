"""A long score request against the default server (issue 48's CPU target): does anything else
still get through, and does a deadline free the engine?

    python -m bench.long_request                         # bundled model on this CPU, default serve
    python -m bench.long_request --tokens 2048 -- --model /tmp/q05 --device cuda

One `prefixscore serve --score-template ...` (its defaults otherwise; flags after `--` added), then:
  behind     /v1/score {"query": [100] * --tokens, "items": [[5]]}; 1 s later a plain
             /v1/classify: its status and latency; /healthz polled every 0.25 s for the long
             request's passes (the pass length the engine keeps); the long request's own time
  deadline   the same long request with X-Request-Timeout: --deadline-s: its status, detail and
             time; at the moment its 504 arrives a /v1/classify probe is sent, whose latency bounds
             how long the engine still held the request (the pass in flight, then the probe's own)
Writes $OUT/long_request.json (bench/results without OUT).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

OUT = Path(os.environ.get("OUT") or "bench/results")
TEMPLATE = "Is the item relevant to the query? Answer yes or no.\nQuery: {query}\nItem: {item}"


def start(port, flags, score=True):
    """`prefixscore serve` on the port (with a score template unless score=False), once ready."""
    cmd = [sys.executable, "-m", "prefixscore.cli", "serve", "--port", str(port),
           *(["--score-template", TEMPLATE] if score else []), *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/healthz", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, "the server exited"
        time.sleep(0.5)
    raise TimeoutError("server not ready")


def timed(fn):
    t = time.monotonic()
    r = fn()
    return r, round(time.monotonic() - t, 3)


def long_request(base, tokens, headers, out, t0):
    r, s = timed(lambda: httpx.post(base + "/v1/score", json={"query": [100] * tokens, "items": [[5]]},
                                    headers=headers, timeout=3600))
    out.update(status=r.status_code, seconds=s, done_at=round(time.monotonic() - t0, 3),
               detail=r.json().get("detail") if r.status_code != 200 else None)


def classify(base, query="beige trench coat women"):
    r, s = timed(lambda: httpx.post(base + "/v1/classify", json={"query": query}, timeout=600))
    return {"status": r.status_code, "seconds": s}


def scenario(base, tokens, deadline_s):
    t0, longr, polls = time.monotonic(), {}, []
    headers = {"X-Request-Timeout": str(deadline_s)} if deadline_s else {}
    th = threading.Thread(target=long_request, args=(base, tokens, headers, longr, t0))
    th.start()
    time.sleep(1.0)
    out = {"classify_behind": classify(base)}
    while th.is_alive():
        try:
            run = httpx.get(base + "/healthz", timeout=5).json().get("running") or []
        except httpx.HTTPError:
            run = []
        if run:
            polls.append((round(time.monotonic() - t0, 2), run[0]["passes"], run[0]["of_passes"]))
        if deadline_s and "status" in longr:
            break
        th.join(0.25)
    th.join()
    if deadline_s:
        out["probe_after_504"] = classify(base, "levis 501 straight leg")
    out["long"] = longr
    # when the pass count changed (to within a poll): the passes' lengths between changes
    changes = [b for a, b in zip(polls, polls[1:]) if b[1] > a[1]]
    spans = [(b[0] - a[0]) / (b[1] - a[1]) for a, b in zip(changes, changes[1:])]
    out["passes_seen"] = polls[-1][1:] if polls else None
    out["pass_s_mean"] = (round((changes[-1][0] - changes[0][0]) / (changes[-1][1] - changes[0][1]), 3)
                          if len(changes) > 1 else None)
    out["pass_s_max_seen"] = round(max(spans), 3) if spans else None
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8190)
    ap.add_argument("--deadline-s", type=float, default=5.0)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("flags", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    flags = a.flags[1:] if a.flags[:1] == ["--"] else a.flags
    proc, base = start(a.port, flags)
    try:
        out = {"tokens": a.tokens, "flags": flags, "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()}
        out["behind"] = scenario(base, a.tokens, None)
        out["deadline"] = scenario(base, a.tokens, a.deadline_s)
    finally:
        proc.terminate()
        proc.wait(60)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "long_request.json").write_text(json.dumps(out, indent=1))
    b, d = out["behind"], out["deadline"]
    print(f"classify behind a {a.tokens}-token score request: {b['classify_behind']}")
    print(f"the long request: {b['long']['status']} in {b['long']['seconds']} s, passes "
          f"{b['passes_seen']}, a pass {b['pass_s_mean']} s mean, {b['pass_s_max_seen']} s at most seen")
    print(f"with X-Request-Timeout {a.deadline_s}: {d['long']['status']} at {d['long']['seconds']} s: "
          f"{d['long']['detail']}")
    print(f"classify probe sent at that 504: {d['probe_after_504']}")
    print(f"wrote {OUT / 'long_request.json'}")


if __name__ == "__main__":
    main()
