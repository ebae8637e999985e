"""The PromQL shipped with specd: the Grafana dashboard (services/monitoring/dashboards/specd.json)
and the Prometheus alerting rules (services/monitoring/alerts.yml), read back as plain strings
for tests. Both are package data (pyproject.toml), so an installed specd reads the copy it
ships; docker-compose.yml mounts the same files into Grafana and Prometheus.

  dashboard_expressions()   every panel query and templating query of the dashboard, with the
                            Grafana variables replaced so that a real Prometheus can evaluate
                            them: $__rate_interval -> 1m, $__interval -> 15s, $__range -> 1h,
                            any dashboard variable ($policy, $drafter) -> .* (they are used only
                            in =~ matchers, so every value matches)
  alert_expressions()       the `expr` of every rule in alerts.yml
  metric_names(expr)        the metric names an expression selects (what tests compare with
                            services.common.metrics.catalog())

A templating query `label_values(<selector>, <label>)` is Grafana's, not PromQL: it is returned
as its <selector>, which Prometheus evaluates (label_values(<label>) alone selects no series and
is left out). Nothing here needs Grafana or Prometheus; PyYAML (installed with transformers)
reads the rules.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

MONITORING = Path(__file__).resolve().parents[1] / "monitoring"
DASHBOARD = MONITORING / "dashboards" / "specd.json"
ALERTS = MONITORING / "alerts.yml"

# Grafana's built-in variables, at values a live Prometheus scraping every 5 s can evaluate.
BUILTINS = {
    "__rate_interval": "1m",
    "__interval": "15s",
    "__interval_ms": "15000",
    "__range": "1h",
    "__range_s": "3600",
    "__range_ms": "3600000",
}
ANY = ".*"  # a dashboard variable set to "All" (the panels match them with =~)

_VARIABLE = re.compile(r"\$\{(\w+)(?::[^}]*)?\}|\$(\w+)|\[\[(\w+)(?::[^\]]*)?\]\]")
_LABEL_VALUES = re.compile(r"^\s*label_values\s*\((?P<selector>.*),\s*(?P<label>[A-Za-z_]\w*)\s*\)\s*$", re.DOTALL)
_QUERY_RESULT = re.compile(r"^\s*query_result\s*\((?P<expr>.*)\)\s*$", re.DOTALL)


def substitute(expr: str, values: dict[str, str] | None = None) -> str:
    """expr with Grafana's variables ($name, ${name}, ${name:format}, [[name]]) replaced:
    built-ins by BUILTINS, others by `values` or, by default, ANY."""
    table = {**BUILTINS, **(values or {})}

    def replace(match: re.Match) -> str:
        name = match.group(1) or match.group(2) or match.group(3)
        return table.get(name, ANY)

    return _VARIABLE.sub(replace, expr)


def variables(expr: str) -> set[str]:
    """The Grafana variables expr refers to (built-ins included)."""
    return {m.group(1) or m.group(2) or m.group(3) for m in _VARIABLE.finditer(expr)}


def load_dashboard(path: Path | str | None = None) -> dict:
    return json.loads(Path(path or DASHBOARD).read_text(encoding="utf-8"))


def panels(dashboard: dict) -> Iterator[dict]:
    """Every panel, rows included, and the panels inside collapsed rows."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panels(panel)


def templating_query(variable: dict) -> str | None:
    """The PromQL of a query variable (label_values(<selector>, label) -> <selector>), or None."""
    if variable.get("type") != "query":
        return None
    query = variable.get("query")
    if isinstance(query, dict):
        query = query.get("query")
    if not query:
        return None
    if match := _LABEL_VALUES.match(query):
        return match.group("selector").strip()
    if match := _QUERY_RESULT.match(query):
        return match.group("expr").strip()
    if re.match(r"^\s*(label_values|label_names|metrics)\s*\(", query):
        return None  # no selector to evaluate
    return query.strip()


def dashboard_queries(path: Path | str | None = None) -> list[tuple[str, str, str]]:
    """(where, refId or variable name, raw PromQL) of every query in the dashboard: where is the
    panel's title, or "templating"."""
    dashboard = load_dashboard(path)
    found = []
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            if target.get("expr"):
                found.append((panel.get("title", ""), target.get("refId", ""), target["expr"]))
    for variable in dashboard.get("templating", {}).get("list", []):
        if query := templating_query(variable):
            found.append(("templating", variable.get("name", ""), query))
    return found


def dashboard_expressions(path: Path | str | None = None) -> list[str]:
    """Every PromQL expression of the dashboard, variables substituted, without duplicates."""
    return list(dict.fromkeys(substitute(expr) for _, _, expr in dashboard_queries(path)))


def alert_rules(path: Path | str | None = None) -> list[dict]:
    import yaml

    data = yaml.safe_load(Path(path or ALERTS).read_text(encoding="utf-8"))
    return [rule for group in data.get("groups", []) for rule in group.get("rules", [])]


def alert_expressions(path: Path | str | None = None) -> list[str]:
    """The expression of every rule (alerting and recording) in alerts.yml."""
    return [rule["expr"].strip() for rule in alert_rules(path)]


# -- metric names in an expression ----------------------------------------------------------------

# Words that are never metric names: binary and set operators, modifiers, aggregations (PromQL
# parses `sum` as the aggregation even without a parenthesis, as in `sum by (le) (...)`).
KEYWORDS = frozenset({
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
    "offset", "bool", "atan2", "inf", "nan", "start", "end",
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
    "bottomk", "topk", "quantile", "limitk", "limit_ratio",
})
GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})

_TOKENS = re.compile(r"""
    (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<comment>\#[^\n]*)
  | (?P<variable>\$\{[^}]*\}|\$\w+|\[\[[^\]]*\]\])
  | (?P<range>\[[^\]]*\])
  | (?P<number>(?:\d|\.\d)[\w.]*)
  | (?P<ident>[A-Za-z_:][\w:]*)
  | (?P<space>\s+)
  | (?P<other>.)
""", re.VERBOSE | re.DOTALL)
_NAME_MATCHER = re.compile(r"""\b__name__\s*=\s*(?:"((?:[^"\\]|\\.)*)"|'((?:[^'\\]|\\.)*)')""")


def metric_names(expr: str) -> set[str]:
    """The metric names expr selects: identifiers outside strings, label matchers {...},
    ranges [...] and grouping clauses (by/without/on/ignoring/group_left/group_right (...)),
    not followed by "(" (a function), and not PromQL keywords; plus {__name__="..."}."""
    tokens = [(m.lastgroup, m.group()) for m in _TOKENS.finditer(expr) if m.lastgroup not in ("space", "comment")]
    names: set[str] = set()
    braces = 0
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        following = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        if kind == "other" and text == "{":
            braces += 1
        elif kind == "other" and text == "}":
            braces = max(0, braces - 1)
        elif kind == "ident" and not braces:
            word = text.lower()
            if word in GROUPING and following == "(":
                depth, i = 0, i + 1  # skip the label list: up to its closing parenthesis
                while i < len(tokens):
                    depth += tokens[i][1] == "("
                    depth -= tokens[i][1] == ")"
                    if depth == 0:
                        break
                    i += 1
            elif word not in KEYWORDS and following != "(":
                names.add(text)
        i += 1
    for match in _NAME_MATCHER.finditer(expr):
        names.add(match.group(1) if match.group(1) is not None else match.group(2))
    return names
