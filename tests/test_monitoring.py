"""The monitoring profile's alert rules and the scrape config rendered for a
stack given by URLs (e2e/test_dashboards.py runs them on a real Prometheus)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from pdstack import prometheus

RULE_TESTS = prometheus.ALERTS.parent / "alerts_test.yml"


def test_alert_rules_are_valid_and_their_unit_tests_pass() -> None:
    checked = prometheus.promtool("check", "rules", str(prometheus.ALERTS))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 6 rules found" in checked.stdout
    tested = prometheus.promtool("test", "rules", str(RULE_TESTS))
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_rule_tests_fail_when_a_rule_watches_a_misspelt_metric(tmp_path: Path) -> None:
    """Negative control: the unit tests see what a rule really evaluates."""
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    broken = prometheus.ALERTS.read_text().replace(
        "vllm:mooncake_kv_checksum_mismatch_total", "vllm:mooncake_kv_checksum_mismatch"
    )
    (tmp_path / prometheus.ALERTS.name).write_text(broken)
    tested = prometheus.promtool("test", "rules", str(tmp_path / RULE_TESTS.name))
    assert tested.returncode != 0
    assert "PDMooncakeKVChecksumMismatch" in tested.stdout + tested.stderr


def test_scrape_config_points_each_job_at_the_given_stack() -> None:
    stack = {"prefill": "127.0.0.1:1", "decode": "127.0.0.1:2", "router": "127.0.0.1:3"}
    config = prometheus.scrape_config(stack, "1s")
    jobs = {j["job_name"]: j["static_configs"] for j in config["scrape_configs"]}
    tcp = {"transport": "tcp"}
    assert jobs == {
        job: [{"targets": [at], "labels": tcp}] for job, at in stack.items()
    }
    assert config["rule_files"] == [str(prometheus.ALERTS)]
    assert config["global"]["scrape_interval"] == "1s"


def test_every_dashboard_panel_has_a_query() -> None:
    queries = prometheus.panel_queries(json.loads(prometheus.DASHBOARD.read_text()))
    assert len(queries) >= 15
    assert all("$__rate_interval" not in q for _, q in queries)
