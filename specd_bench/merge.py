"""One results document from benchmark runs over disjoint parts of one prompt set
(`specd bench --offset A --limit B` run more than once; `specd bench-merge`).

An 80-prompt run of every policy takes longer than many a sitting; run in parts, it can be
joined afterwards without losing anything that makes a ratio honest: every speedup is still a
ratio against `ar` on the same prompt in the same run, because the per-prompt records are kept
as they were and only the summaries (aggregates, % of oracle, contention) are recomputed over
their union. Each part's oracle bound per prompt was computed with that part's own measured
cost curve and is kept as it was; the parts' curves are listed in `parts`.

Parts must agree on everything but which prompts they ran: the same settings (bar --offset,
--limit and --out), the same machine and versions, and the same configurations.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from specd_bench.configs import BASELINE
from specd_bench.contention import summarize as contention_summary
from specd_bench.metrics import aggregate
from specd_bench.report import add_oracle_fractions
from specd.errors import InvalidRequest

PART_ONLY_SETTINGS = ("offset", "limit", "out")  # what may differ between parts
SAME_MACHINE = ("cpu", "cores", "torch_threads", "device", "dtype", "linear_kernels", "forward", "torch",
                "transformers")


def load_part(path: str | Path) -> dict:
    """A part's results.json (a bench --out directory or the file itself)."""
    path = Path(path)
    file = path / "results.json" if path.is_dir() else path
    if not file.is_file():
        raise InvalidRequest("parts", f"{path}: no results.json there")
    try:
        doc = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise InvalidRequest("parts", f"{file}: not JSON ({e.msg})") from None
    if not isinstance(doc, dict) or not {"settings", "records", "prompts", "configs", "oracle"} <= set(doc):
        raise InvalidRequest("parts", f"{file}: not a `specd bench` results.json")
    doc["_path"] = str(file)
    return doc


def merge_docs(parts: list[dict]) -> dict:
    """The union of the parts as one results document (the shape of report.results_doc)."""
    if len(parts) < 2:
        raise InvalidRequest("parts", f"need at least 2 parts to merge, got {len(parts)}")
    first = parts[0]
    for part in parts[1:]:
        _check_compatible(first, part)
    seen: dict[str, str] = {}
    for part in parts:
        for p in part["prompts"]:
            if p["key"] in seen:
                raise InvalidRequest("parts", f"prompt {p['key']} is in both {seen[p['key']]} and {part['_path']}")
            seen[p["key"]] = part["_path"]

    records = {label: [r for part in parts for r in part["records"][label]] for label in first["records"]}
    aggregates = {label: aggregate(recs, records[BASELINE]) for label, recs in records.items()}
    oracle = _merge_oracle(parts)
    add_oracle_fractions(aggregates, first["configs"], oracle)
    settings = dict(first["settings"])
    settings["offset"] = min(p["settings"].get("offset", 0) for p in parts)
    settings["limit"] = len({p["qid"] for part in parts for p in part["prompts"]})
    return {
        "machine": first["machine"],
        "command": list(sys.argv),
        "settings": settings,
        "target": first["target"],
        "prompts": [p for part in parts for p in part["prompts"]],
        "configs": first["configs"],
        "records": records,
        "aggregates": aggregates,
        "oracle": oracle,
        "contention": contention_summary(records, BASELINE),
        "parts": [{"results": part["_path"], "command": part["command"], "prompts": len(part["prompts"]),
                   "first_prompt": part["prompts"][0]["key"], "last_prompt": part["prompts"][-1]["key"],
                   "cost_curves": {k: e["cost_curve"] for k, e in part["oracle"].get("drafters", {}).items()
                                   if "cost_curve" in e},
                   "policy_cost_curves": part.get("policy_cost_curves", {})}
                  for part in parts],
    }


def _check_compatible(first: dict, part: dict) -> None:
    where = f"{part['_path']} against {first['_path']}"
    a, b = first["settings"], part["settings"]
    for key in sorted(set(a) | set(b)):
        if key not in PART_ONLY_SETTINGS and a.get(key) != b.get(key):
            raise InvalidRequest("parts", f"{where}: setting {key!r} differs ({b.get(key)!r} vs {a.get(key)!r})")
    for key in SAME_MACHINE:
        if first["machine"].get(key) != part["machine"].get(key):
            raise InvalidRequest("parts", f"{where}: machine {key!r} differs "
                                          f"({part['machine'].get(key)!r} vs {first['machine'].get(key)!r})")
    labels_a, labels_b = [c["label"] for c in first["configs"]], [c["label"] for c in part["configs"]]
    if labels_a != labels_b or list(first["records"]) != list(part["records"]):
        raise InvalidRequest("parts", f"{where}: configurations differ ({labels_b} vs {labels_a})")


def _merge_oracle(parts: list[dict]) -> dict:
    """The first part's cost curves (each part's are in `parts`) with every part's per-prompt
    bounds; a drafter measured without per-prompt bounds keeps its `oracle` configuration's
    aggregate, which is recomputed like any other."""
    first = parts[0]["oracle"]
    out = {k: v for k, v in first.items() if k != "drafters"}
    if "drafters" not in first:
        return out
    out["drafters"] = {}
    for kind, entry in first["drafters"].items():
        merged = {k: v for k, v in entry.items()
                  if k not in ("per_prompt", "tokens_per_s", "best_fixed_k", "failed_prompts")}
        if "per_prompt" in entry:
            entries = [part["oracle"].get("drafters", {}).get(kind, {}) for part in parts]
            merged["per_prompt"] = [r for e in entries for r in e.get("per_prompt", [])]
            failures = [f for e in entries for f in e.get("failed_prompts", [])]
            if failures:
                merged["failed_prompts"] = failures
        out["drafters"][kind] = merged
    return out
