"""Static checks of the observability files: the Prometheus config and alerting rules (with
promtool, whose `test rules` runs tests/deploy/alerts_test.yml), the Grafana dashboard and its
provisioning, and that every shipped PromQL expression uses only exported metric names
(services.common.metrics.catalog()). No Prometheus or Grafana runs here; the helpers that read
the expressions back (for a test against a live Prometheus) are in services.common.dashboards."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from services.common.dashboards import (
    ALERTS,
    BUILTINS,
    DASHBOARD,
    alert_expressions,
    alert_rules,
    dashboard_expressions,
    dashboard_queries,
    load_dashboard,
    metric_names,
    panels,
    substitute,
    templating_query,
    variables,
)
from services.common.metrics import catalog

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
PROMETHEUS_YML = REPO_ROOT / "deploy" / "prometheus" / "prometheus.yml"
ALERTS_TEST = HERE / "alerts_test.yml"
GRAFANA = REPO_ROOT / "deploy" / "grafana"
DATASOURCES = GRAFANA / "provisioning" / "datasources" / "prometheus.yml"
PROVIDERS = GRAFANA / "provisioning" / "dashboards" / "specd.yml"
README = GRAFANA / "README.md"
COMPOSE = REPO_ROOT / "docker-compose.yml"
DASHBOARDS_MOUNT = "/var/lib/grafana/dashboards"

JOBS = {"specd-draft": "draft:9101", "specd-target": "target:9102", "specd-coordinator": "coordinator:9103",
        "specd-gateway": "gateway:8000"}
REQUIRED_ALERTS = {"SpecdAcceptanceCollapsed", "SpecdDraftFallbacks", "SpecdDraftServiceDown",
                   "SpecdTargetServiceDown", "SpecdSpeculationSlower", "SpecdHighLatency",
                   "SpecdHighTimeToFirstToken"}
ROWS = ["Is speculation paying off?", "Draft behaviour", "Latency", "Capacity and health"]
BUILTIN_METRICS = {"up"}  # series Prometheus itself adds to every scrape
# Exported but deliberately without a panel (add a panel, or a reason here, for a new metric).
NOT_ON_DASHBOARD = {  # by family name (no _total/_bucket/_sum/_count)
    "specd_grpc_request_duration_seconds": "a streaming session's whole life: the request latency panels say more",
    "specd_gateway_request_duration_seconds": "the same as end-to-end latency, plus HTTP overhead",
    "specd_gateway_key_requests": "per-customer usage (one series per API key name): billing, not operations",
    "specd_gateway_key_tokens": "per-customer usage (one series per API key name): billing, not operations",
    "specd_gateway_key_store_errors": "zero unless the key store or Redis is unreachable (the gateway logs a warning then)",
}


def promtool(*args: str | Path) -> subprocess.CompletedProcess:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.fail("promtool not found on PATH: install it (Debian/Ubuntu: `apt-get install prometheus`, "
                    "which ships /usr/bin/promtool) to check the Prometheus config and alert rules")
    return subprocess.run([exe, *map(str, args)], check=False, capture_output=True, text=True,
                          timeout=120)


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"{' '.join(result.args)} failed:\n{result.stdout}\n{result.stderr}"


def family(name: str) -> str:
    return re.sub(r"(_total|_bucket|_sum|_count)$", "", name)


# -- Prometheus ------------------------------------------------------------------------------------

@pytest.mark.external  # runs promtool
def test_prometheus_config_is_valid(tmp_path):
    """As compose mounts it: the rules beside it (test_compose_mounts_what_the_configs_expect)."""
    shutil.copy(PROMETHEUS_YML, tmp_path / "prometheus.yml")
    shutil.copy(ALERTS, tmp_path / "alerts.yml")
    assert_ok(promtool("check", "config", tmp_path / "prometheus.yml"))


def test_prometheus_config_scrapes_every_process():
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    assert config["global"]["scrape_interval"] == "5s"
    assert config["global"]["evaluation_interval"] == "5s"
    assert config["rule_files"] == ["alerts.yml"]  # beside prometheus.yml, as compose mounts them
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == set(JOBS)
    for name, address in JOBS.items():
        targets = [t for sc in jobs[name]["static_configs"] for t in sc["targets"]]
        assert targets == [address], name
        assert jobs[name].get("metrics_path", "/metrics") == "/metrics"


@pytest.mark.external  # runs promtool
def test_alert_rules_are_valid():
    assert_ok(promtool("check", "rules", ALERTS))


def test_alert_rules_are_complete():
    data = yaml.safe_load(ALERTS.read_text())
    assert [g["name"] for g in data["groups"]] == ["specd"]
    rules = {rule["alert"]: rule for rule in alert_rules() if "alert" in rule}
    assert REQUIRED_ALERTS <= set(rules), f"missing alerts: {REQUIRED_ALERTS - set(rules)}"
    for name, rule in rules.items():
        assert rule.get("labels", {}).get("severity") in {"info", "warning", "critical"}, name
        assert {"summary", "description"} <= set(rule.get("annotations", {})), name
    assert rules["SpecdDraftServiceDown"]["expr"].strip() == 'up{job="specd-draft"} == 0'
    assert rules["SpecdDraftServiceDown"]["for"] == "1m"
    assert rules["SpecdTargetServiceDown"]["expr"].strip() == 'up{job="specd-target"} == 0'
    assert rules["SpecdAcceptanceCollapsed"]["for"] == "10m"
    assert rules["SpecdSpeculationSlower"]["for"] == "30m"


@pytest.mark.external  # runs promtool
def test_alerts_fire_on_unhealthy_series_only():
    """tests/deploy/alerts_test.yml: each alert on synthetic series, firing and quiet cases."""
    assert_ok(promtool("test", "rules", ALERTS_TEST))


def mutate_alert(tmp_path: Path, alert: str, old: str, new: str) -> Path:
    """A copy of the rules with one alert's threshold changed, and the unit tests beside it at
    the same relative path (tests/deploy/ -> ../../services/monitoring/alerts.yml)."""
    data = yaml.safe_load(ALERTS.read_text())
    (rule,) = [r for g in data["groups"] for r in g["rules"] if r.get("alert") == alert]
    assert old in rule["expr"]
    rule["expr"] = rule["expr"].replace(old, new)
    rules = tmp_path / ALERTS.relative_to(REPO_ROOT)
    rules.parent.mkdir(parents=True)
    rules.write_text(yaml.safe_dump(data, sort_keys=False))
    test = tmp_path / "tests" / "deploy" / ALERTS_TEST.name
    test.parent.mkdir(parents=True)
    shutil.copy(ALERTS_TEST, test)
    return test


@pytest.mark.external  # runs promtool
@pytest.mark.parametrize("alert,old,new", [
    ("SpecdDraftFallbacks", "> 0.05", "> 0.5"),  # too lax: misses 10% fallbacks
    ("SpecdDraftFallbacks", "> 0.05", "> 0.001"),  # too strict: fires on the healthy series
    ("SpecdAcceptanceCollapsed", "< 0.1", "< 0.02"),  # misses 5% acceptance
    ("SpecdAcceptanceCollapsed", "< 0.1", "< 0.25"),  # fires on healthy n-gram drafting at 18%
])
def test_alert_unit_tests_catch_a_wrong_threshold(tmp_path, alert, old, new):
    result = promtool("test", "rules", mutate_alert(tmp_path, alert, old, new))
    assert result.returncode != 0, f"alerts_test.yml passes with {alert} at {new!r}: it checks nothing"
    assert f"alertname: {alert}" in result.stdout + result.stderr


@pytest.mark.external  # runs promtool
def test_every_expression_parses(tmp_path):
    """promtool parses each dashboard expression (as a recording rule) after substitution."""
    rules = [{"record": f"specd:dashboard_check:{i}", "expr": expr} for i, expr in enumerate(dashboard_expressions())]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    assert_ok(promtool("check", "rules", path))


# -- metric names ------------------------------------------------------------------------------------

def test_metric_names_extractor():
    expr = '''
        histogram_quantile(0.95, sum by (le, policy) (rate(specd_request_duration_seconds_bucket{
            policy=~"$policy", drafter!="none", status="specd_in_a_string"}[$__rate_interval])))
        > 1e3 and on (model, policy) group_left (drafter)
        sum without (instance) (rate(specd_not_a_metric_total[5m] offset 1h))
        / ignoring(position) max(specd_policy_state) unless bool up  # comment_name
        + label_replace(vector(1), "dst", "$1", "src", "specd_(.*)") + {__name__="specd_named_total"}
        + sum(foo:recorded:rate5m) by (le) + count_values("value", specd_kv_cache_bytes) @ start()
    '''
    assert metric_names(expr) == {"specd_request_duration_seconds_bucket", "specd_not_a_metric_total",
                                  "specd_policy_state", "up", "specd_named_total", "foo:recorded:rate5m",
                                  "specd_kv_cache_bytes"}
    assert "specd_not_a_metric_total" in metric_names("specd_not_a_metric_total")
    assert metric_names('sum(rate(x[5m])) by (specd_label)') == {"x"}
    assert metric_names("rate (y [1m])") == {"y"}  # a function, even with a space before "("


def test_substitute():
    expr = 'sum(rate(m{policy=~"$policy", drafter=~"${drafter:regex}"}[$__rate_interval])) [$__interval] $__range'
    assert substitute(expr) == 'sum(rate(m{policy=~".*", drafter=~".*"}[1m])) [15s] 1h'
    assert substitute("[[drafter]]", {"drafter": "ngram"}) == "ngram"
    assert variables(expr) == {"policy", "drafter", "__rate_interval", "__interval", "__range"}


def test_templating_query():
    assert templating_query({"type": "query", "query": "label_values(m{a=~\"$b\"}, c)"}) == 'm{a=~"$b"}'
    assert templating_query({"type": "query", "query": {"query": "label_values(m, c)"}}) == "m"
    assert templating_query({"type": "query", "query": "label_values(c)"}) is None
    assert templating_query({"type": "custom", "query": "a,b"}) is None


def test_shipped_promql_uses_only_exported_metrics():
    known = catalog() | BUILTIN_METRICS
    queries = [(f"dashboard {where} [{ref}]", expr) for where, ref, expr in dashboard_queries()]
    queries += [(f"alert rule {i}", expr) for i, expr in enumerate(alert_expressions())]
    assert len(queries) > 30
    unknown = {where: sorted(metric_names(expr) - known) for where, expr in queries if metric_names(expr) - known}
    assert not unknown, f"PromQL uses names no process exports (services.common.metrics.catalog()): {unknown}"
    empty = [where for where, expr in queries if not metric_names(expr)]
    assert not empty, f"expressions that select no metric: {empty}"


def test_dashboard_shows_every_exported_series():
    used = {family(n) for _, _, expr in dashboard_queries() for n in metric_names(expr)}
    exported = {family(n) for n in catalog() if n.startswith("specd_")}
    missing = exported - used - set(NOT_ON_DASHBOARD)
    assert not missing, f"exported but on no panel (add one, or a reason to NOT_ON_DASHBOARD): {sorted(missing)}"


def test_expressions_for_a_live_prometheus():
    dashboard, alerts = dashboard_expressions(), alert_expressions()
    assert len(dashboard) > 30 and len(alerts) >= len(REQUIRED_ALERTS)
    for expr in dashboard + alerts:
        assert "$" not in expr and "[[" not in expr, expr
    assert any('policy=~".*"' in expr and "[1m]" in expr for expr in dashboard)


# -- Grafana ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dashboard() -> dict:
    return load_dashboard()


def test_dashboard_identity(dashboard):
    assert dashboard["uid"] == "specd"
    assert dashboard["title"] == "specd — speculative decoding"
    assert dashboard["schemaVersion"] == 39
    assert dashboard.get("id") is None  # provisioned: Grafana assigns the database id


def test_dashboard_panels(dashboard):
    all_panels = list(panels(dashboard))
    ids = [p.get("id") for p in all_panels]
    assert None not in ids and len(ids) == len(set(ids)), f"panel ids must be unique: {ids}"
    rows = [p["title"] for p in all_panels if p["type"] == "row"]
    assert rows == ROWS
    for panel in all_panels:
        title = panel.get("title")
        gp = panel.get("gridPos", {})
        assert {"x", "y", "w", "h"} <= set(gp) and all(isinstance(gp[k], int) for k in "xywh"), title
        assert 0 <= gp["x"] and gp["x"] + gp["w"] <= 24, title
        if panel["type"] == "row":
            continue
        assert title and panel.get("description", "").strip(), f"panel without title or description: {panel['id']}"
        for ds in [panel.get("datasource"), *(t.get("datasource") for t in panel.get("targets", []))]:
            assert ds is None or ds.get("uid") == "prometheus", f"{title}: datasource {ds}"
        targets = panel.get("targets", [])
        assert targets, title
        refs = [t.get("refId") for t in targets]
        assert all(refs) and len(refs) == len(set(refs)), f"{title}: refIds {refs}"
        assert all(t.get("expr") for t in targets), title
        if panel["type"] == "heatmap":
            assert all(t.get("format") == "heatmap" for t in targets), title
            assert all("_bucket" in t["expr"] for t in targets), title
    # no two panels overlap on the grid
    cells: dict[tuple[int, int], str] = {}
    for panel in all_panels:
        gp = panel["gridPos"]
        for x in range(gp["x"], gp["x"] + gp["w"]):
            for y in range(gp["y"], gp["y"] + gp["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]
    types = [p["type"] for p in all_panels]
    assert types.count("heatmap") >= 2 and "stat" in types


def test_dashboard_variables(dashboard):
    defined = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"policy", "drafter"} <= set(defined)
    for name in ("policy", "drafter"):
        v = defined[name]
        assert v["type"] == "query" and v["multi"] and v["includeAll"], name
        assert v["datasource"]["uid"] == "prometheus", name
        assert "label_values(specd_drafted_tokens_total" in v["definition"], name
        assert templating_query(v), name
    used: set[str] = set()
    for _, _, expr in dashboard_queries():
        used |= variables(expr)
        # a multi-value variable expands to a regex: only =~ / !~ matchers can take it
        for match in re.finditer(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*\$[^"]*)"', expr):
            assert match.group(2) in ("=~", "!~"), f"{match.group(0)} in {expr}"
    assert {"policy", "drafter"} <= used
    undefined = used - set(defined) - set(BUILTINS)
    assert not undefined, f"variables used but not defined: {undefined}"


def test_grafana_provisioning():
    sources = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    (source,) = [s for s in sources if s["uid"] == "prometheus"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090" and source["isDefault"]
    providers = yaml.safe_load(PROVIDERS.read_text())["providers"]
    assert [p["options"]["path"] for p in providers] == [DASHBOARDS_MOUNT]
    assert all(p["type"] == "file" for p in providers)
    assert DASHBOARD.parent == REPO_ROOT / "services" / "monitoring" / "dashboards"


def test_compose_mounts_what_the_configs_expect():
    if not COMPOSE.exists():
        pytest.skip("docker-compose.yml is absent: cannot check its Prometheus/Grafana mounts and services")
    services = yaml.safe_load(COMPOSE.read_text())["services"]

    def mounts(service: str) -> dict[str, str]:
        pairs = (v.split(":")[:2] for v in services[service].get("volumes", []) if isinstance(v, str))
        return {target: source for source, target in pairs}

    grafana = mounts("grafana")
    assert grafana.get(DASHBOARDS_MOUNT) == "./services/monitoring/dashboards"
    assert grafana.get("/etc/grafana/provisioning") == "./deploy/grafana/provisioning"
    prometheus = mounts("prometheus")
    assert prometheus.get("/etc/prometheus/prometheus.yml") == "./deploy/prometheus/prometheus.yml"
    assert prometheus.get("/etc/prometheus/alerts.yml") == "./services/monitoring/alerts.yml"
    # every scrape target is a compose service listening on that port
    for job, address in JOBS.items():
        host, port = address.split(":")
        env = services[host].get("environment", {})
        key = "SPECD_GATEWAY_PORT" if host == "gateway" else f"SPECD_{host.upper()}_METRICS_PORT"
        assert str(env.get(key)) == port, f"{job}: {host} does not serve metrics on {port} ({key}={env.get(key)})"


def test_readme_covers_every_panel_and_alert(dashboard):
    text = README.read_text()
    titles = [p["title"] for p in panels(dashboard)]
    alerts = [r["alert"] for r in alert_rules() if "alert" in r]
    missing = [t for t in titles + alerts if t not in text]
    assert not missing, f"deploy/grafana/README.md does not mention: {missing}"
