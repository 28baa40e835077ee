"""The documents' own rules: BENCHMARKS.md is the machines, one current table per workload (each
figure linked to its raw JSON under bench/results/) and each workload's method, in at most 300
lines; docs/DESIGN.md is the design as it is, in at most 250 lines. The story of an experiment
lives in its commit message, not in these files."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "BENCHMARKS.md"
DESIGN = REPO / "docs" / "DESIGN.md"

MAX_LINES = {BENCHMARKS: 300, DESIGN: 250}
RESULT_LINK = re.compile(r"\]\((bench/results/[^)\s#]+)(?:#[^)\s]*)?\)")


def lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def sections(path: Path) -> list[tuple[str, str]]:
    """(heading, body) of each level-2 section, code fences removed."""
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    parts = re.split(r"^## +(.+)$", text, flags=re.M)
    return list(zip(parts[1::2], parts[2::2]))


def test_docs_line_limits():
    too_long = {str(p.relative_to(REPO)): len(lines(p)) for p, n in MAX_LINES.items() if len(lines(p)) > n}
    assert not too_long, f"over the limit ({ {str(p.relative_to(REPO)): n for p, n in MAX_LINES.items()} }): {too_long}"


def test_docs_benchmarks_result_links_resolve():
    """Every link to bench/results/ names a file that exists (a figure's raw JSON, or a plot)."""
    targets = RESULT_LINK.findall(BENCHMARKS.read_text(encoding="utf-8"))
    assert targets, "BENCHMARKS.md links no raw results"
    missing = sorted({t for t in targets if not (REPO / t).is_file()})
    assert not missing, missing
    assert any(t.endswith(".json") for t in targets)


def test_docs_benchmarks_tables_cite_raw_json():
    """A section with a table of figures links the raw JSON they come from."""
    bare = [h for h, body in sections(BENCHMARKS)
            if re.search(r"^\|.*\|\s*$", body, flags=re.M)
            and not any(t.endswith(".json") for t in RESULT_LINK.findall(body))]
    assert not bare, f"sections with a table and no link to bench/results/*.json: {bare}"


def test_docs_design_sections_cited_exist():
    """The sections the code and tests cite ("DESIGN.md §N") are numbered headings of DESIGN.md."""
    headings = set(re.findall(r"^#+\s+(\d+)\.\s", DESIGN.read_text(encoding="utf-8"), flags=re.M))
    cited = set()
    for path in [*REPO.glob("prefixscore/**/*.py"), *REPO.glob("tests/**/*.py"), *REPO.glob("bench/**/*.py")]:
        for ref in re.findall(r"DESIGN\.md\s+((?:§\d+(?:\.\d+)?(?:[-,]\s*§?\d+)*\s*)+)", path.read_text(encoding="utf-8")):
            cited |= set(re.findall(r"(\d+)(?:\.\d+)?", ref))
    assert cited and cited <= headings, f"cited sections without a heading: {sorted(cited - headings)}"
