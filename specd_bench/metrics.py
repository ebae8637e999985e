"""Benchmark metrics (docs/benchmarks.md; SpecDec++, Huang et al. 2024, §5).

Per run, with N new tokens, V verifications (target forwards; the prefill is the first),
D drafted and A accepted draft tokens:
    MAT               = A / V + 1          (accepted per verification + recovered/bonus token)
    acceptance rate   = A / D
    verification rate = V / N              (N_target / N)
    discard rate      = (D - A) / N        (N_discarded / N)
    speedup           = tokens/s of a configuration / tokens/s of target-only decoding,
                        per (prompt, repeat) in the same run; summarised by the median and
                        [min, max] over prompts x repeats, and by the ratio of sums.

A configuration (a peer, specd's own, or `ar` itself) that raised on a prompt has a failed
record there ({"failed": "ValueError: ..."}, no numbers), which keeps its place in the list so
that the runs stay paired with the baseline's; the aggregate is over the runs that completed and
counts the ones that failed, and the speedups are over the (prompt, repeat)s where both the
configuration and `ar` completed.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence

from specd.stats import GenerationStats

# Entropy bins (nats) for the analysis of SVIP's Table 1: acceptance against draft entropy.
ENTROPY_EDGES = [0.0, 0.05, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, float("inf")]


def entropy_bins(entropies: Sequence[float], accepted: Sequence[bool]) -> dict[str, list[int]]:
    """Counts of judged draft tokens per entropy bin, split by the verification outcome."""
    acc = [0] * (len(ENTROPY_EDGES) - 1)
    rej = [0] * (len(ENTROPY_EDGES) - 1)
    for h, ok in zip(entropies, accepted):
        i = next(j for j in range(len(acc)) if h < ENTROPY_EDGES[j + 1])
        (acc if ok else rej)[i] += 1
    return {"accepted": acc, "rejected": rej}


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


def run_record(stats: GenerationStats, token_ids: Sequence[int], baseline_ids: Sequence[int] | None) -> dict:
    """One (configuration, prompt, repeat) run of our engine as plain numbers."""
    n, wall = stats.new_tokens, stats.wall_time_s
    return {
        "new_tokens": n,
        "wall_time_s": wall,
        "tokens_per_s": _ratio(n, wall),
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "verifications": stats.verifications,
        "tree_rounds": stats.tree_rounds,
        "branch_accepted": stats.branch_accepted,
        "mean_accepted_tokens": stats.mean_accepted_tokens,
        "acceptance_rate": stats.acceptance_rate,
        "verification_rate": _ratio(stats.verifications, n),
        "discard_rate": _ratio(stats.drafted - stats.accepted, n),
        "mean_draft_length": _ratio(stats.drafted, len(stats.draft_lengths)),
        "draft_time_s": stats.draft_time_s,
        "verify_time_s": stats.verify_time_s,
        "overhead_time_s": wall - stats.draft_time_s - stats.verify_time_s,
        "draft_lengths": list(stats.draft_lengths),
        "accepted_lengths": list(stats.accepted_lengths),
        "entropy_bins": entropy_bins(stats.judged_entropies, stats.judged_accepted),
        "identical": None if baseline_ids is None else list(token_ids) == list(baseline_ids),
        "lossy": stats.lossy,
    }


def peer_record(token_ids: Sequence[int], wall: float, baseline_ids: Sequence[int] | None) -> dict:
    """A transformers peer run: only tokens and time are observable from outside generate()."""
    n = len(token_ids)
    return {"new_tokens": n, "wall_time_s": wall, "tokens_per_s": _ratio(n, wall),
            "identical": None if baseline_ids is None else list(token_ids) == list(baseline_ids)}


ERROR_CHARS = 200  # a failed record's reason: the exception's type and message, on one line


def failed_record(error: BaseException) -> dict:
    """A run that raised: why, in one short line (the benchmark goes on without it)."""
    message = " ".join(str(error).split())
    reason = f"{type(error).__name__}: {message}" if message else type(error).__name__
    return {"failed": reason if len(reason) <= ERROR_CHARS else reason[:ERROR_CHARS - 1] + "…"}


def failed(record: dict) -> bool:
    return bool(record.get("failed"))


def _completed(records: Sequence[dict], baseline: Sequence[dict]) -> tuple[list[dict], list[dict]]:
    """The runs that completed where the baseline's run of the same (prompt, repeat) completed
    too, and those baseline runs, paired in order (every list holds the same prompts x repeats
    in the same order)."""
    if not any(failed(r) for r in records) and not any(failed(b) for b in baseline):
        return list(records), list(baseline)
    pairs = [(r, b) for r, b in zip(records, baseline) if not failed(r) and not failed(b)]
    return [r for r, _ in pairs], [b for _, b in pairs]


def spread(values: Sequence[float]) -> dict:
    """Median and [min, max]; empty input gives None."""
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def speedups(records: Sequence[dict], baseline: Sequence[dict]) -> dict:
    """Per-run tokens/s ratios against the baseline run of the same (prompt, repeat), paired in
    order; a (prompt, repeat) where either failed is left out of both sides."""
    records, baseline = _completed(records, baseline)
    ratios = [_ratio(r["tokens_per_s"], b["tokens_per_s"]) for r, b in zip(records, baseline)]
    tps = _ratio(sum(r["new_tokens"] for r in records), sum(r["wall_time_s"] for r in records))
    base_tps = _ratio(sum(b["new_tokens"] for b in baseline), sum(b["wall_time_s"] for b in baseline))
    return {**spread(ratios), "ratio_of_sums": _ratio(tps, base_tps), "per_run": ratios}


def aggregate(records: Sequence[dict], baseline: Sequence[dict]) -> dict:
    """Totals over all completed runs of one configuration (sums first, then ratios), and which
    ones failed: failed_runs, failed_prompts (keys, in order) and errors (reason -> runs)."""
    failures = [r for r in records if failed(r)]
    done = [r for r in records if not failed(r)]
    total = {k: sum(r.get(k) or 0 for r in done)
             for k in ("new_tokens", "wall_time_s", "drafted", "accepted", "verifications",
                       "draft_time_s", "verify_time_s")}
    n, v, d, a = total["new_tokens"], total["verifications"], total["drafted"], total["accepted"]
    draft_lengths = [k for r in done for k in r.get("draft_lengths", [])]
    accepted_lengths = [k for r in done for k in r.get("accepted_lengths", [])]
    identical = [r["identical"] for r in done if r.get("identical") is not None]
    engine = "verifications" in done[0] if done else False
    return {
        **total,
        "runs": len(done),
        "failed_runs": len(failures),
        "failed_prompts": list(dict.fromkeys(r["prompt"] for r in failures if "prompt" in r)),
        "errors": dict(Counter(r["failed"] for r in failures)),
        "tokens_per_s": _ratio(n, total["wall_time_s"]),
        "speedup": speedups(records, baseline),
        "mean_accepted_tokens": _ratio(a, v) + 1.0 if engine and v else None,
        "acceptance_rate": _ratio(a, d) if engine else None,
        "verification_rate": _ratio(v, n) if engine else None,
        "discard_rate": _ratio(d - a, n) if engine else None,
        "mean_draft_length": _ratio(d, len(draft_lengths)) if engine else None,
        "draft_length_histogram": histogram(draft_lengths),
        "accepted_length_histogram": histogram(accepted_lengths),
        "entropy_bins": _sum_bins([r["entropy_bins"] for r in done if r.get("entropy_bins")]),
        "identical": all(identical) if identical else None,
    }


def histogram(values: Sequence[int]) -> dict[str, int]:
    """{length: count}, keys as strings so that the JSON round-trips."""
    return {str(k): c for k, c in sorted(Counter(values).items())}


def _sum_bins(bins: Sequence[dict]) -> dict | None:
    if not bins:
        return None
    return {"edges": ENTROPY_EDGES[:-1] + ["inf"],
            **{k: [sum(col) for col in zip(*(b[k] for b in bins))] for k in ("accepted", "rejected")}}
