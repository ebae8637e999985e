"""A real Prometheus (Debian's package) scrapes the four real service processes with the
shipped scrape jobs and alert rules; after a few requests, every PromQL expression of the
shipped Grafana dashboard returns data and every alert rule evaluates without error over the
series the processes really export."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from services.cli import free_port
from services.common.dashboards import ALERTS, alert_expressions, dashboard_expressions, metric_names
from tests.integration.conftest import HTTP_TIMEOUT_S, MESSAGES, REPO_ROOT, Stack

pytestmark = pytest.mark.embedded

SHIPPED = REPO_ROOT / "deploy" / "prometheus"
JOBS = {"specd-draft": "draft", "specd-target": "target", "specd-coordinator": "coordinator",
        "specd-gateway": "gateway"}


def local_config(stack: Stack, rules: Path) -> dict:
    """The shipped prometheus.yml with its targets pointed at this stack's loopback ports, a
    1 s scrape and evaluation interval, and the shipped rules by absolute path."""
    config = yaml.safe_load((SHIPPED / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    config["rule_files"] = [str(rules)]
    assert {job["job_name"] for job in config["scrape_configs"]} == set(JOBS), "shipped scrape jobs changed"
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": [f"127.0.0.1:{stack.metrics_ports[JOBS[job['job_name']]]}"]}]
    return config


class Prometheus:
    def __init__(self, url: str):
        self.url = url

    def query(self, expr: str) -> list:
        reply = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10).json()
        assert reply["status"] == "success", f"{expr}: {reply.get('error')}"
        return reply["data"]["result"]


@pytest.fixture(scope="module")
def prometheus(stack: Stack, tmp_path_factory) -> Prometheus:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus is not on PATH: install Debian's package (`apt-get install -y prometheus`; "
                    "`make test` does it)", pytrace=False)
    tmp = tmp_path_factory.mktemp("prometheus")
    config = tmp / "prometheus.yml"
    config.write_text(yaml.safe_dump(local_config(stack, ALERTS)))
    port = free_port()
    with open(tmp / "prometheus.log", "w") as log:
        proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"prometheus did not start:\n{(tmp / 'prometheus.log').read_text()[-3000:]}",
                            pytrace=False)
            time.sleep(0.2)
        yield Prometheus(url)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _chat(stack: Stack, max_tokens: int, **speculative) -> None:
    body = {"model": "specd", "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0,
            "speculative": speculative}
    reply = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=HTTP_TIMEOUT_S)
    assert reply.status_code == 200, reply.text


def _leave_early(stack: Stack) -> None:
    """A streaming client that goes away after its first event: its sessions end CANCELLED,
    the one non-OK gRPC outcome a healthy stack has."""
    body = {"model": "specd", "messages": MESSAGES, "max_tokens": 64, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{stack.url}/v1/chat/completions", json=body, timeout=HTTP_TIMEOUT_S) as reply:
        assert reply.status_code == 200
        next(reply.iter_lines())


def _wait(prom: Prometheus, expr: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not prom.query(expr):
        assert time.monotonic() < deadline, f"no data for {expr} after {timeout_s:.0f} s"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def traffic(stack: Stack, prometheus: Prometheus) -> Prometheus:
    """Requests in two rounds with scrapes between them, so that every counter has a sample
    before and after an increase (a rate needs both); each round has a client that leaves."""
    _wait(prometheus, 'count(up{job=~"specd-.*"} == 1) == 4')
    for _ in range(2):
        for policy in ("heuristic", "constant"):
            _chat(stack, 16, policy=policy, task_tag="prometheus")
        _chat(stack, 4, enabled=False)
        _leave_early(stack)
        time.sleep(3)  # a few scrapes
    _wait(prometheus, "sum(rate(specd_emitted_tokens_total[1m])) > 0")
    _wait(prometheus, "sum(rate(specd_draft_tokens_total[1m])) > 0")
    return prometheus


def test_every_scrape_target_is_up(traffic):
    up = {r["metric"]["job"]: r["value"][1] for r in traffic.query("up")}
    assert up == dict.fromkeys(JOBS, "1")


def test_every_dashboard_expression_returns_data(traffic):
    exprs = dashboard_expressions()
    assert len(exprs) >= 20
    empty = [expr for expr in exprs if not traffic.query(expr)]
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)


def test_every_alert_rule_evaluates_over_real_series(traffic):
    exprs = alert_expressions()
    assert len(exprs) >= 5
    for expr in exprs:
        traffic.query(expr)  # valid PromQL, evaluated without error (empty while nothing is wrong)
        for name in metric_names(expr):
            assert traffic.query(f'count({{__name__="{name}"}})'), f"{name} (in {expr!r}) has no series"
    groups = httpx.get(f"{traffic.url}/api/v1/rules", timeout=10).json()["data"]["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert len(rules) == len(exprs)
    deadline = time.monotonic() + 10
    while any(rule.get("health") != "ok" for rule in rules):
        bad = [(r["name"], r.get("health"), r.get("lastError")) for r in rules if r.get("health") != "ok"]
        assert time.monotonic() < deadline and all(h == "unknown" for _, h, _ in bad), bad
        time.sleep(1)
        groups = httpx.get(f"{traffic.url}/api/v1/rules", timeout=10).json()["data"]["groups"]
        rules = [rule for group in groups for rule in group["rules"]]
    firing = [r["name"] for r in rules if r.get("state") == "firing"]
    assert "SpecdDraftServiceDown" not in firing and "SpecdTargetServiceDown" not in firing, firing
