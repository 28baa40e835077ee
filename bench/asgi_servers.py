"""The HTTP server alone: a minimal ASGI app (read the body, answer a fixed classify-sized JSON)
under uvicorn (httptools, uvloop: what `prefixscore serve` runs) and granian (ASGI and its own RSGI
interface), each pinned to one CPU, wrk on another, closed loop. Whether a faster server would
pay for the front end's time (issue 32's candidate); granian is not a dependency: skipped when
not installed.

    python -m bench.asgi_servers --wrk PATH [--conns 16] [--seconds 4]

Writes $OUT/asgi_servers.json (bench/results without OUT).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .http import free_port

OUT = Path(os.environ.get("OUT") or "bench/results")
APP = r'''
import json
BODY = json.dumps({"results": [{"query": "levis 501 straight leg", "label": "Jeans",
                   "scores": {f"label{i}": -1.5 - i for i in range(9)}}]}).encode()
HEAD = [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": HEAD})
    await send({"type": "http.response.body", "body": BODY})

class RSGI:
    async def __rsgi__(self, scope, proto):
        await proto()
        proto.response_bytes(200, [("content-type", "application/json")], BODY)

rsgi = RSGI()
'''


def servers(port: int) -> dict[str, list[str]]:
    py = sys.executable
    out = {"uvicorn": [py, "-m", "uvicorn", "asgi_app:app", "--host", "127.0.0.1", "--port", str(port),
                       "--http", "httptools", "--loop", "uvloop", "--log-level", "error", "--no-access-log"]}
    if shutil.which("granian"):
        common = ["--host", "127.0.0.1", "--port", str(port), "--workers", "1", "--log-level", "error"]
        out["granian asgi"] = ["granian", "--interface", "asgi", *common, "--no-access-log", "asgi_app:app"]
        out["granian rsgi"] = ["granian", "--interface", "rsgi", *common, "asgi_app:rsgi"]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--wrk", required=True)
    ap.add_argument("--conns", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=4.0)
    a = ap.parse_args()
    from .request_timeline import wrk

    cpus = sorted(os.sched_getaffinity(0))
    a.load_cpus = {cpus[-1]}
    work = Path(tempfile.mkdtemp(prefix="asgi"))
    (work / "asgi_app.py").write_text(APP)
    bodies = work / "bodies.jsonl"
    bodies.write_text(json.dumps({"query": "levis 501 straight leg"}) + "\n")
    a.wrk_seconds = a.seconds
    rows = []
    for name, cmd in servers(free_port()).items():
        port = int(cmd[cmd.index("--port") + 1])
        p = subprocess.Popen(["taskset", "-c", str(cpus[0]), *cmd], cwd=work, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        try:
            time.sleep(2.0)
            r = wrk(a, port, a.conns, str(bodies))
            rows.append({"server": name, **{k: r[k] for k in ("req_s", "p50_ms", "p99_ms", "errors")}})
            print(f"{name:>14} {r['req_s']:>9.0f} req/s  p50 {r['p50_ms']:.3f} ms  errors {r['errors']}",
                  flush=True)
        finally:
            p.terminate()
            p.wait()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "asgi_servers.json").write_text(json.dumps({"cpus": len(cpus), "conns": a.conns, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
