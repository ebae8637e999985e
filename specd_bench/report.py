"""The benchmark's outputs: results.json (everything, machine-readable) and report.md (one
table, configurations as rows). Plots are drawn by specd_bench.plots from the same document.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from specd_bench.configs import BASELINE
from specd_bench.contention import summarize as contention_summary
from specd_bench.datasets import dataset_label
from specd_bench.metrics import aggregate
from specd_bench.peers import sklearn_available
from specd.costs import provenance
from specd.runtime.kernels import kernels_of


def machine_info(target) -> dict:
    """Where a benchmark ran: the commit, CPU and its instruction sets, cores, threads, the
    target's device, dtype and linear kernels, versions (specd.costs.provenance)."""
    return {**provenance(), "device": str(target.device), "dtype": str(next(target.model.parameters()).dtype),
            "linear_kernels": kernels_of(target.model), "forward": forward_label(target),
            "sklearn_available": sklearn_available()}


def forward_label(target) -> str:
    """lean or hf, and how a pooled target runs it: compiled ahead of time, or in CUDA graphs."""
    runner = type(target.pool.runner).__name__ if target.pool is not None and target.pool.runner else ""
    return target.forward_kind() + {"AotRunner": " (compiled)", "GraphRunner": " (CUDA graphs)"}.get(runner, "")


def results_doc(run, oracle: dict) -> dict:
    """The whole benchmark as plain data."""
    base = run.records[BASELINE]
    aggregates = {label: aggregate(recs, base) for label, recs in run.records.items()}
    configs = [c.to_dict() for c in run.configs]
    add_oracle_fractions(aggregates, configs, oracle)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(run.s).items()}
    settings["dataset"] = dataset_label(run.s.dataset)
    return {
        "machine": machine_info(run.m.target),
        "command": list(sys.argv),
        "settings": settings,
        "target": run.m.target.name,
        "prompts": [_prompt_entry(run, p) for p in run.prompts],
        "configs": configs,
        "records": run.records,
        "aggregates": aggregates,
        "oracle": oracle,
        "policy_cost_curves": run.policy_curves,
        "contention": contention_summary(run.records, BASELINE),
    }


def _prompt_entry(run, p) -> dict:
    """A prompt's key, question, turn and length; a prompt that could not be built (a second
    turn whose first answer failed) has no length and says why."""
    if p.key not in run.prompt_ids:
        return {"key": p.key, "qid": p.qid, "turn": p.turn, "prompt_tokens": None, "failed": run.prompt_failures[p.key]}
    return {"key": p.key, "qid": p.qid, "turn": p.turn, "prompt_tokens": len(run.prompt_ids[p.key])}


def add_oracle_fractions(aggregates: dict, configs: list[dict], oracle: dict) -> None:
    """Each config's tokens/s as a fraction of its drafter's oracle, and the best constant K.
    Where every prompt's bound was also costed at `ar`'s own per-token time (specd_bench.oracle
    `ar_step`), that bound and the fractions of it too (`..._at_ar_step`)."""
    bounds, at_ar = {}, {}
    for kind, entry in oracle.get("drafters", {}).items():
        if "per_prompt" in entry:
            rows = entry["per_prompt"]
            n = sum(r["new_tokens"] for r in rows)
            t = sum(r["time_s"] for r in rows)
            entry["tokens_per_s"] = bounds[kind] = n / t if t > 0 else 0.0
            if rows and all("time_at_ar_step_s" in r for r in rows):
                t = sum(r["time_at_ar_step_s"] for r in rows)
                entry["tokens_per_s_at_ar_step"] = at_ar[kind] = n / t if t > 0 else 0.0
        elif f"{kind}/oracle" in aggregates:
            entry["tokens_per_s"] = bounds[kind] = aggregates[f"{kind}/oracle"]["tokens_per_s"]
    for c in configs:
        agg = aggregates.get(c["label"])
        if agg is not None:
            bound = bounds.get(c["drafter"])
            agg["oracle_fraction"] = agg["tokens_per_s"] / bound if bound else None
            if at_ar.get(c["drafter"]):
                agg["oracle_fraction_at_ar_step"] = agg["tokens_per_s"] / at_ar[c["drafter"]]
    for kind, entry in oracle.get("drafters", {}).items():
        sweep = {k: a["tokens_per_s"] for k, a in aggregates.items() if k.startswith(f"{kind}/constant-k")}
        if sweep:
            best = max(sweep, key=sweep.get)
            entry["best_fixed_k"] = {"config": best, "tokens_per_s": sweep[best]}


