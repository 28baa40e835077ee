"""The README's commands and code, run as a reader runs them: parsed out of README.md (so the README
as edited is what is tested), from a clone's paths, on CPU.

Which blocks are code: fenced ```bash / ```sh / ```shell blocks and indented blocks (the Set up
commands) are shell, one logical line at a time (a trailing backslash continues a line); fenced
```python blocks run whole in a fresh interpreter (sys.executable); other fences (```text, ```yaml)
are not code. What is not run, by a rule the README states where a reader sees it:
  - install steps: the `pip install ...` parts of a `&&` chain (the rest of the chain runs);
  - test-suite runs: `python -m pytest ...`, `bash tests/gpu.sh` (this test is part of the suite);
  - a line, or a Python block whose first line, carries `# needs: GPU` / `# needs: network` (...).
A shell line that starts `prefixscore serve` starts the server: it runs on a free port (the
block's `:8000` becomes that port), the block's other lines run once /healthz answers 200, and the
server is stopped with SIGTERM after them.

Every command runs in a scratch folder holding links to the repository's tracked files (git
ls-files) outside the package, so a path the README names must be in a clone, and outputs such as
out.jsonl land in the scratch folder, not in the checkout. `prefixscore` is this interpreter's
entry point, else `python -m prefixscore.cli`."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
SHELL_LANGS = {"bash", "sh", "shell", "console"}
NEEDS = re.compile(r"#\s*needs:\s*(.+?)\s*$", re.IGNORECASE)
TEST_RUNS = ("python -m pytest", "python3 -m pytest", "pytest ", "bash tests/gpu.sh")
TIMEOUT_S = 900  # one command: the first load of the bundled model converts its GGUF file (~40 s)


@dataclass
class Block:
    line: int  # 1-based line of the README where the block's code starts
    lang: str  # "python" or "shell"
    code: str

    @property
    def id(self) -> str:
        return f"README.md:{self.line}-{self.lang}"


def blocks(text: str) -> list[Block]:
    """Code blocks of a Markdown text: fenced ones by their language, indented ones (four spaces
    after a blank line, outside a fence and a list) as shell."""
    out, lines, i = [], text.splitlines(), 0
    prev_blank = True
    while i < len(lines):
        line = lines[i]
        m = re.match(r"^(\s*)(```+|~~~+)\s*([\w+-]*)", line)
        if m:
            fence, lang, start = m.group(2), m.group(3).lower(), i + 1
            i += 1
            while i < len(lines) and not lines[i].lstrip().startswith(fence):
                i += 1
            body = "\n".join(lines[start:i])
            if lang == "python":
                out.append(Block(start + 1, "python", body))
            elif lang in SHELL_LANGS:
                out.append(Block(start + 1, "shell", body))
            i += 1
            prev_blank = False
            continue
        if prev_blank and line.startswith("    ") and line.strip():
            start = i
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                i += 1
            body = "\n".join(l[4:] for l in lines[start:i]).strip("\n")
            out.append(Block(start + 1, "shell", body))
            prev_blank = True
            continue
        prev_blank = not line.strip()
        i += 1
    return out


def shell_lines(code: str) -> list[str]:
    """Logical lines of a shell block: continuations joined, blank and comment-only lines dropped."""
    out, cur = [], ""
    for raw in code.splitlines():
        if raw.rstrip().endswith("\\"):
            cur += raw.rstrip()[:-1] + " "
            continue
        cur += raw
        if cur.strip() and not cur.lstrip().startswith("#"):
            out.append(cur.strip())
        cur = ""
    return out


def runnable(line: str) -> tuple[str | None, str]:
    """(the part of a shell line the test runs, or None; why not, when None)."""
    m = NEEDS.search(line)
    if m:
        return None, f"needs {m.group(1)}"
    parts = [p.strip() for p in re.split(r"\s&&\s", line)]
    keep = [p for p in parts if not p.startswith("pip install")]
    if any(p.startswith(TEST_RUNS) for p in keep):
        return None, "a test-suite run"
    if not keep:
        return None, "an install step"
    return " && ".join(keep), ""


README_TEXT = README.read_text(encoding="utf-8")
BLOCKS = blocks(README_TEXT)


# ---------------------------------------------------------------------------------- quick checks


def test_readme_has_its_code_blocks():
    """The parser sees the Set up commands, Python blocks and CLI lines (a README reshaped into
    something this file cannot parse would otherwise test nothing)."""
    shell = [l for b in BLOCKS if b.lang == "shell" for l in shell_lines(b.code)]
    assert any(l.startswith("pip install torch==2.13.0") and l.endswith("python -m pytest -q")
               for l in shell), "the Set up test command is gone"
    assert sum(b.lang == "python" for b in BLOCKS) >= 2
    assert any(runnable(l)[0] and runnable(l)[0].startswith("prefixscore serve") for l in shell)
    assert len([l for l in shell if runnable(l)[0]]) >= 5


def tracked() -> set[str]:
    out = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, timeout=60)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return {p for p in out.stdout.decode().split("\0") if p}


def test_readme_paths_are_in_a_clone():
    """Every repository path the README's code names and every relative link it has is a tracked
    file (or a folder of them), and nothing points outside the repository (../shared/...)."""
    files = tracked()
    folders = {str(Path(f).parent) for f in files} | {str(p) for f in files for p in Path(f).parents}
    tops = {Path(f).parts[0] for f in files if len(Path(f).parts) > 1}
    bad = []
    for b in BLOCKS:
        for tok in re.findall(r"[\w./-]+", b.code):
            tok = tok.rstrip(".")
            if tok.startswith("../"):
                bad.append(f"{b.id}: {tok}")
            elif "/" in tok and tok.split("/")[0] in tops and "://" not in tok:
                if tok.rstrip("/") not in files and tok.rstrip("/") not in folders:
                    bad.append(f"{b.id}: {tok}")
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README_TEXT):
        if "://" in target:
            continue
        if target.startswith("../") or (target.rstrip("/") not in files and target.rstrip("/") not in folders):
            bad.append(f"link: {target}")
    assert not bad, bad


DOCS = ["README.md", "BENCHMARKS.md", "bench/README.md", *sorted(
    str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {slug(m) for m in re.findall(r"^#+\s+(.+)$", text, flags=re.M)}


@pytest.mark.parametrize("doc", DOCS)
def test_document_links_resolve(doc):
    """Every relative link of the project's documents names a tracked file (a cited result in
    bench/results included) and, with #anchor, one of its headings; none leaves the repository."""
    files = tracked()
    src = REPO / doc
    text = re.sub(r"```.*?```", "", src.read_text(encoding="utf-8"), flags=re.S)
    bad = ["../shared"] if "../shared" in text else []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if "://" in target or target.startswith("mailto:"):
            continue
        file, _, anchor = target.partition("#")
        dest = (src.parent / file).resolve() if file else src
        try:
            rel = str(dest.relative_to(REPO))
        except ValueError:
            bad.append(f"{target}: outside the repository")
            continue
        if file and rel not in files and not any(f.startswith(rel + "/") for f in files):
            bad.append(f"{target}: not a tracked file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no such heading")
    assert not bad, bad


