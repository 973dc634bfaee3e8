"""The Prometheus side of a deployment: docker/'s rules and dashboard, the PromQL in them, promtool, a real
Prometheus server."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from tests.helpers.http import request
from tests.support import free_port, require_binary, wait_until

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
RULES = DOCKER / "rules" / "cache-config-exporter.rules.yml"
RULE_TESTS = sorted((DOCKER / "rules").glob("*_test.yml"))
DASHBOARD = DOCKER / "grafana" / "dashboards" / "cache-config-exporter.json"


def shipped_rules() -> list[dict[str, Any]]:
    """Every recording and alerting rule of docker/rules, in file order."""
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def recorded_names() -> list[str]:
    """The names the shipped recording rules record."""
    return [rule["record"] for rule in shipped_rules() if "record" in rule]


def promtool(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    """Run promtool in docker/ (relative paths in the rule tests resolve there); output in ``.stdout``."""
    return subprocess.run(
        [require_binary("promtool"), *args],
        cwd=DOCKER,
        input=stdin.decode() if stdin is not None else None,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


# PromQL parts that are not metric names, removed before the names are read off an expression.
_STRINGS = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_VARIABLES = re.compile(r"\$\{[^}]*\}|\$\w+")
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENTIFIER = re.compile(r"(?<![\w.:])([A-Za-z_:][\w:]*)(\s*\()?")
_KEYWORDS = {
    "and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left", "group_right",
    "inf", "nan",
}  # fmt: skip


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (Grafana's ``$variables`` allowed)."""
    text = _STRINGS.sub('""', expr)
    text = _VARIABLES.sub("1", text)
    for pattern in (_MATCHERS, _RANGES, _GROUPING):
        text = pattern.sub(" ", text)
    return {
        match.group(1)
        for match in _IDENTIFIER.finditer(text)
        if match.group(2) is None and match.group(1).lower() not in _KEYWORDS
    }


_LABEL_VALUES = re.compile(r"label_values\((?P<selector>.+),\s*\w+\)")


def dashboard_queries() -> list[str]:
    """Every PromQL query of the Grafana dashboard: panel targets, and the series selector of each
    ``label_values(selector, label)`` template variable."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            match = _LABEL_VALUES.fullmatch(query["query"] if isinstance(query, dict) else query)
            assert match, f"variable {variable['name']}: not a label_values() query"
            queries.append(match["selector"])
    return queries


class PrometheusServer:
    """A real ``prometheus`` on a free loopback port, scraping ``targets`` every second."""

    def __init__(self, directory: Path, targets: list[str], job: str = "cache-config-exporter") -> None:
        self.directory = directory
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = directory / "prometheus.yml"
        self.config.write_text(
            json.dumps(  # JSON is YAML
                {
                    "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
                    "scrape_configs": [{"job_name": job, "static_configs": [{"targets": targets}]}],
                }
            )
        )
        self.log = directory / "prometheus.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> PrometheusServer:
        command = [
            require_binary("prometheus"),
            f"--config.file={self.config}",
            f"--storage.tsdb.path={self.directory / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
        ]
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        wait_until(self._ready, timeout=60, interval=0.2)
        return self

    def running(self) -> None:
        """Fail with Prometheus' log when it has exited."""
        assert self.process is not None
        returncode = self.process.poll()
        assert returncode is None, f"prometheus exited with {returncode}:\n{self.log.read_text()}"

    def _ready(self) -> bool:
        self.running()
        try:
            ready = request(self.url, "GET", "/-/ready")
        except OSError:
            return False
        return ready.status == 200 and ready.body.startswith(b"Prometheus")

    def api(self, endpoint: str, **params: str | float) -> Any:
        """``/api/v1/<endpoint>``'s ``data``, asserting the call succeeded."""
        self.running()
        answer = request(self.url, "GET", f"/api/v1/{endpoint}?{urllib.parse.urlencode(params)}").json()
        assert answer["status"] == "success", answer
        return answer["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query at the server's now: its vector (``[{"metric": ..., "value": [t, v]}]``)."""
        return self.api("query", query=expr)["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        return self.api("query_range", query=expr, start=start, end=end, step=step)["result"]

    def wait_for(self, expr: str, count: int = 1, timeout: float = 30) -> list[dict[str, Any]]:
        """Poll an instant query until it returns exactly ``count`` series."""

        def answered() -> list[dict[str, Any]] | None:
            result = self.query(expr)
            return result if len(result) == count else None

        return wait_until(answered, timeout, 0.2)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@contextlib.contextmanager
def running_prometheus() -> Iterator[Callable[[PrometheusServer], PrometheusServer]]:
    """Starts each Prometheus handed to it and stops every one of them at the end, whatever the test did."""
    servers: list[PrometheusServer] = []

    def start(server: PrometheusServer) -> PrometheusServer:
        servers.append(server)
        return server.start()

    try:
        yield start
    finally:
        for server in servers:
            server.stop()
