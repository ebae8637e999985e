"""`specd bench-dvi`: does online learning (DVI) make a drafter agree more with its target?

A stream of prompts is decoded one after the other with speculative decoding; every verified
window is logged to a replay stream, and after each prompt the trainer makes
`updates_per_record` updates per new record and the new adapter is swapped into the drafter.
Every prompt is therefore unseen when it is decoded (prequential evaluation). Per prompt:
  - the live acceptance rate of the speculative run (drafts accepted / drafted);
  - the teacher-forced top-1 agreement of the drafter on the target's own answer, with the
    adapter it had when the prompt arrived and, as the control, with no adapter (frozen);
  - whether the output equals target-only decoding (greedy or seeded; it must, always).
The frozen control on the same prompt separates learning from prompts that are simply easier.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from specd_bench.oracle import teacher_forced_agreement
from specd.drafters.base import Drafter
from specd.dvi import MemoryReplayStream, TrainerConfig, trainer_for
from specd.engine import SpeculativeEngine
from specd.runtime.loading import LoadedModel
from specd.types import SamplingParams, SpecParams


def run_dvi_bench(target: LoadedModel, drafter: Drafter, prompts: list[list[int]], sampling: SamplingParams,
                  spec: SpecParams, config: TrainerConfig, updates_per_record: float,
                  progress: bool = True) -> dict:
    replay = MemoryReplayStream()
    engine = SpeculativeEngine(target, drafter, replay=replay)
    reference = SpeculativeEngine(target)
    trainer = trainer_for(drafter, config)
    drafter.set_lora(None)
    rows, last, debt = [], 0, 0.0
    bar = _bar(len(prompts), progress)
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        ref = reference.generate(prompt, sampling, SpecParams("none")).token_ids
        updates = trainer.steps
        learned = _agreement(drafter, prompt, ref, target.vocab_size)
        lora = drafter.lora
        drafter.set_lora(None)
        frozen = _agreement(drafter, prompt, ref, target.vocab_size)
        drafter.set_lora(lora)
        out = engine.generate(prompt, sampling, spec)
        new = replay.read(last, 1 << 30)
        if new:
            last = new[-1][0]
            trainer.add([r for _, r in new])
        debt += updates_per_record * len(new)
        losses = []
        while debt >= 1:
            losses.append(trainer.step()["loss"])
            debt -= 1
        if trainer.steps > updates:
            drafter.set_lora(trainer.snapshot())
        s = out.stats
        rows.append({"prompt": i, "updates": updates, "records": len(new), "drafted": s.drafted,
                     "accepted": s.accepted, "acceptance_rate": s.accepted / s.drafted if s.drafted else None,
                     "agreement": learned, "agreement_frozen": frozen,
                     "identical": out.token_ids == ref if sampling.greedy or sampling.coupled else None,
                     "loss": sum(losses) / len(losses) if losses else None})
        bar.update(1)
        bar.set_postfix(updates=trainer.steps, acc=f"{rows[-1]['acceptance_rate'] or 0:.2f}",
                        agree=f"{learned:.2f}/{frozen:.2f}")
    bar.close()
    return {"rows": rows, "updates": trainer.steps, "records": trainer.seen,
            "wall_time_s": round(time.perf_counter() - started, 1), "summary": summarise(rows)}


def _agreement(drafter, prompt, output, vocab_size) -> float:
    agree = teacher_forced_agreement(drafter, prompt, output, vocab_size)
    return sum(agree) / len(agree) if agree else 0.0


def summarise(rows: list[dict], first: int = 8, after: int = 2000) -> dict:
    """Acceptance and agreement on the first prompts (no or few updates) and on the prompts
    decoded after `after` updates, each beside the frozen drafter's agreement on those prompts."""
    def mean(xs):
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else None

    def part(rs):
        drafted = sum(r["drafted"] for r in rs)
        return {"prompts": len(rs), "acceptance_rate": sum(r["accepted"] for r in rs) / drafted if drafted else None,
                "agreement": mean(r["agreement"] for r in rs), "agreement_frozen": mean(r["agreement_frozen"] for r in rs)}

    start, late = part(rows[:first]), part([r for r in rows if r["updates"] >= after])
    out = {"start": start, f"after_{after}": late, "identical": all(r["identical"] is not False for r in rows)}
    if late["prompts"] and start["acceptance_rate"]:
        out["acceptance_ratio"] = late["acceptance_rate"] / start["acceptance_rate"]
    if late["prompts"] and late["agreement_frozen"]:
        out["agreement_ratio_vs_frozen"] = late["agreement"] / late["agreement_frozen"]
    return out


def write_dvi_outputs(doc: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "report.md", out / "dvi-agreement.png"]
    paths[0].write_text(json.dumps(doc, indent=2))
    s = doc["summary"]
    lines = [f"# DVI online learning: {doc['drafter']} on {doc['target']}", "",
             f"`{doc['command']}`", "",
             (f"{len(doc['rows'])} prompts of `{doc.get('dataset', '?')}`, {doc['records']} records, "
              f"{doc['updates']} updates, "
              f"{doc['wall_time_s']} s. Output identical to target-only decoding on every prompt: "
              f"{'yes' if s['identical'] else 'NO'}."), "",
             "| prompts | n | acceptance (live) | agreement (learning) | agreement (frozen, same prompts) |",
             "|---|---|---|---|---|"]
    for name, part in s.items():
        if isinstance(part, dict):
            lines.append(f"| {name} | {part['prompts']} | {_pct(part['acceptance_rate'])} | "
                         f"{_pct(part['agreement'])} | {_pct(part['agreement_frozen'])} |")
    for key in ("acceptance_ratio", "agreement_ratio_vs_frozen"):
        if key in s:
            lines.append(f"\n{key.replace('_', ' ')}: {s[key]:.2f}x")
    paths[1].write_text("\n".join(lines) + "\n")
    _plot(doc["rows"], paths[2])
    return paths


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["updates"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label, style in (("acceptance_rate", "live acceptance rate", "o"),
                              ("agreement", "top-1 agreement, learning", "s"),
                              ("agreement_frozen", "top-1 agreement, frozen", "^")):
        y = [r[key] if r[key] is not None else math.nan for r in rows]
        ax.plot(x, y, style, ms=3, alpha=0.35)
        ax.plot(x, _rolling(y, 8), "-", label=f"{label} (8-prompt mean)", color=ax.lines[-1].get_color())
    ax.set_xlabel("online updates before the prompt")
    ax.set_ylabel("rate")
    ax.set_ylim(0, None)
    ax.legend(fontsize=8)
    ax.set_title("DVI: each prompt unseen when decoded")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _rolling(y: list[float], w: int) -> list[float]:
    out = []
    for i in range(len(y)):
        xs = [v for v in y[max(0, i - w + 1):i + 1] if not math.isnan(v)]
        out.append(sum(xs) / len(xs) if xs else math.nan)
    return out


def _bar(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="dvi", unit="prompt", disable=not enabled)
