"""Layering: data flows one way. The library and the serving path import neither the command line
nor training code (peft, the fitting loops) nor prefixscore.ray (Ray, an optional extra); the
command modules import the library, never the reverse. Checked two ways: statically over every
module's imports, and by importing the serving modules in a fresh interpreter and looking at what
came in."""
import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "prefixscore"
# The command layer: modules that parse flags or add subcommands (they may import anything).
COMMANDS = {"cli", "cmdline", "score_command", "server", "serve.cli", "train.commands", "train.__main__"}
# prefixscore.finetune: the package's lazy __getattr__ imports training code only when asked for
# (test_serving_path_loads_no_training_or_cli_code checks that importing prefixscore does not).
ALLOWED = {("", "train"), ("", "train.finetune")}
# Packages above the library: only the command layer and themselves import them.
UPPER = ("train", "ray")


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imported(path: Path) -> set[str]:
    """Absolute prefixscore-relative names of every `import` in the file (inside functions too)."""
    me = module_name(path).split(".") if module_name(path) else []
    package = me if path.name == "__init__.py" else me[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
                out.add(name)
                out.update(f"{name}.{a.name}" if name else a.name for a in node.names)
            elif node.module and node.module.startswith("prefixscore"):
                out.add(node.module.removeprefix("prefixscore").lstrip("."))
        elif isinstance(node, ast.Import):
            out.update(a.name.removeprefix("prefixscore").lstrip(".") for a in node.names
                       if a.name.startswith("prefixscore"))
    return out


def test_library_imports_no_command_or_training_module():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        name = module_name(path)
        if name in COMMANDS:
            continue
        for dep in imported(path):
            if (name, dep) in ALLOWED:
                continue
            if dep in COMMANDS or any(dep.split(".")[0] == top and name.split(".")[0] != top
                                      for top in UPPER):
                bad.append(f"{name} imports {dep}")
    assert not bad, bad


def test_import_checker_sees_relative_imports():
    """The checker itself: a relative import of the CLI from a subpackage is found."""
    assert "cli" in imported(PKG / "train" / "__main__.py") or \
        "cmdline" in imported(PKG / "train" / "__main__.py")
    assert "train.heads" in imported(PKG / "train" / "lora.py")


def test_serving_path_loads_no_training_or_cli_code():
    code = ("import sys, prefixscore, prefixscore.classifier, prefixscore.scorer, "
            "prefixscore.serve.frontend, prefixscore.serve.engine_proc, prefixscore.serve.http, "
            "prefixscore.serve.launch\n"
            "print(' '.join(m for m in sys.modules if m.startswith(('prefixscore.train', 'prefixscore.cli', "
            "'prefixscore.cmdline', 'peft', 'prefixscore.ray')) or m == 'ray' or m.startswith('ray.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "", out.stdout