def _fmt(x, spec: str = ".2f") -> str:
    return "–" if x is None else format(x, spec)


def report_md(doc: dict) -> str:
    """One table, configurations as rows, plus the skipped configs, oracle bounds and gaps."""
    m, s = doc["machine"], doc["settings"]
    skipped = f" (from question {s['offset'] + 1} of the set on)" if s.get("offset") else ""
    dataset = f" of `{s['dataset']}`" if s.get("dataset") else ""
    lines = [
        "# specd bench", "",
        f"Target `{doc['target']}`, drafters {', '.join(s['drafters'])}, {len(doc['prompts'])} prompts{dataset}{skipped} × "
        f"{s['repeats']} repeats, max {s['max_new_tokens']} new tokens, temperature {s['temperature']}"
        f"{', seed ' + str(s['seed']) if s.get('seed') is not None else ''}"
        f"{', every run cold (empty policy state, start-up cost curve)' if s.get('cold_start') else ''}. "
        f"{m['cpu']}, {m['cores']} cores, {m['torch_threads']} torch threads, {m['device']} {m['dtype']}, "
        f"{m.get('linear_kernels', 'torch')} linear kernels, {m.get('forward', 'hf')} forward, torch {m['torch']}, transformers {m['transformers']}.", "",
        "Speedup: tokens/s over target-only decoding (`ar`) on the same prompt in the same run; median "
        "[min, max] over prompts × repeats. % of oracle: tokens/s over the oracle bound of the same drafter.", "",
        "| config | tok/s | speedup median [spread] | MAT | acceptance | verif. rate | discard rate "
        "| mean draft len | % of oracle | identical |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, a in doc["aggregates"].items():
        sp = a["speedup"]
        frac = a.get("oracle_fraction")
        ident = {True: "yes", False: "**no**", None: "–"}[a["identical"]]
        tps = _fmt(a["tokens_per_s"] if a["runs"] else None, ".1f")  # no run completed: no rate
        lines.append(f"| {label} | {tps} | {_fmt(sp['median'])}× [{_fmt(sp['min'])}, "
                     f"{_fmt(sp['max'])}] | {_fmt(a['mean_accepted_tokens'])} | {_fmt(a['acceptance_rate'])} | "
                     f"{_fmt(a['verification_rate'])} | {_fmt(a['discard_rate'])} | {_fmt(a['mean_draft_length'])} | "
                     f"{_fmt(None if frac is None else 100 * frac, '.0f')}{'%' if frac is not None else ''} | {ident} |")
    lines += _failure_lines(doc["aggregates"], len(doc["prompts"]), s.get("repeats", 1))
    lines += _oracle_lines(doc["oracle"], doc["aggregates"])
    lines += _policy_curve_lines(doc.get("policy_cost_curves"))
    lines += _parts_lines(doc.get("parts"))
    lines += _contention_lines(doc.get("contention", {"measured": False}))
    skipped = [c for c in doc["configs"] if c["skipped"]]
    if skipped:
        lines += ["", "Skipped:", *[f"- {c['label']}: {c['skipped']}" for c in skipped]]
    lines.append("")
    return "\n".join(lines)


def _failure_lines(aggregates: dict, prompts: int, repeats: int) -> list[str]:
    """The configurations that could not run some prompts (specd_bench.runner.run_guarded): how
    many, which, and why; their rows above are over the prompts they ran, their speedups over
    the prompts where `ar` ran too."""
    failing = {label: a for label, a in aggregates.items() if a.get("failed_runs")}
    if not failing:
        return []
    out = ["", "**Failed runs**: these configurations raised on some prompts and the run went on without "
               "them there; each row above is over the prompts it ran, and its speedups are only over the "
               "prompts where both it and `ar` ran. results.json keeps every failed record:"]
    for label, a in failing.items():
        runs = f", {a['failed_runs']} of {a['failed_runs'] + a['runs']} runs" if repeats > 1 else ""
        errors = list(a["errors"].items())
        why = "; ".join(reason + (f" ({n} runs)" if n > 1 and len(errors) > 1 else "") for reason, n in errors[:3])
        more = f"; and {len(errors) - 3} other errors" if len(errors) > 3 else ""
        none = "; no configuration has a speedup there" if label == BASELINE else ""
        out.append(f"- {label}: {len(a['failed_prompts'])} of {prompts} prompts failed "
                   f"({', '.join(a['failed_prompts'])}{runs}): {why}{more}{none}")
    return out


def _oracle_lines(oracle: dict, aggregates: dict) -> list[str]:
    if "skipped" in oracle:
        return ["", f"Oracle bound: skipped ({oracle['skipped']})."]
    if "failed" in oracle:
        return ["", f"Oracle bound: **failed** ({oracle['failed']}); the runs above are unaffected."]
    out = ["", f"Oracle bound (window {oracle['window']}):"]
    for kind, e in oracle["drafters"].items():
        c = e["cost_curve"]
        line = (f"- {kind}: {_fmt(e.get('tokens_per_s'), '.1f')} tok/s; t_draft {1e3 * c['t_draft_s']:.2f} ms/token, "
                f"t_target(1) {1e3 * c['t_target_s'][0]:.1f} ms, t_target({c['k'][-1]}) {1e3 * c['t_target_s'][-1]:.1f} ms")
        if "per_prompt" in e:
            v = sum(r["verifications"] for r in e["per_prompt"])
            n = sum(r["new_tokens"] for r in e["per_prompt"])
            line += f"; {v} verifications for {n} tokens"
            if "note" in e:
                line += f" ({e['note']})"
        if "best_fixed_k" in e:
            line += f"; best fixed K: {e['best_fixed_k']['config']} ({e['best_fixed_k']['tokens_per_s']:.1f} tok/s)"
        out.append(line)
        if e.get("failed_prompts"):
            why = "; ".join(dict.fromkeys(f["failed"] for f in e["failed_prompts"]))
            out.append(f"  - **not bounded on {len(e['failed_prompts'])} prompts** "
                       f"({', '.join(f['prompt'] for f in e['failed_prompts'])}): {why}")
        if e.get("tokens_per_s_at_ar_step"):
            out.append("  - " + _at_ar_step_line(kind, e, aggregates))
    return out


def _at_ar_step_line(kind: str, e: dict, aggregates: dict) -> str:
    """The same bound with each prompt's curve scaled to what `ar` paid per token on it: a check
    on the cost curve, which is measured once, on the first prompt."""
    rows = [r for r in e["per_prompt"] if r["ar_step_s"] is not None]
    decoded = sum(r["new_tokens"] - 1 for r in rows)
    steps = sum(r["ar_step_s"] * (r["new_tokens"] - 1) for r in rows) / decoded if decoded else 0.0
    fracs = ", ".join(f"{label} {100 * a['oracle_fraction_at_ar_step']:.0f}%" for label, a in aggregates.items()
                      if label.startswith(f"{kind}/") and a.get("oracle_fraction_at_ar_step") is not None)
    ar = aggregates.get(BASELINE, {}).get("tokens_per_s")
    vs_ar = f", {e['tokens_per_s_at_ar_step'] / ar:.2f}× ar" if ar else ""
    return (f"at `ar`'s own cost: each prompt's curve scaled so one target token costs what `ar` paid per token "
            f"on it ({1e3 * steps:.1f} ms mean, against the curve's t_target(1) "
            f"{1e3 * e['cost_curve']['t_target_s'][0]:.1f} ms): {e['tokens_per_s_at_ar_step']:.1f} tok/s{vs_ar}"
            + (f"; % of it: {fracs}" if fracs else ""))


def _policy_curve_lines(curves: dict | None) -> list[str]:
    """The cost curve the policies decided on (cost-aware, draft trees): the engine's start-up
    measurement and where the rounds' observations left it."""
    if not curves:
        return []

    def brief(c: dict) -> str:
        t = dict(zip(c["k"], c["t_target_s"]))
        return (f"t_draft {1e3 * c['t_draft_s']:.2f} ms, t_target(1) {1e3 * t[c['k'][0]]:.1f} ms"
                + (f", t_target(2) {1e3 * t[2]:.1f} ms" if 2 in t else ""))

    out = ["", "The policies' cost curve (cost-aware, draft trees), measured at start-up and followed by the rounds:"]
    for kind, c in curves.items():
        out.append(f"- {kind}: start {brief(c['start'])}" + (f"; end {brief(c['end'])}" if "end" in c else ""))
    return out


def _parts_lines(parts: list[dict] | None) -> list[str]:
    """A document joined by `specd bench-merge`: which runs it is made of (specd_bench.merge)."""
    if not parts:
        return []
    out = ["", f"Joined from {len(parts)} runs over disjoint prompts (`specd bench-merge`); every ratio is "
               "still against `ar` in the run that timed the prompt, and each run's oracle bounds used its own "
               "cost curve (the first run's is shown above):"]
    for p in parts:
        curves = "; ".join(f"{k}: t_draft {1e3 * c['t_draft_s']:.2f} ms, t_target(1) {1e3 * c['t_target_s'][0]:.1f} ms"
                           for k, c in p["cost_curves"].items())
        out.append(f"- {p['first_prompt']} to {p['last_prompt']} ({p['prompts']} prompts): `{p['results']}`"
                   + (f"; {curves}" if curves else ""))
    return out


def _contention_lines(c: dict) -> list[str]:
    """Whether other processes shared the CPUs, which prompts they disturbed, and the speedups
    without those prompts (specd_bench.contention)."""
    if not c["measured"]:
        return ["", "Machine contention: not measured (no /proc/stat)."]
    share = f"other processes' share of the CPUs during a run: mean {100 * c['mean_share']:.1f}%, max {100 * c['max_share']:.1f}%"
    if not c["disturbed"]:
        return ["", f"Machine contention: none above {100 * c['threshold']:.0f}% ({share})."]
    keys = ", ".join(f"{d['prompt']}" + (f" (repeat {d['repeat']})" if d["repeat"] else "") for d in c["disturbed"])
    out = ["", f"**Machine contention: {len(c['disturbed'])} of {c['runs']} prompt runs disturbed** (other processes took "
               f"more than {100 * c['threshold']:.0f}% of the CPUs during some configuration's run; {share}): {keys}. "
               "Their ratios are suspect; without them:", "",
           "| config | speedup median [spread] | aggregate |", "|---|---|---|"]
    for label, sp in c["undisturbed"].items():
        out.append(f"| {label} | {_fmt(sp['median'])}× [{_fmt(sp['min'])}, {_fmt(sp['max'])}] | {_fmt(sp['ratio_of_sums'])}× |")
    return out


def write_outputs(doc: dict, out: Path) -> list[Path]:
    """results.json, report.md and the PNG plots; returns the paths written."""
    from specd_bench.plots import write_plots

    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    (out / "report.md").write_text(report_md(doc))
    return [out / "results.json", out / "report.md", *write_plots(doc, out)]
