"""PNG plots of a results document (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)


def write_plots(doc: dict, out: Path) -> list[Path]:
    return [speedup_plot(doc, out / "speedup.png"),
            histogram_plot(doc, "draft_length_histogram", "tokens drafted per round",
                           out / "draft_lengths.png"),
            histogram_plot(doc, "accepted_length_histogram", "draft tokens accepted per verification",
                           out / "accepted_lengths.png"),
            entropy_plot(doc, out / "entropy.png")]


def speedup_plot(doc: dict, path: Path) -> Path:
    """Median speedup per configuration with its [min, max] spread; 1.0 = target alone."""
    aggs = doc["aggregates"]
    labels = list(aggs)
    med = [aggs[k]["speedup"]["median"] or 0.0 for k in labels]
    lo = [m - (aggs[k]["speedup"]["min"] or 0.0) for k, m in zip(labels, med)]
    hi = [(aggs[k]["speedup"]["max"] or 0.0) - m for k, m in zip(labels, med)]
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(labels) + 2), 4.5))
    ax.bar(range(len(labels)), med, yerr=[lo, hi], capsize=3, color="tab:blue")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("speedup over target alone (median, min–max)")
    ax.set_title(f"specd bench: {doc['target']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def histogram_plot(doc: dict, key: str, xlabel: str, path: Path) -> Path:
    """One small histogram per speculative configuration (peers and the baseline have none)."""
    hists = {k: a[key] for k, a in doc["aggregates"].items() if a.get(key)}
    n = max(len(hists), 1)
    cols = min(4, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.4 * rows), squeeze=False)
    for ax, (label, hist) in zip(axes.flat, hists.items()):
        xs = [int(x) for x in hist]
        ax.bar(xs, list(hist.values()), color="tab:orange")
        ax.set_title(label, fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(hists):]:
        ax.axis("off")
    if not hists:
        axes.flat[0].text(0.5, 0.5, "no speculative rounds", ha="center", va="center")
    fig.supxlabel(xlabel, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def entropy_plot(doc: dict, path: Path) -> Path:
    """SVIP's Table 1 analysis per drafter (its configurations pooled): where judged draft
    tokens fall in entropy, accepted vs rejected (left), and the acceptance rate per entropy bin
    (right). Point-mass drafters (n-gram: H = 0 always) carry no information and are left out."""
    pooled: dict[str, dict] = {}
    edges: list = []
    for label, agg in doc["aggregates"].items():
        b = agg.get("entropy_bins")
        if not b or "/" not in label:
            continue
        edges = b["edges"]
        p = pooled.setdefault(label.split("/")[0], {"accepted": [0] * len(b["accepted"]),
                                                     "rejected": [0] * len(b["rejected"])})
        for key in ("accepted", "rejected"):
            p[key] = [x + y for x, y in zip(p[key], b[key])]
    pooled = {d: b for d, b in pooled.items() if sum(b["accepted"][1:]) + sum(b["rejected"][1:])}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for drafter, b in pooled.items():
        acc, rej = b["accepted"], b["rejected"]
        xs = list(range(len(acc)))
        left.plot(xs, [a / max(sum(acc), 1) for a in acc], marker="o", label=f"{drafter}: accepted")
        left.plot(xs, [r / max(sum(rej), 1) for r in rej], marker="x", linestyle="--", label=f"{drafter}: rejected")
        right.plot(xs, [a / (a + r) if a + r else float("nan") for a, r in zip(acc, rej)], marker="o",
                   label=f"{drafter} ({sum(acc) + sum(rej)} tokens)")
    for ax in (left, right):
        ax.set_xticks(range(len(edges) - 1), [f"{e}+" for e in edges[:-1]], rotation=45, fontsize=7)
        ax.set_xlabel("draft entropy H(q), nats (bin lower edge)")
    left.set_ylabel("fraction of judged tokens")
    left.set_title("entropy of accepted vs rejected draft tokens", fontsize=9)
    right.set_ylabel("acceptance rate")
    right.set_title("acceptance rate by entropy bin", fontsize=9)
    if pooled:
        left.legend(fontsize=7)
        right.legend(fontsize=7)
    else:
        left.text(0.5, 0.5, "no model drafter with judged tokens", ha="center", va="center",
                  transform=left.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
