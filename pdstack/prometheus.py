"""A real Prometheus against a stack given by URLs, with the project's own
monitoring configuration: the `monitoring` profile's scrape config as compose
renders it (its targets pointed at the stack) and its alert rules; queries
through Prometheus' HTTP API. Debian's `prometheus` package (make install).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import requests
import yaml

from pdstack import compose, supervisor, wait

MONITORING = compose.ROOT / "docker" / "monitoring"
ALERTS = MONITORING / "prometheus" / "alerts.yml"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "pd-mooncake.json"
# The container path compose mounts the rules at (docker/compose.stack.yaml).
CONTAINER_ALERTS = "/etc/prometheus/alerts.yml"
READY_DEADLINE_S = 60.0
STOP_DEADLINE_S = 10.0


class PrometheusError(RuntimeError):
    pass


def binary(name: str = "prometheus") -> Path:
    path = shutil.which(name)
    if path is None:
        raise PrometheusError(
            f"no {name} on PATH: `make install` installs Debian's prometheus package"
        )
    return Path(path)


def host_port(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port}"


def scrape_config(
    targets: Mapping[str, str], scrape_interval: str | None = None
) -> dict[str, Any]:
    """The monitoring profile's Prometheus config with each job scraping
    ``targets[job]`` (host:port) instead of its compose service (the rdma
    trio's host-network targets are dropped: they would be the same servers),
    and the alert rules read from this checkout."""
    content = compose.model(["monitoring"])["configs"]["prometheus"]["content"]
    config = yaml.safe_load(content)
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    if set(jobs) != set(targets):
        raise PrometheusError(
            f"targets for {sorted(targets)}, the scrape config has {sorted(jobs)}"
        )
    for name, job in jobs.items():
        labels = [
            static.get("labels", {})
            for static in job["static_configs"]
            if static.get("labels", {}).get("transport") == "tcp"
        ]
        job["static_configs"] = [{"targets": [targets[name]], "labels": labels[0]}]
    if config.get("rule_files") != [CONTAINER_ALERTS]:
        raise PrometheusError(f"unexpected rule_files {config.get('rule_files')}")
    config["rule_files"] = [str(ALERTS)]
    if scrape_interval is not None:
        config["global"]["scrape_interval"] = scrape_interval
        config["global"]["evaluation_interval"] = scrape_interval
    return config


@dataclass
class Prometheus:
    url: str

    def query(self, expr: str, timeout_s: float = 10.0) -> list[dict[str, Any]]:
        """An instant query's result vector (empty: no data)."""
        response = requests.get(
            f"{self.url}/api/v1/query", params={"query": expr}, timeout=timeout_s
        )
        body = response.json()
        if response.status_code != 200 or body.get("status") != "success":
            raise PrometheusError(f"{expr}: {body.get('error', response.text[:300])}")
        return body["data"]["result"]

    def value(self, expr: str) -> float:
        """The sum of a query's samples (0 when it has none)."""
        return sum(float(r["value"][1]) for r in self.query(expr))

    def _data(self, path: str) -> dict[str, Any]:
        return requests.get(f"{self.url}/api/v1/{path}", timeout=10).json()["data"]

    def targets_up(self) -> dict[str, bool]:
        active = self._data("targets")["activeTargets"]
        return {t["labels"]["job"]: t["health"] == "up" for t in active}

    def rule_names(self) -> set[str]:
        return {r["name"] for g in self._data("rules")["groups"] for r in g["rules"]}

    def alerts(self) -> list[dict[str, Any]]:
        return self._data("alerts")["alerts"]


@contextmanager
def running(config: Mapping[str, Any], log: Path | None = None) -> Iterator[Prometheus]:
    """Prometheus on 127.0.0.1 with ``config``, its data in a temporary
    directory; stopped (and the directory removed) on exit."""
    port = supervisor.free_port()
    with tempfile.TemporaryDirectory(prefix="pd-prometheus-") as tmp:
        config_file = Path(tmp) / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(dict(config)))
        out = log.open("w") if log else subprocess.DEVNULL
        process = subprocess.Popen(
            [
                str(binary()),
                f"--config.file={config_file}",
                f"--storage.tsdb.path={tmp}/data",
                f"--web.listen-address=127.0.0.1:{port}",
                "--web.enable-lifecycle",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            server = Prometheus(f"http://127.0.0.1:{port}")
            wait.poll(
                lambda: (process.poll(), wait.healthy(server.url, path="/-/ready")),
                lambda state: state[1] or state[0] is not None,
                READY_DEADLINE_S,
                f"Prometheus ready at {server.url}",
            )
            if process.poll() is not None:
                raise PrometheusError(
                    f"prometheus exited with {process.returncode}"
                    + (f"; log: {log}" if log else "")
                )
            yield server
        finally:
            process.terminate()
            try:
                process.wait(timeout=STOP_DEADLINE_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=STOP_DEADLINE_S)
            if log:
                out.close()  # type: ignore[union-attr]


def panel_queries(dashboard: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel target, with Grafana's
    ``$__rate_interval`` given 1m."""
    return [
        (panel.get("title", ""), target["expr"].replace("$__rate_interval", "1m"))
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
        if target.get("expr")
    ]


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(binary("promtool")), *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
