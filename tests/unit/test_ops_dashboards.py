"""The Grafana dashboard and the Prometheus alert rules in deploy/ query real metrics.

Every ``koda_*`` name in a panel's or a rule's query must be one that koda/metrics.py
exposes (a counter's ``_total``, a histogram's ``_bucket``/``_sum``/``_count``), so a
renamed or never-created metric cannot leave an empty panel or a rule that never fires.
The alert rules themselves are run by promtool in tests/unit/test_alert_rules.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.metrics import MetricWrapperBase

from koda_runtime import metrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "koda.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
METRIC = re.compile(r"\bkoda_[a-z0-9_]+\b")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exposed_names() -> set[str]:
    """Every sample name the koda_* families of koda/metrics.py put on /metrics."""
    names: set[str] = set()
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            for family in value.describe():
                names.update(family.name + s for s in SUFFIXES[family.type])
    return {n for n in names if n.startswith("koda_")}


def panel_queries(panels: list[dict[str, Any]]) -> list[tuple[str, str]]:
    found = []
    for panel in panels:
        found += [(panel["title"], t["expr"]) for t in panel.get("targets", [])]
        found += panel_queries(panel.get("panels", []))
    return found


def test_the_metric_families_are_read_from_koda_metrics() -> None:
    names = exposed_names()
    assert {"koda_runs_total", "koda_queue_age_seconds_bucket", "koda_workers"} <= names
    assert "koda_runs" not in names  # a counter is only exposed with _total


def test_every_dashboard_query_uses_a_declared_metric() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = panel_queries(dashboard["panels"])
    assert len(queries) >= 30
    names = exposed_names()
    unknown = [(t, m) for t, e in queries for m in METRIC.findall(e) if m not in names]
    assert not unknown, f"panels query metrics koda/metrics.py does not declare: {unknown}"
    assert all(METRIC.search(e) for _, e in queries), "a panel queries no koda_* metric"


def test_dashboard_panels_have_unique_ids_and_the_datasource_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource"]
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


def test_every_alert_rule_uses_a_declared_metric() -> None:
    rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    names = exposed_names()
    for rule in rules:
        used = set(METRIC.findall(rule["expr"]))
        assert used, rule["alert"]
        assert used <= names, (rule["alert"], used - names)


def test_the_compose_prometheus_loads_the_alert_rules() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    mounts = compose["services"]["prometheus"]["volumes"]
    assert config["rule_files"] == ["/etc/prometheus/alerts.yml"]
    assert "./prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro" in mounts
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    # The gateway's and workers' jobs are named as the local Prometheus names them.
    assert jobs == {
        "koda-gateway",
        "koda-worker",
        "koda-scheduler",
        "koda-compactor",
        "koda-webhooks",
    }


def test_the_slow_run_panel_shows_exemplars_linked_to_their_trace() -> None:
    """Exemplars on the run-duration buckets, and the trace_id label (the name
    koda/metrics.py gives it) opens the Jaeger datasource the provisioning declares."""
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    dashboard = json.loads(DASHBOARD.read_text())
    (panel,) = [p for p in dashboard["panels"] if p["title"].startswith("Slow runs")]
    traced = [t for t in panel["targets"] if t.get("exemplar")]
    assert traced and all("koda_run_duration_seconds_bucket" in t["expr"] for t in traced)
    links = {
        o["matcher"]["options"]: prop["value"]
        for o in panel["fieldConfig"]["overrides"]
        if o["matcher"]["id"] == "byName"
        for prop in o["properties"]
        if prop["id"] == "links"
    }
    (link,) = links["trace_id"]
    assert link["internal"]["datasourceUid"] == "jaeger"
    assert link["internal"]["query"]["query"] == "${__value.raw}"
    context = SpanContext(1, 2, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    with trace.use_span(NonRecordingSpan(context), end_on_exit=False):
        exemplar = metrics.trace_exemplar()
    assert exemplar is not None and "trace_id" in exemplar
    provisioned = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "datasources" / "koda.yaml").read_text()
    )
    by_uid = {d["uid"]: d for d in provisioned["datasources"]}
    assert by_uid["jaeger"]["type"] == "jaeger"
    (destination,) = by_uid["prometheus"]["jsonData"]["exemplarTraceIdDestinations"]
    assert destination == {"name": "trace_id", "datasourceUid": "jaeger"}
