"""The README's and docs/*.md's commands and code, run as a reader runs them: parsed out of
README.md and every docs/*.md but docs/DESIGN.md (whose snippets illustrate a design and are not
run), so the documents as edited are what is tested, from a clone's paths, on CPU. A block's test
id names its file and line (`README.md:19-shell`, `docs/api.md:8-python`).

Which blocks are code: fenced ```bash / ```sh / ```shell blocks and indented blocks (the Set up
commands) are shell, one logical line at a time (a trailing backslash continues a line); fenced
```python blocks run whole in a fresh interpreter (sys.executable); other fences (```text, ```yaml)
are not code. What is not run, by a rule the README states where a reader sees it:
  - install steps: the `pip install ...` parts of a `&&` chain (the rest of the chain runs);
  - test-suite runs: `python -m pytest ...`, `bash tests/gpu.sh` (this test is part of the suite);
  - a line, or a Python block whose first line, carries `# needs: GPU` / `# needs: network` (...);
    a shell block that opens with such a comment line is skipped whole.
A line that runs must show what it did: print something, or write the file it names (-o,
--output, --predictions, or a `> FILE` redirection), which must not be empty.
A shell line that starts `prefixscore serve` starts the server: it runs on a free port (the
block's `:8000`, or the port of the line's --port, becomes that port; a --grpc-port is moved to a
free one too), the block's next lines run once /healthz answers 200, and the server is stopped
with SIGTERM before the block's next `prefixscore serve` line and after its last line.

Every command runs in a scratch folder holding links to the repository's tracked files (git
ls-files) outside the package, one folder per document (its blocks run in order, so a block may
use what an earlier one of the same document wrote), so a path a document names must be in a
clone, and outputs such as out.jsonl land in the scratch folder, not in the checkout.
`prefixscore` is this interpreter's entry point, else `python -m prefixscore.cli`.

The README's layout section lists every module of the package (test_readme_layout_lists_every_module)."""
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
# The documents whose examples run: the README and the reference pages; not DESIGN.md (design prose).
DOC_FILES = ["README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")
                                  if p.name != "DESIGN.md")]
SHELL_LANGS = {"bash", "sh", "shell", "console"}
NEEDS = re.compile(r"#\s*needs:\s*(.+?)\s*$", re.IGNORECASE)
TEST_RUNS = ("python -m pytest", "python3 -m pytest", "pytest ", "bash tests/gpu.sh")
TIMEOUT_S = 900  # one command: the first load of the bundled model converts its GGUF file (~40 s)


@dataclass
class Block:
    line: int  # 1-based line of the document where the block's code starts
    lang: str  # "python" or "shell"
    code: str
    doc: str = "README.md"  # the document, relative to the repository

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}-{self.lang}"


def blocks(text: str, doc: str = "README.md") -> list[Block]:
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
                out.append(Block(start + 1, "python", body, doc))
            elif lang in SHELL_LANGS:
                out.append(Block(start + 1, "shell", body, doc))
            i += 1
            prev_blank = False
            continue
        if prev_blank and line.startswith("    ") and line.strip():
            start = i
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                i += 1
            body = "\n".join(l[4:] for l in lines[start:i]).strip("\n")
            out.append(Block(start + 1, "shell", body, doc))
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


def block_needs(block: Block) -> str | None:
    """What a whole block needs, by its first line: a Python block's first line, or a shell
    block's opening comment line, carrying `# needs: ...`."""
    first = next((l.strip() for l in block.code.splitlines() if l.strip()), "")
    if block.lang == "shell" and not first.startswith("#"):
        return None  # a command's own marker skips that line only
    m = NEEDS.search(first)
    return m.group(1) if m else None


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
# The reference pages' blocks (README.md's are BLOCKS, with their own test and ids).
DOC_BLOCKS = [b for doc in DOC_FILES[1:] for b in blocks((REPO / doc).read_text(encoding="utf-8"), doc)]


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


def test_docs_have_their_code_blocks():
    """The parser sees the reference pages' blocks: every page but DESIGN.md is read, and the
    examples the pages are known for are among the blocks (the DepthControl snippet of api.md)."""
    assert "docs/DESIGN.md" not in DOC_FILES and "docs/api.md" in DOC_FILES
    assert {b.doc for b in DOC_BLOCKS} >= {"docs/api.md", "docs/cli.md", "docs/serving.md",
                                           "docs/finetuning.md", "docs/ray.md", "docs/kernels.md"}
    assert any(b.lang == "python" and "DepthControl(" in b.code for b in DOC_BLOCKS)
    assert any(runnable(l)[0] and runnable(l)[0].startswith("prefixscore serve")
               for b in DOC_BLOCKS if b.lang == "shell" for l in shell_lines(b.code))


