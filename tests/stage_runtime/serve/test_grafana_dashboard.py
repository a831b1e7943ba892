"""The Grafana dashboard shipped with the monitoring component (manifests/components/servicemonitor/) refers only
to metrics the stage and the operator really export: every PromQL expression (panel targets and template
variables) is parsed for its metric names, and each is checked against the live exposition of the shared stage
(``conftest.py``: its ``/metrics``) and of the operator's registry (what its ``--metrics-port`` serves). Every
panel has a title, a unit and at least one target. (Here, beside the running stage the suite already has.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "manifests" / "components" / "servicemonitor" / "grafana-dashboard.json"
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or", "unless"}
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("_sum", "_count", "_created")}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers that are not functions, keywords, labels (inside
    `{...}` and `by/without/on/ignoring (...)`), strings, durations or numbers."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)                         # strings
    text = re.sub(r"\{[^}]*\}", "", text)                                  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)                                 # range and subquery selectors
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    text = re.sub(r"\blabel_values\s*\(([^,()]*),[^)]*\)", r"(\1)", text)  # its second argument is a label
    names = set()
    text = re.sub(r"(?<![A-Za-z_:])\d[\w.]*", "", text)                    # numbers and durations (5m, 1e3)
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        name, rest = match.group(0), text[match.end():].lstrip()
        if rest.startswith("(") or name in KEYWORDS or name in ("inf", "nan"):
            continue
        names.add(name)
    return names


def exported(exposition: str) -> set[str]:
    """Every name a query may use: families (a family without samples yet still has its HELP/TYPE lines), their
    samples, and the suffixed series of counters and histograms."""
    out = set()
    for family in text_string_to_metric_families(exposition):
        out.add(family.name)
        out.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ()))
        out.update(sample.name for sample in family.samples)
    return out


def expressions(dashboard: dict) -> list[tuple[str, str]]:
    found = [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", ())]
    for var in dashboard.get("templating", {}).get("list", ()):
        if var.get("type") == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            found.append((f"variable {var['name']}", query))
    return found


def test_the_parser_finds_metric_names_and_nothing_else():
    expr = ('histogram_quantile(0.95, sum by (le, outcome) (rate(diffstage_request_e2e_seconds_bucket'
            '{namespace=~"$namespace", outcome="completed"}[5m]))) / on (stage) group_left '
            'sum without (pod) (up offset 5m) > bool 0')
    assert metric_names(expr) == {"diffstage_request_e2e_seconds_bucket", "up"}
    assert metric_names('label_values(diffstage_requests_waiting{namespace=~"$ns"}, stage)') == {
        "diffstage_requests_waiting"}


def test_every_panel_has_a_title_a_unit_and_a_target():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["panels"], "an empty dashboard"
    for panel in dashboard["panels"]:
        assert panel.get("title"), panel
        assert panel.get("fieldConfig", {}).get("defaults", {}).get("unit"), f"no unit: {panel['title']}"
        assert [t for t in panel.get("targets", ()) if t.get("expr")], f"no target: {panel['title']}"
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


@pytest.fixture
def operator_exposition() -> str:
    """The operator's registry as its /metrics serves it (its metric families register on import)."""
    import stage_operator.controller  # noqa: F401 (registers every operator family)
    return generate_latest(REGISTRY).decode()


def test_every_metric_the_dashboard_reads_is_exported_by_the_stage_or_the_operator(stage, operator_exposition):
    with httpx.Client(base_url=stage.http_url, timeout=30) as http:
        stage_names = exported(http.get("/metrics").text)
    operator_names = exported(operator_exposition)
    used = {name: where for where, expr in expressions(json.loads(DASHBOARD.read_text())) for name in metric_names(expr)}
    missing = {name: where for name, where in used.items() if name not in stage_names | operator_names}
    assert not missing, f"metrics the dashboard reads that nothing exports: {missing}"
    assert used.keys() & stage_names and used.keys() & operator_names, "both the stage's and the operator's"
    for needed in ("diffstage_requests_waiting", "diffstage_cost_outstanding_pixel_steps",
                   "diffstage_denoise_step_seconds_bucket", "diffstage_request_e2e_seconds_bucket",
                   "diffstage_lora_adapters_resident", "diffstage_video_jobs", "diffstage_operator_stage_replicas",
                   "diffstage_operator_stage_rollout_info", "diffstage_operator_restarts_total"):
        assert needed in used, f"the dashboard shows no {needed}"
