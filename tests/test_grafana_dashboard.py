"""docs/grafana/orchestrator-jobs.json charts exactly the series the node agents export
(orchestrator/node/metric_series.py), by the names and labels Prometheus scrapes them under."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from orchestrator.node import metric_series

DASHBOARD = Path(__file__).parent.parent / "docs" / "grafana" / "orchestrator-jobs.json"
PREFIX = "ray_"  # Ray's metrics agent prefixes every series it exports
# A metric name right before its label matchers: `ray_orchestrator_job_cpu_cores{...}`.
_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}")
_MATCHER = re.compile(r"(\$?[a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
# Any name that looks like one of ours, with or without matchers (`ray_x / ray_y` too).
_NAME = re.compile(r"\b(?:ray_)?orchestrator_[a-zA-Z0-9_]*")
# A variable's `label_values(METRIC{...}, LABEL)`: the label it lists.
_LABEL_VALUES = re.compile(r"label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)[^,]*,\s*(\$?\w+)\s*\)")


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def _variables(dashboard: dict) -> dict[str, dict]:
    return {v["name"]: v for v in dashboard["templating"]["list"]}


def test_every_exported_series_has_a_panel(dashboard):
    exprs = "\n".join(_exprs(dashboard))
    charted = {name for name, _ in _SELECTOR.findall(exprs)}
    missing = [s.name for s in metric_series.ALL if PREFIX + s.name not in charted]
    assert missing == []


def test_every_metric_and_label_the_dashboard_asks_for_is_exported(dashboard):
    exported = {PREFIX + s.name: s for s in metric_series.ALL}
    queries = _exprs(dashboard) + [
        v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"
    ]
    assert queries
    for query in queries:
        names = set(_NAME.findall(query))
        assert names, f"no metric in {query!r}"
        unknown = names - set(exported)
        assert not unknown, f"{query!r} asks for {unknown}, which we do not export"
        asked = [(name, label) for name, matchers in _SELECTOR.findall(query)
                 for label in _MATCHER.findall(matchers)]  # fmt: skip
        if values := _LABEL_VALUES.search(query):
            asked.append((values[1], values[2]))
        for name, label in asked:
            assert label in exported[name].tag_keys, f"{name} has no label {label!r}"
            # Prometheus keeps `job` for its scrape config's name: a tag of ours by that name
            # would be renamed `exported_job` and these queries would find nothing.
            assert label != "job"


def test_panels_are_filtered_by_the_template_variables(dashboard):
    variables = _variables(dashboard)
    assert {"datasource", "project", "job", "rank"} <= set(variables)
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("project", "job", "rank"):
        assert PREFIX + metric_series.CPU_CORES.name in variables[name]["query"]
    for panel in dashboard["panels"]:
        assert panel["type"] == "timeseries"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            for variable in ("$project", "$job", "$rank"):
                assert variable in target["expr"], f"{panel['title']}: {variable} not applied"
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


TEAMS = DASHBOARD.parent / "orchestrator-teams.json"


def test_the_teams_dashboard_charts_every_team_counter_by_team():
    """docs/grafana/orchestrator-teams.json: each of the queue service's per-team counters
    (scheduler/team_meters.py) in a panel, by labels they carry, filtered by `$team`. Ray
    exports a Counter as `<name>_total` (and, for its own old dashboards, as a gauge without
    the suffix, which RAY_EXPORT_COUNTER_AS_GAUGE=0 turns off): the panels read the counter."""
    teams = json.loads(TEAMS.read_text())
    exported = {PREFIX + s.name + "_total": s for s in metric_series.TEAM_COUNTERS}
    exprs = _exprs(teams)
    charted = {name for name, _ in _SELECTOR.findall("\n".join(exprs))}
    assert charted == set(exported)
    for expr in exprs:
        assert 'team=~"$team"' in expr
        for name, matchers in _SELECTOR.findall(expr):
            assert set(_MATCHER.findall(matchers)) <= set(exported[name].tag_keys)
        for group in re.findall(r"by \(([^)]*)\)", expr):
            for label in (g.strip() for g in group.split(",")):
                assert any(label in s.tag_keys for s in exported.values()), label
    variables = _variables(teams)
    cpu = PREFIX + metric_series.TEAM_CPU_SECONDS.name + "_total"
    assert variables["team"]["query"] == f"label_values({cpu}, team)"
    assert len({p["id"] for p in teams["panels"]}) == len(teams["panels"])