def test_readme_paths_are_in_a_clone():
    """Every repository path the README's and docs' code names and every relative link the README
    has is a tracked file (or a folder of them), and nothing points outside the repository
    (../shared/...). The docs' links: test_document_links_resolve."""
    files = tracked()
    folders = {str(Path(f).parent) for f in files} | {str(p) for f in files for p in Path(f).parents}
    tops = {Path(f).parts[0] for f in files if len(Path(f).parts) > 1}
    bad = []
    for b in BLOCKS + DOC_BLOCKS:
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


# ---------------------------------------------------------------------------------- the layout


def layout_entries(text: str) -> dict[str, str]:
    """The README's layout of the package (the fence under `## Layout`, from its `prefixscore/`
    line to the first line outside the package): "" -> the lines of the package's own modules,
    "NAME" -> the entry of the sub-package NAME/ (its `  NAME/` line and the lines indented under it)."""
    m = re.search(r"^## Layout\s*$(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    assert m, "the README has no ## Layout section"
    entries, cur, inside = {"": ""}, "", False
    for line in m.group(1).splitlines():
        if line.startswith("```"):
            if inside:
                break
            continue
        if re.match(r"^prefixscore/", line):
            inside = True
            continue
        if not inside:
            continue
        if line.strip() and not line.startswith(" "):
            break  # tests/, bench/, docs/: outside the package
        sub = re.match(r"^  (\w+)/", line)
        if sub:
            cur = sub.group(1)
        elif re.match(r"^  \S", line):
            cur = ""  # a line of top-level modules
        entries[cur] = entries.get(cur, "") + line + "\n"
    return entries


def package_modules() -> dict[str, set[str]]:
    """The package's module files by sub-package ("" for the top level): every prefixscore/**/*.py
    but __init__.py and the generated gRPC code under proto/."""
    out: dict[str, set[str]] = {}
    root = REPO / "prefixscore"
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if path.name == "__init__.py" or "proto" in rel.parts[:-1] or "__pycache__" in rel.parts:
            continue
        out.setdefault(rel.parts[0] if len(rel.parts) > 1 else "", set()).add(path.name)
    return out


def named(name: str, text: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", text) is not None


def unlisted(entries: dict[str, str], modules: dict[str, set[str]]) -> list[str]:
    """Modules whose file name is not in their package's layout entry."""
    return sorted(f"{pkg}/{name}".lstrip("/") for pkg, names in modules.items() for name in names
                  if not named(name, entries.get(pkg, "")))


def test_readme_layout_lists_every_module():
    """The README's layout names every module of the package in its sub-package's entry (top-level
    modules on the package's own lines), and no file that is not there."""
    entries, modules = layout_entries(README_TEXT), package_modules()
    missing = unlisted(entries, modules)
    assert not missing, f"README.md's layout does not list {missing}"
    stale = sorted(f"{pkg}/{name}".lstrip("/") for pkg, text in entries.items()
                   for name in set(re.findall(r"(?<![\w.])(\w+\.py)(?!\w)", text))
                   if name != "__init__.py" and name not in modules.get(pkg, set()))
    assert not stale, f"README.md's layout lists modules that are not in the package: {stale}"


def test_layout_check_finds_an_unlisted_module():
    """The check above fails for a module the layout leaves out: one of the top level and one of a
    sub-package, each cut from the README's own layout."""
    entries, modules = layout_entries(README_TEXT), package_modules()
    for pkg in ("", sorted(p for p in modules if p)[0]):
        name = sorted(modules[pkg])[0]
        cut = dict(entries)
        cut[pkg] = re.sub(rf"(?<![\w.]){re.escape(name)}(?!\w)", "", cut.get(pkg, ""))
        assert f"{pkg}/{name}".lstrip("/") in unlisted(cut, modules)


# ---------------------------------------------------------------------------------- the blocks


def make_clone(root: Path) -> Path:
    """A scratch folder laid out as a clone: links to every tracked file outside the package (the
    package itself is the installed one)."""
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


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """The README's scratch clone."""
    return make_clone(tmp_path_factory.mktemp("clone"))


@pytest.fixture(scope="module")
def doc_clones(tmp_path_factory):
    """A scratch clone per reference page, made when its first block runs: a page's blocks share
    it (in order), pages do not (two pages may both write out.jsonl)."""
    made: dict[str, Path] = {}

    def get(doc: str) -> Path:
        if doc not in made:
            made[doc] = make_clone(tmp_path_factory.mktemp(re.sub(r"\W", "_", doc)))
        return made[doc]

    return get


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
    """Files a command says it writes (-o FILE, --output FILE, --predictions FILE, > FILE)."""
    try:
        toks = shlex.split(cmd, comments=True)
    except ValueError:
        return []
    out = [toks[i + 1] for i, t in enumerate(toks[:-1])
           if t in ("-o", "--output", "--predictions", ">", ">>")]
    return out + [t.lstrip(">") for t in toks if re.fullmatch(r">>?[^>&].*", t)]


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
    """The `prefixscore serve` line as an argv on a free port (and a free --grpc-port where it
    names one): the entry point beside this interpreter, else the module."""
    argv = shlex.split(cmd, comments=True)
    exe = shutil.which("prefixscore", path=env()["PATH"])
    head = [exe] if exe else [sys.executable, "-m", "prefixscore.cli"]
    grpc = ["--grpc-port", str(free_port())] if any(
        t == "--grpc-port" or t.startswith("--grpc-port=") for t in argv) else []
    return head + argv[1:] + ["--port", str(port)] + grpc


def doc_port(cmd: str) -> str:
    """The port a `prefixscore serve` line serves on as written: its --port, else 8000."""
    toks = shlex.split(cmd, comments=True)
    ports = [t.split("=", 1)[1] if "=" in t else toks[i + 1] for i, t in enumerate(toks)
             if (t == "--port" and i + 1 < len(toks)) or t.startswith("--port=")]
    return ports[-1] if ports else "8000"


def stop(server: subprocess.Popen):
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)  # the documented stop: SIGTERM to the launcher
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
            raise AssertionError("the server did not stop within 60 s of SIGTERM")
        assert server.returncode == 0, f"the server exited {server.returncode} on SIGTERM"


def run_shell(block: Block, clone: Path):
    needs = block_needs(block)
    if needs:
        pytest.skip(f"needs {needs}")
    todo = [(l, *runnable(l)) for l in shell_lines(block.code)]
    if not any(cmd for _, cmd, _ in todo):
        pytest.skip("; ".join(sorted({why for _, _, why in todo})))
    server, port, written_port = None, None, "8000"
    try:
        for line, cmd, why in todo:
            if cmd is None:
                continue
            if cmd.startswith("prefixscore serve"):
                if server is not None:  # the block's next server: the one before stops first
                    old, server = server, None
                    stop(old)
                port, written_port = free_port(), doc_port(cmd)
                server = subprocess.Popen(server_argv(cmd, port), cwd=clone, env=env(),
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                          start_new_session=True)
                wait_ready(server, port)
                continue
            if cmd.startswith("curl "):
                assert server is not None, f"{block.id}: {line!r} needs a server the block does not start"
                rc, out, err = curl(cmd.replace(f":{written_port}", f":{port}"), clone)
                assert rc == 0, f"{block.id}: {line}\n{out[-2000:]}\n{err[-2000:]}"
                json.loads(out)  # an answer, not an error page
                continue
            p = sh(cmd, clone)
            assert p.returncode == 0, f"{block.id}: {line}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
            written = outputs(cmd)
            for f in written:
                out = clone / f
                files = [q for q in out.rglob("*") if q.is_file()] if out.is_dir() else [out]
                assert any(q.stat().st_size > 0 for q in files), f"{block.id}: {line} wrote no {f}"
            if not written:
                assert p.stdout.strip(), f"{block.id}: {line} printed nothing"
    finally:
        if server is not None:
            stop(server)


def run_python(block: Block, clone: Path, tmp_path: Path):
    needs = block_needs(block)
    if needs:
        pytest.skip(f"needs {needs}")
    script = tmp_path / f"{Path(block.doc).stem.lower()}_{block.line}.py"
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


@pytest.mark.slow
@pytest.mark.parametrize("block", DOC_BLOCKS, ids=[b.id for b in DOC_BLOCKS])
def test_docs_block_runs(block: Block, doc_clones, tmp_path: Path):
    """docs/*.md's blocks (but DESIGN.md's), by the README's rules, each page in its own clone."""
    if block.lang == "python":
        run_python(block, doc_clones(block.doc), tmp_path)
    else:
        run_shell(block, doc_clones(block.doc))
