"""What drafting one window costs the process that drafts it, per round: a lookup drafter's
walk and its stopping policy's decisions, without the target's forward. Where the target drafts
for its own sessions (docs/services.md, "Drafting on the target"), this is serial work between
two forwards for every session in them; on a GPU, whose forward is a few milliseconds, it bounds
how many sessions one target can draft for.

The target answers the prompts alone first (greedy, and seeded at T = 1); drafting is then
replayed against those answers: each window is judged as the target would judge it (a draft is
kept while it is the target's own token), so every round and every decision is the engine's,
and the policy is priced on a frozen cost curve (`--curve`: the one measured for this pair here,
or a gpu_check.json's), so that two runs decide alike and their times compare.

The same replay prices each round on that curve (`speedup_on_curve`): what speculation would
gain over the target alone where a forward costs what the curve says, a drafted token its
t_draft (`--t-draft-ms`), and the work around a forward what that gpu_check.json's target alone
paid beyond it. With the `oracle` policy (drafting exactly what the target keeps) it is the bound
any stopping policy has with that drafter on that device's curve.

    python scripts/draft_cost.py --dataset mt_bench_question.jsonl --prompts 24 \
        --curve docs/bench/gpu-h200/gpu_check.json --out draft_cost.json

With `--others N` and a bench-load results.json as the curve, every window is priced in a forward
of N other sessions on that run's batched surface: how often the policy asks its drafter under
that load (`drafter_ran`) and what those rounds cost the host.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specd_bench.datasets import load_questions
from specd.costs import (CostCurve, cpu_model, measure_cost_curve, measure_t_draft, provenance,
                         synthetic_prefix)
from specd.drafters import build_drafter
from specd.engine import SpeculativeEngine
from specd.runtime import load_model
from specd.policies import PolicyResources, request_policy
from specd.speculation.pace import PaceClock
from specd.speculation.proposer import Commit, Proposer, Token
from specd.sampling import race_row, request_generator
from specd.types import SamplingParams, SpecParams

RACE_ROWS = 4  # seeded sampling: a round's first rows of race noise, drawn outside the timer


def frozen_curve(path: str | None, target, drafter, t_draft: float | None = None, others: int = 0) -> CostCurve:
    """The policy's prices, frozen: from a gpu_check.json (milliseconds), else measured here;
    t_draft (seconds) replaces the price of a drafted token. others: with a bench-load
    results.json, every window joins a forward of that many other sessions taking plain steps,
    priced on its batched surface (`target_costs`)."""
    doc = json.loads(Path(path).read_text()) if path is not None else None
    if others and (doc is None or "target_costs" not in doc):
        raise SystemExit("--others needs a bench-load results.json as --curve (its batched surface)")
    if doc is None:
        curve = measure_cost_curve(target, drafter)
        measured, ks, ts = curve.t_draft, curve.ks, [curve.scale * t for t in curve.t_target_k]
    elif "target_costs" in doc:  # bench-load's (a virtual device's profile)
        surface = doc["target_costs"]
        ts = surface["verify_s"]
        measured, ks = measure_t_draft(drafter, synthetic_prefix(target.vocab_size)), list(range(1, len(ts) + 1))
        if others:
            return CostCurve(measured if t_draft is None else t_draft, ks, ts, smoothing=0.0,
                             batch_seconds=surface["batch_s"], batch_token_seconds=surface["batch_token_s"],
                             others=(float(others), float(others)), load_smoothing=0.0)
    else:
        c = next(iter(doc["speculation"]["cost_curve_ms"].values()))
        measured, ts = c["t_draft"] * 1e-3, [t * 1e-3 for t in c["t_target_k"]]
        ks = list(range(1, len(ts) + 1))
    return CostCurve(measured if t_draft is None else t_draft, ks, ts, smoothing=0.0)


def host_times(path: str | None, curve: CostCurve) -> dict[str, float]:
    """Seconds a gpu_check.json's target alone paid per token beyond its curve's one-token
    forward, greedy and seeded (the work around a forward: sampling, race noise, bookkeeping);
    nothing for a curve measured here."""
    if path is None:
        return {"greedy": 0.0, "t1-seeded": 0.0}
    doc = json.loads(Path(path).read_text())
    if "speculation" not in doc:  # a bench-load profile: the forwards alone
        return {"greedy": 0.0, "t1-seeded": 0.0}
    spec = doc["speculation"]
    runs = {"greedy": doc.get("target_alone", {}).get(spec.get("baseline")), "t1-seeded": spec.get("t1_baseline")}
    return {label: max(run["seconds"] / run["tokens"] - curve.t_target(1), 0.0) if run else 0.0
            for label, run in runs.items()}


def replay(drafter, policy: str, curve: CostCurve, answers: list[tuple[list[int], list[int]]],
           sampling: SamplingParams, vocab_size: int, host: float = 0.0) -> dict:
    """Draft every round of these (prompt, target's answer) pairs; the policy's state carries
    over from one answer to the next, as a service's does. Every round is also priced on the
    curve, plus `host` seconds of work around each forward, against the target alone's one
    forward per token (each answer's first token included on both sides, as a decode step);
    the curve's own t_draft prices the drafting."""
    state: dict[str, float] = {}
    seconds, priced, rounds, drafted, accepted, ran = 0.0, 0.0, 0, 0, 0, 0
    for prompt, answer in answers:
        spec = SpecParams(policy)
        reference = tuple(answer) if policy == "oracle" else None  # the oracle's knowledge: what the target generates
        rule = request_policy(spec, state, PolicyResources(reference, None), lambda: curve)
        session = drafter.open(vocab_size)
        events: list = []
        # The draft side of the round as the target drafts for its sessions (services.target.drafting).
        proposer = Proposer(session, rule, sampling, list(prompt), max_length=len(prompt) + sampling.max_new_tokens,
                            lookahead=1, send_q=False, publish=events.append, round_trip=False,
                            generator=request_generator(sampling))
        proposer.pace = PaceClock(None)  # priced below on the curve, not timed: alike every run
        seq, at = list(prompt), 0
        while at < len(answer):
            if sampling.coupled:  # the race noise rows verification reads anyway, drawn before the timer
                for position in range(len(seq), min(len(seq) + RACE_ROWS, len(prompt) + sampling.max_new_tokens)):
                    race_row(sampling.seed, position, vocab_size)
            t0 = time.perf_counter()
            asked = False
            while (ready := proposer.prepare()) is not None:
                window, epoch, after = ready
                t1 = time.perf_counter()
                d = proposer.next(after)
                proposer.drafted(window, epoch, after, d, time.perf_counter() - t1)
                asked = True
            tokens = [e.token for e in events if isinstance(e, Token)]
            events.clear()
            n = 0
            while n < len(tokens) and at + n < len(answer) and tokens[n] == answer[at + n]:
                n += 1
            # Past an answer's EOS the target's next token is not known: that last window is not
            # observed, the one place the engine may judge otherwise.
            if at + n < len(answer):
                proposer.commit(Commit(rounds + 1, tuple(answer[at:at + n + 1]), len(tokens), n))
                events.clear()
            seconds += time.perf_counter() - t0
            rule.observe_pace(n + 1, curve.round_time(len(tokens)), asked)  # priced, not timed: alike every run
            priced += curve.round_time(len(tokens)) + host
            rounds, drafted, accepted, ran = rounds + 1, drafted + len(tokens), accepted + n, ran + asked
            seq += answer[at:at + n + 1]
            at += n + 1
        state = rule.state()
        session.close()
    tokens = sum(len(a) for _, a in answers)
    return {"rounds": rounds, "drafted": drafted, "accepted": accepted, "drafter_ran": ran,
            "tokens_per_round": round(tokens / max(rounds, 1), 3),
            "priced_ms_per_round": round(1e3 * priced / max(rounds, 1), 4),
            # over the target alone on the same curve and host time, drafting at the curve's t_draft
            "speedup_on_curve": round(tokens * (curve.t_target(1) + host) / priced, 4)
            if priced and not curve.loaded() else None,
            "us_per_round": round(1e6 * seconds / max(rounds, 1), 1),
            "us_per_drafted": round(1e6 * seconds / max(drafted, 1), 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target-model", default="embedded")
    p.add_argument("--dataset", type=Path, help="JSONL with a 'turns' list per line (default: the built-in prompts)")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--drafters", default="retrieval,ngram")
    p.add_argument("--policies", default="cost-aware", help="comma-separated; 'oracle' drafts exactly "
                   "what the target keeps: on --curve, the bound of any stopping policy for the drafter")
    p.add_argument("--curve", help="a gpu_check.json whose cost curve prices the windows, or a bench-load "
                                   "results.json (its target_costs' one-session forwards; a virtual device's "
                                   "profile); default: measured here")
    p.add_argument("--t-draft-ms", type=float, help="the price of a drafted token (default: the curve's); "
                   "a serving engine prices drafting at the time it measures it taking")
    p.add_argument("--others", type=int, default=0, help="with a bench-load results.json as --curve: every "
                   "window joins a forward of this many other sessions' plain steps, priced on its batched surface "
                   "(how often the policy asks its drafter under that load: drafter_ran)")
    p.add_argument("--samplings", default="greedy,t1-seeded")
    p.add_argument("--repeats", type=int, default=3, help="replays of each cell; the fastest is kept")
    p.add_argument("--answers", type=Path, help="the target's answers: read from this file if it exists, else "
                                                "written there with the prompts (two runs replay the same "
                                                "answers; a virtual device can replay them: --virtual-replay)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    target = load_model(args.target_model, "cpu", "float32")
    prompts = [target.encode_prompt([{"role": "user", "content": q.turns[0]}], chat=True)
               for q in load_questions(args.dataset, limit=args.prompts)]
    alone = SpeculativeEngine(target)
    kept = json.loads(args.answers.read_text()) if args.answers is not None and args.answers.is_file() else None
    written: dict[str, list[list[int]]] = {}
    out = {"machine": cpu_model(), "provenance": provenance(), "target": target.name, "prompts": len(prompts),
           "max_new_tokens": args.max_new_tokens, "curve": args.curve or "measured", "others": args.others, "cells": {}}
    samplings = {"greedy": SamplingParams(max_new_tokens=args.max_new_tokens),
                 "t1-seeded": SamplingParams(1.0, seed=0, max_new_tokens=args.max_new_tokens)}
    drafters = {}  # kind: (drafter, its frozen curve, host seconds per sampling), built once for every sampling
    t_draft = None if args.t_draft_ms is None else args.t_draft_ms * 1e-3
    for kind in args.drafters.split(","):
        drafter = build_drafter(kind, target)
        curve = frozen_curve(args.curve, target, drafter, t_draft, args.others)
        drafters[kind] = drafter, curve, host_times(args.curve, curve)
    for label in args.samplings.split(","):
        sampling = samplings[label]
        answers = [(ids, kept[label][i] if kept else alone.generate(ids, sampling, SpecParams("none")).token_ids)
                   for i, ids in enumerate(prompts)]
        written[label] = [a for _, a in answers]
        for kind, (drafter, curve, host) in drafters.items():
            for policy in args.policies.split(","):
                runs = [replay(drafter, policy, curve, answers, sampling, target.vocab_size, host[label])
                        for _ in range(args.repeats)]
                best = min(runs, key=lambda r: r["us_per_round"])
                out["cells"][f"{label} {kind}/{policy}"] = best
                print(f"{label} {kind}/{policy}: {best}", flush=True)
    if args.answers is not None and kept is None and set(written) == set(samplings):
        # with the prompts, the file is also a virtual device's replay (specd/runtime/virtual.py)
        args.answers.write_text(json.dumps({**written, "prompts": prompts, "target": target.name}))
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
