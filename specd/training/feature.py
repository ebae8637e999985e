"""Training the feature drafter's head (specd.drafters.feature) by distillation.

Head position t reads the target's feature f_t and the token x_{t+1} and is trained on two
targets at once, as in EAGLE:
  * its next-token distribution q_t against the target's p_{t+1} (cross-entropy, as for the
    early-exit adapter: restricted to the draft vocabulary), and
  * its output against the target's next feature f_{t+1} (smooth L1, weight FEATURE_WEIGHT),
    so that the output can stand in for f_{t+1} when drafting past the verified prefix.
With `unroll` = 1 the head reads the target's true features everywhere (teacher forcing) and
learns only the first token drafted after a verified prefix. Past that token a session feeds
the head its own outputs, which it never saw in training, and acceptance past the first token
collapses (docs/engine.md measures it).
`unroll` = D > 1 trains depths 1..D at once, as EAGLE-3's "training-time test": depth d's row t
reads the head's own output of depth d - 1 at row t - 1 and attends exactly as a session does
(`FeatureDrafter.unrolled`), every row weighted alike, gradients flowing through the stand-ins.
Evaluation always reports depths 1..max(D, EVAL_DEPTH) (`by_depth`); the top-level numbers stay
those of the first token. Loop, batching, evaluation and checkpoints are the shared ones
(specd.training.early_exit.distill).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from specd.drafters.feature import FeatureDrafter
from specd.errors import InvalidRequest
from specd.runtime.loading import LoadedModel
from specd.training.corpus import Answered
from specd.training.early_exit import _teacher_features, _teacher_probs, distill, split_holdout

FEATURE_WEIGHT = 1.0
EVAL_DEPTH = 3  # depths the report always shows
MAX_UNROLL = 8


def check_unroll(unroll: int) -> None:
    if not 1 <= unroll <= MAX_UNROLL:
        raise InvalidRequest("unroll", f"must be in [1, {MAX_UNROLL}], got {unroll}")


def feature_step(target: LoadedModel, drafter: FeatureDrafter, ids, attn, pred, depth: int = 1):
    """(teacher p, student log q, feature loss, depth of each row) over depths 1..depth, at the
    head rows t whose target row t+1 predicts an answer token (and, at depth d, that have d - 1
    positions before them to be the verified prefix's end and its stand-in chain)."""
    f = _teacher_features(target, ids, attn)  # [B, T, H]
    rows = pred[:, 1:]  # head row t <-> target row t+1
    f_next = f[:, 1:]
    p_rows = _teacher_probs(target, f_next[rows])  # [N, V]: the same teacher at every depth
    outs = drafter.unrolled(f[:, :-1], ids[:, 1:], depth)
    ps, logqs, depths, feature_loss = [], [], [], 0.0
    for d, out in enumerate(outs, 1):
        keep = rows.clone()
        keep[:, :d - 1] = False
        sel = keep[rows]  # which of p_rows' rows this depth has
        h = out[keep]
        ps.append(p_rows[sel])
        logqs.append((h @ drafter.head_weight.T).float().log_softmax(-1))
        depths.append(torch.full((h.shape[0],), d, dtype=torch.long, device=h.device))
        feature_loss = feature_loss + F.smooth_l1_loss(h.float(), f_next[keep].float(), reduction="sum")
    elements = sum(x.shape[0] for x in depths) * f.shape[-1]  # smooth L1's mean over every row and unit
    return torch.cat(ps), torch.cat(logqs), FEATURE_WEIGHT * feature_loss / max(1, elements), torch.cat(depths)


def train_feature(target: LoadedModel, seqs: Sequence[Answered], out: Path, *, draft_vocab: int | None = None,
                  epochs: int = 2, lr: float = 1e-3, batch_tokens: int = 8192, max_len: int = 1024,
                  eval_seqs: dict[str, Sequence[Answered]] | None = None, holdout: float = 0.02, seed: int = 0,
                  checkpoint: Path | None = None, unroll: int = 1) -> dict:
    """Train a feature head on seqs (on its own stand-ins up to depth `unroll`) and write it to
    `out`; returns the report."""
    check_unroll(unroll)
    held, train = split_holdout(seqs, holdout, seed)
    torch.manual_seed(seed)
    drafter = FeatureDrafter(target)
    report = {"kind": "feature", "feature_weight": FEATURE_WEIGHT, "unroll": unroll}
    return distill(target, drafter, drafter.head, partial(feature_step, depth=unroll), drafter.save, train, held,
                   out, report, draft_vocab=draft_vocab, epochs=epochs, lr=lr, batch_tokens=batch_tokens,
                   max_len=max_len, eval_seqs=eval_seqs, seed=seed, checkpoint=checkpoint,
                   eval_step=partial(feature_step, depth=max(unroll, EVAL_DEPTH)))
