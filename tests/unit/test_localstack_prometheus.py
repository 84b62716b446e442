"""The generated Prometheus config passes `promtool check config` (rules included)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from koda_runtime.localstack import prometheus


def test_the_generated_config_and_its_rules_pass_promtool(tmp_path: Path) -> None:
    exe = shutil.which("promtool")
    assert exe, "promtool not found: run `make install` (Debian's prometheus package)"
    config = tmp_path / "prometheus.yml"
    config.write_text(prometheus.render_config(tmp_path / "targets", prometheus.alerts_file()))
    done = subprocess.run(  # noqa: S603 - a fixed program and our own file
        [exe, "check", "config", str(config)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 15 rules found" in done.stdout


def test_target_files_carry_each_job() -> None:
    groups = prometheus.target_groups(["127.0.0.1:8080"], ["127.0.0.1:9101", "127.0.0.1:9102"])
    assert groups == [
        {"targets": ["127.0.0.1:8080"], "labels": {"koda_job": "koda-gateway"}},
        {"targets": ["127.0.0.1:9101", "127.0.0.1:9102"], "labels": {"koda_job": "koda-worker"}},
    ]
