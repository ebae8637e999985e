"""Training the feature drafter's head (specd.drafters.feature) by distillation.

Head position t reads the target's feature f_t and the token x_{t+1} and is trained on two
targets at once, as in EAGLE:
  * its next-token distribution q_t against the target's p_{t+1} (cross-entropy, as for the
    early-exit adapter: restricted to the draft vocabulary), and
  * its output against the target's next feature f_{t+1} (smooth L1, weight FEATURE_WEIGHT),
    so that the output can stand in for f_{t+1} when drafting past the verified prefix.
Training reads the target's true features everywhere (teacher forcing); the reported agreement
is that of the first token drafted after a verified prefix. Loop, batching, evaluation and
checkpoints are the shared ones (specd.training.early_exit.distill).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from specd.drafters.feature import FeatureDrafter
from specd.models.loading import LoadedModel
from specd.training.corpus import Answered
from specd.training.early_exit import _teacher_features, _teacher_probs, distill, split_holdout

FEATURE_WEIGHT = 1.0


def feature_step(target: LoadedModel, drafter: FeatureDrafter, ids, attn, pred):
    """(teacher p, student log q, feature loss) at the head rows t whose target row t+1
    predicts an answer token."""
    f = _teacher_features(target, ids, attn)  # [B, T, H]
    rows = pred[:, 1:]  # head row t <-> target row t+1
    out = drafter.run(f[:, :-1], ids[:, 1:], attention_mask=attn[:, 1:])[rows]
    f_next = f[:, 1:][rows]
    logq = (out @ drafter.head_weight.T).float().log_softmax(-1)
    return _teacher_probs(target, f_next), logq, FEATURE_WEIGHT * F.smooth_l1_loss(out.float(), f_next.float())


def train_feature(target: LoadedModel, seqs: Sequence[Answered], out: Path, *, draft_vocab: int | None = None,
                  epochs: int = 2, lr: float = 1e-3, batch_tokens: int = 8192, max_len: int = 1024,
                  eval_seqs: dict[str, Sequence[Answered]] | None = None, holdout: float = 0.02, seed: int = 0,
                  checkpoint: Path | None = None) -> dict:
    """Train a feature head on seqs and write it to `out`; returns the report."""
    held, train = split_holdout(seqs, holdout, seed)
    torch.manual_seed(seed)
    drafter = FeatureDrafter(target)
    report = {"kind": "feature", "feature_weight": FEATURE_WEIGHT}
    return distill(target, drafter, drafter.head, feature_step, drafter.save, train, held, out, report,
                   draft_vocab=draft_vocab, epochs=epochs, lr=lr, batch_tokens=batch_tokens, max_len=max_len,
                   eval_seqs=eval_seqs, seed=seed, checkpoint=checkpoint)
