"""deploy/prometheus/alerts.yml passes `promtool check rules` and its own unit tests
(`promtool test rules alerts.test.yml`), and those tests see every rule both fire and
stay quiet. promtool comes with Debian's prometheus package, which `make install`
installs (deploy/local/system-deps.sh): without it these tests fail, never skip."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import yaml

RULES_DIR = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("promtool")
    assert exe, "promtool not found: run `make install` (Debian's prometheus package)"
    return subprocess.run(  # noqa: S603 - a fixed program and our own files
        [exe, *args], cwd=RULES_DIR, capture_output=True, text=True, timeout=60
    )


def rule_names() -> list[str]:
    groups = yaml.safe_load((RULES_DIR / "alerts.yml").read_text())["groups"]
    return [rule["alert"] for group in groups for rule in group["rules"]]


def test_the_rules_pass_promtool_check() -> None:
    done = promtool("check", "rules", "alerts.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rule_names())} rules found" in done.stdout


def test_the_rules_pass_their_promtool_unit_tests() -> None:
    done = promtool("test", "rules", "alerts.test.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_every_rule_is_tested_firing_and_quiet() -> None:
    tests = yaml.safe_load((RULES_DIR / "alerts.test.yml").read_text())["tests"]
    cases = [case for test in tests for case in test["alert_rule_test"]]
    names = set(rule_names())
    assert names == {"KodaWorkerStale", "KodaWorkersMissing", "KodaConsumerLagGrowing",
                     "KodaDeadLetters", "KodaRunFailureRatio", "KodaQueueAgeHigh",
                     "KodaPartitionQueueStuck",
                     "KodaBudgetExhausted", "KodaRecordsSkipped",
                     "KodaModelErrorRate", "KodaModelCostHigh",
                     "KodaDeadLetterWritten", "KodaScheduleMinutesMissed",
                     "KodaAdmissionsThrottled", "KodaChunkUpkeepLate"}  # fmt: skip
    fired = {c["alertname"] for c in cases if c["exp_alerts"]}
    quiet = {c["alertname"] for c in cases if not c["exp_alerts"]}
    assert names - fired == set(), "rules never tested firing"
    assert names - quiet == set(), "rules never tested staying quiet"
    assert {c["alertname"] for c in cases} <= names


def test_promtool_catches_a_rule_that_does_not_parse(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yml"
    broken.write_text("groups:\n  - name: x\n    rules:\n      - alert: X\n        expr: rate(\n")
    done = promtool("check", "rules", str(broken))
    assert done.returncode != 0


def test_every_dashboard_query_is_valid_promql(tmp_path: Path) -> None:
    """promtool parses each panel's query, written as a recording rule (Grafana's
    ``$__rate_interval`` stands in as 5m)."""
    dashboard = json.loads((RULES_DIR.parent / "grafana" / "koda.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    rules = [
        {"record": f"dashboard:query_{i}", "expr": e.replace("$__rate_interval", "5m")}
        for i, e in enumerate(exprs)
    ]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = promtool("check", "rules", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in done.stdout


def test_the_admission_rule_names_the_route_the_gateway_counts() -> None:
    """KodaAdmissionsThrottled matches ``route="/v1/runs"``, the route template the
    gateway's middleware puts on koda_http_requests_total: a renamed route would leave
    the rule silent."""
    from koda_runtime.gateway.app import create_app
    from koda_runtime.naming import AppEnv
    from koda_runtime.settings import Settings

    groups = yaml.safe_load((RULES_DIR / "alerts.yml").read_text())["groups"]
    (rule,) = [r for g in groups for r in g["rules"] if r["alert"] == "KodaAdmissionsThrottled"]
    assert 'method="POST",route="/v1/runs"' in rule["expr"]
    paths = create_app(Settings(app_env=AppEnv.DEV)).openapi()["paths"]
    assert "post" in paths["/v1/runs"]