# ---------------------------------------------------------------------------------- the blocks


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A scratch folder laid out as a clone: links to every tracked file outside the package (the
    package itself is the installed one)."""
    root = tmp_path_factory.mktemp("clone")
    for rel in tracked():
        if rel.startswith("prefixscore/"):
            continue
        src = REPO / rel
        if not src.exists():
            continue
        dst = root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.symlink_to(src)
    return root


def env() -> dict:
    e = dict(os.environ)
    e["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), e.get("PATH", "")])
    e["PY"] = sys.executable
    e.pop("PYTHONPATH", None)
    return e


# `prefixscore` is the entry point installed beside this interpreter; without one, the module.
PREAMBLE = ('set -o pipefail\n'
            'command -v prefixscore >/dev/null 2>&1 || prefixscore() { "$PY" -m prefixscore.cli "$@"; }\n')


def sh(cmd: str, cwd: Path, timeout=TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", PREAMBLE + cmd], cwd=cwd, env=env(), capture_output=True,
                          text=True, timeout=timeout)


def outputs(cmd: str) -> list[str]:
    """Files a command says it writes (-o FILE, --output FILE, --predictions FILE)."""
    try:
        toks = shlex.split(cmd, comments=True)
    except ValueError:
        return []
    return [toks[i + 1] for i, t in enumerate(toks[:-1]) if t in ("-o", "--output", "--predictions")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, port: int, timeout=TIMEOUT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}: {proc.stderr.read()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise AssertionError("the server was not ready in time")


def curl(cmd: str, cwd: Path) -> tuple[int, str, str]:
    """A README curl line: (exit status, body, error). With curl installed it runs as written, plus
    --fail-with-body (curl -s exits 0 on a 500); without, its URL, -H and -d go through urllib."""
    if shutil.which("curl"):
        p = sh(cmd.replace("curl ", "curl --fail-with-body ", 1), cwd)
        return p.returncode, p.stdout, p.stderr
    toks, url, headers, data, i = shlex.split(cmd, comments=True)[1:], None, {}, None, 0
    while i < len(toks):
        t = toks[i]
        if t in ("-H", "--header"):
            k, _, v = toks[i + 1].partition(":")
            headers[k.strip()] = v.strip()
            i += 2
        elif t in ("-d", "--data", "--data-raw"):
            data = toks[i + 1].encode()
            i += 2
        elif t.startswith("-"):
            i += 1
        else:
            url = t if "://" in t else "http://" + t
            i += 1
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=60) as r:
            return 0, r.read().decode(), ""
    except OSError as e:
        return 22, "", str(e)


def server_argv(cmd: str, port: int) -> list[str]:
    """The `prefixscore serve` line as an argv on a free port: the entry point beside this
    interpreter, else the module."""
    argv = shlex.split(cmd, comments=True)
    exe = shutil.which("prefixscore", path=env()["PATH"])
    head = [exe] if exe else [sys.executable, "-m", "prefixscore.cli"]
    return head + argv[1:] + ["--port", str(port)]


def run_shell(block: Block, clone: Path):
    todo = [(l, *runnable(l)) for l in shell_lines(block.code)]
    if not any(cmd for _, cmd, _ in todo):
        pytest.skip("; ".join(sorted({why for _, _, why in todo})))
    server, port = None, None
    try:
        for line, cmd, why in todo:
            if cmd is None:
                continue
            if cmd.startswith("prefixscore serve"):
                port = free_port()
                server = subprocess.Popen(server_argv(cmd, port), cwd=clone, env=env(),
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                          start_new_session=True)
                wait_ready(server, port)
                continue
            if cmd.startswith("curl "):
                assert server is not None, f"{block.id}: {line!r} needs a server the block does not start"
                rc, out, err = curl(cmd.replace(":8000", f":{port}"), clone)
                assert rc == 0, f"{block.id}: {line}\n{out[-2000:]}\n{err[-2000:]}"
                json.loads(out)  # an answer, not an error page
                continue
            p = sh(cmd, clone)
            assert p.returncode == 0, f"{block.id}: {line}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
            written = outputs(cmd)
            for f in written:
                assert (clone / f).stat().st_size > 0, f"{block.id}: {line} wrote no {f}"
            if not written:
                assert p.stdout.strip(), f"{block.id}: {line} printed nothing"
    finally:
        if server is not None and server.poll() is None:
            server.send_signal(signal.SIGTERM)  # the documented stop: SIGTERM to the launcher
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
                raise AssertionError("the server did not stop within 60 s of SIGTERM")
            assert server.returncode == 0, f"the server exited {server.returncode} on SIGTERM"


def run_python(block: Block, clone: Path, tmp_path: Path):
    first = next((l for l in block.code.splitlines() if l.strip()), "")
    m = NEEDS.search(first)
    if m:
        pytest.skip(f"needs {m.group(1)}")
    script = tmp_path / f"readme_{block.line}.py"
    script.write_text(block.code, encoding="utf-8")
    p = subprocess.run([sys.executable, str(script)], cwd=clone, env=env(), capture_output=True,
                       text=True, timeout=TIMEOUT_S)
    assert p.returncode == 0, f"{block.id}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_readme_block_runs(block: Block, clone: Path, tmp_path: Path):
    if block.lang == "python":
        run_python(block, clone, tmp_path)
    else:
        run_shell(block, clone)
