"""Layering (docs/DESIGN.md §4): data flows one way, and no two modules import each other.

    kernels  <  the engine stack (prefixscore/*.py, weights/)  <  rows/, serve/  <  train/, ray/  <  cli/

A module imports only modules of its own layer or below: the library never imports the command line,
training code (peft, the fitting loops) or Ray (an optional extra); the command line imports the
library, never the reverse. Checked statically over every module's imports (inside functions too),
and by importing the serving modules in a fresh interpreter and looking at what came in."""
import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "prefixscore"
LAYERS = {"kernels": 0, "weights": 1, "rows": 2, "serve": 2, "train": 3, "ray": 3, "cli": 4}
# prefixscore.finetune: the package's lazy __getattr__ imports training code only when asked for
# (test_serving_path_loads_no_training_or_cli_code checks that importing prefixscore does not).
ALLOWED = {("", "train")}
MAX_TOP_LEVEL = 19  # modules at the top of prefixscore/: the public API, the engine stack, its leaves
# A module outside kernels/ (whose Triton kernels sit beside their references): one responsibility
# is what a module is cut by; this bound only catches one that grew two without a split.
MAX_LINES = 600


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def layer(name: str) -> int:
    if name.endswith("__main__"):  # python -m prefixscore.PKG: a command entry point
        return LAYERS["cli"]
    top = name.split(".")[0]
    return LAYERS.get(top, 1)  # the top-level modules (and the package itself) are the engine stack


def imported(path: Path) -> set[str]:
    """Prefixscore-relative names of every `import` in the file (inside functions too), resolved to
    modules that exist: `from .rows import io` names rows.io, `from .errors import X` names errors."""
    me = module_name(path).split(".") if module_name(path) else []
    package = me if path.name == "__init__.py" else me[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == "prefixscore":
                base = node.module.removeprefix("prefixscore").lstrip(".")
            else:
                continue
            names.update(f"{base}.{a.name}".lstrip(".") for a in node.names)
            names.add(base)
        elif isinstance(node, ast.Import):
            names.update(a.name.removeprefix("prefixscore").lstrip(".") for a in node.names
                         if a.name.split(".")[0] == "prefixscore")
    out = set()
    for n in names:  # the longest prefix that is a module of the package
        while n and not (PKG / n.replace(".", "/")).with_suffix(".py").exists() \
                and not (PKG / n.replace(".", "/") / "__init__.py").exists():
            n = n.rpartition(".")[0]
        out.add(n)
    return out


def graph() -> dict[str, set[str]]:
    g = {}
    for path in sorted(PKG.rglob("*.py")):
        name = module_name(path)
        # a module's import of its own package (__init__) runs first anyway: not an edge
        g[name] = {d for d in imported(path) if d != name and not name.startswith(d + ".") and d != ""}
    return g


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in g:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_cycle_checker_finds_a_cycle():
    """The checker itself: a circle through a function-level import is found."""
    g = graph()
    g["rows.io"] = g["rows.io"] | {"rows.writer"}  # writer imports io at the top
    assert ["rows.io", "rows.writer"] in cycles(g)


def test_layers_import_downwards():
    bad = [f"{name} imports {dep}" for name, deps in graph().items() for dep in deps
           if layer(dep) > layer(name) and (name, dep.split(".")[0]) not in ALLOWED]
    assert not bad, bad


def test_import_checker_sees_relative_imports():
    assert "cli.train" in imported(PKG / "train" / "__main__.py")
    assert "train.fit_heads" in imported(PKG / "train" / "lora.py")
    assert "errors" in imported(PKG / "rows" / "parquet.py")


def test_top_level_holds_the_api_and_the_engine_stack():
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, top


def test_modules_are_small():
    big = [f"{p.relative_to(PKG)}: {n}" for p in sorted(PKG.rglob("*.py"))
           if "kernels" not in p.parts and "proto" not in p.parts
           and (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not big, big


def test_serving_path_loads_no_training_or_cli_code():
    code = ("import sys, prefixscore, prefixscore.classifier, prefixscore.scorer, "
            "prefixscore.serve.frontend, prefixscore.serve.engine_proc, prefixscore.serve.http, "
            "prefixscore.serve.launch\n"
            "print(' '.join(m for m in sys.modules if m.startswith(('prefixscore.train', 'prefixscore.cli', "
            "'peft', 'prefixscore.ray')) or m == 'ray' or m.startswith('ray.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "", out.stdout


def test_license_file_matches_the_package_metadata():
    """pyproject.toml's license is the LICENSE file's: the Apache License 2.0, whole."""
    import tomllib

    root = PKG.parent
    license = tomllib.loads((root / "pyproject.toml").read_text())["project"]["license"]
    text = (root / "LICENSE").read_text()
    assert license == "Apache-2.0"
    assert "Apache License" in text[:200] and "Version 2.0, January 2004" in text[:200]
    assert "END OF TERMS AND CONDITIONS" in text
