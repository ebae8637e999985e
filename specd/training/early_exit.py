"""Training the early-exit drafter's adapter by distillation from the target.

For every generated position of the corpus (specd.training.corpus) the target's next-token
distribution p is the teacher and the drafter's q the student:
    L = -sum_x p'(x) log q(x)        (cross-entropy with the teacher = KL(p'||q) + const)
where p' is p restricted to the draft vocabulary and renormalised (p itself for the whole
vocabulary). Distilling the whole distribution, not only the target's argmax, is what makes
q useful for sampling too: the acceptance probability of a sampled draft is sum min(p, q).

Both models read the same right-padded batch of whole sequences (prompt + answer), so the
`layer` adapter learns over real contexts with its own attention. The target's weights stay
frozen; only the adapter (and the extra layer) train, in float32 (bfloat16 autocast on
CUDA). A checkpoint after each epoch makes an interrupted run resume.

The reduced draft vocabulary (FR-Spec) is the `draft_vocab` most frequent tokens of the
corpus's answers, EOS always included.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from specd.drafters.early_exit import EarlyExitDrafter
from specd.errors import InvalidRequest
from specd.models.loading import LoadedModel
from specd.training.corpus import Answered


def choose_vocab(seqs: Sequence[Answered], size: int, vocab_size: int, always: Sequence[int] = ()) -> torch.Tensor:
    """The `size` most frequent answer tokens (plus `always`), as sorted ids."""
    if not 1 <= size <= vocab_size:
        raise InvalidRequest("draft_vocab", f"must be in [1, {vocab_size}], got {size}")
    counts = Counter(t for s in seqs for t in s.ids[s.prompt_len:])
    chosen = list(dict.fromkeys([*always, *(t for t, _ in counts.most_common(size))]))[:size]
    if len(chosen) < size:  # a tiny corpus: fill with the lowest unused ids
        used = set(chosen)
        chosen += [t for t in range(vocab_size) if t not in used][:size - len(chosen)]
    return torch.tensor(sorted(chosen), dtype=torch.long)


def coverage(seqs: Sequence[Answered], vocab_ids: torch.Tensor | None) -> float:
    """Fraction of answer tokens inside the draft vocabulary."""
    if vocab_ids is None:
        return 1.0
    keep = set(vocab_ids.tolist())
    tokens = [t for s in seqs for t in s.ids[s.prompt_len:]]
    return sum(t in keep for t in tokens) / max(1, len(tokens))


def batches(seqs: Sequence[Answered], batch_tokens: int, rng: random.Random | None,
            max_len: int) -> Iterator[list[Answered]]:
    """Batches of similar-length sequences holding about batch_tokens padded tokens each, in a
    shuffled order (rng None: in order)."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].ids))
    groups, cur, width = [], [], 0
    for i in order:
        n = min(len(seqs[i].ids), max_len)
        if cur and max(width, n) * (len(cur) + 1) > batch_tokens:
            groups.append(cur)
            cur, width = [], 0
        cur.append(seqs[i])
        width = max(width, n)
    if cur:
        groups.append(cur)
    if rng is not None:
        rng.shuffle(groups)
    yield from groups


def _pack(group: Sequence[Answered], max_len: int, pad: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [B, T], attention mask [B, T], and the mask of rows that predict an answer token."""
    width = min(max(len(s.ids) for s in group), max_len)
    ids = torch.full((len(group), width), pad, dtype=torch.long)
    attn = torch.zeros_like(ids)
    pred = torch.zeros_like(ids, dtype=torch.bool)
    for b, s in enumerate(group):
        row = s.ids[:width]
        ids[b, :len(row)] = torch.tensor(row)
        attn[b, :len(row)] = 1
        pred[b, max(0, s.prompt_len - 1):len(row) - 1] = True  # position t predicts token t+1
    return ids.to(device), attn.to(device), pred.to(device)


def _autocast(device: torch.device, dtype: torch.dtype):
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        return torch.autocast("cuda", dtype=dtype)
    return contextlib.nullcontext()


def _teacher(target: LoadedModel, ids, attn, pred) -> torch.Tensor:
    """The target's next-token probabilities [N, V] at the predicting rows."""
    with torch.no_grad():
        h = target.model.get_decoder()(input_ids=ids, attention_mask=attn).last_hidden_state
        return target.model.get_output_embeddings()(h[pred]).float().softmax(-1)


def _student(drafter: EarlyExitDrafter, ids, attn, pred) -> torch.Tensor:
    """The drafter's log q [N, V'] over its draft vocabulary at the predicting rows."""
    h = drafter.decoder(input_ids=ids, attention_mask=attn).last_hidden_state[pred]
    h = drafter.adapter(h)
    return (h @ drafter.head_weight.T).float().log_softmax(-1)


def _restrict(p: torch.Tensor, vocab_ids: torch.Tensor | None) -> torch.Tensor:
    if vocab_ids is None:
        return p
    sub = p[:, vocab_ids]
    return sub / sub.sum(-1, keepdim=True).clamp_min(1e-12)


@torch.no_grad()
def evaluate(target: LoadedModel, drafter: EarlyExitDrafter, seqs: Sequence[Answered], batch_tokens: int = 4096,
             max_len: int = 1024) -> dict:
    """Over the answer positions of seqs: top-1 agreement (draft argmax == target argmax, the
    greedy acceptance rate of one token), the expected acceptance of a T=1 sampled draft token
    sum_x min(p, q), and the distillation loss."""
    if not seqs:
        return {"positions": 0}
    device, dtype = target.device, next(target.model.parameters()).dtype
    pad = _pad_id(target)
    agree = accept = loss = 0.0
    n = 0
    for group in batches(seqs, batch_tokens, None, max_len):
        ids, attn, pred = _pack(group, max_len, pad, device)
        with _autocast(device, dtype):
            p = _teacher(target, ids, attn, pred)
            logq = _student(drafter, ids, attn, pred)
        q_sub = logq.exp()
        p_sub = p if drafter.vocab_ids is None else p[:, drafter.vocab_ids]
        draft_top = q_sub.argmax(-1)
        if drafter.vocab_ids is not None:
            draft_top = drafter.vocab_ids[draft_top]
        agree += (draft_top == p.argmax(-1)).sum().item()
        accept += torch.minimum(p_sub, q_sub).sum().item()
        loss += -(_restrict(p, drafter.vocab_ids) * logq).sum().item()
        n += p.shape[0]
    return {"positions": n, "top1_agreement": round(agree / n, 4), "expected_acceptance_t1": round(accept / n, 4),
            "loss": round(loss / n, 4)}


def _pad_id(target: LoadedModel) -> int:
    pad = target.model.generation_config.pad_token_id
    if pad is None:
        pad = min(target.eos_token_ids) if target.eos_token_ids else 0
    return int(pad)


def train_early_exit(target: LoadedModel, seqs: Sequence[Answered], out: Path, *, layers: int = 4,
                     adapter: str = "mlp", rank: int = 256, draft_vocab: int | None = None, epochs: int = 2,
                     lr: float = 1e-3, batch_tokens: int = 8192, max_len: int = 1024,
                     eval_seqs: dict[str, Sequence[Answered]] | None = None, holdout: float = 0.02,
                     seed: int = 0, checkpoint: Path | None = None) -> dict:
    """Train an adapter on seqs and write it to `out`; returns the report (also in the file's
    metadata): held-out agreement before and after, the vocabulary's coverage, timings."""
    if epochs < 1:
        raise InvalidRequest("epochs", f"must be at least 1, got {epochs}")
    if not 0 <= holdout < 1:
        raise InvalidRequest("holdout", f"must be in [0, 1), got {holdout}")
    seqs = [s for s in seqs if len(s.ids) > s.prompt_len]
    if not seqs:
        raise InvalidRequest("corpus", "holds no answered prompt to learn from")
    rng = random.Random(seed)
    shuffled = list(seqs)
    rng.shuffle(shuffled)
    n_hold = max(1, int(len(shuffled) * holdout)) if holdout > 0 and len(shuffled) > 1 else 0
    held, train = shuffled[:n_hold], shuffled[n_hold:]
    torch.manual_seed(seed)
    drafter = EarlyExitDrafter(target, layers, adapter=adapter, rank=rank)
    if draft_vocab:
        drafter.set_vocab(choose_vocab(train, draft_vocab, target.vocab_size, sorted(target.eos_token_ids)))
    device, dtype = target.device, next(target.model.parameters()).dtype
    evals = {"corpus-holdout": held, **(eval_seqs or {})}
    report: dict = {"layers": layers, "adapter": adapter, "rank": rank, "draft_vocab": draft_vocab or target.vocab_size,
                    "vocab_coverage": round(coverage(held or train, drafter.vocab_ids), 4),
                    "train_sequences": len(train), "train_positions": sum(len(s.ids) - s.prompt_len for s in train),
                    "epochs": epochs, "lr": lr, "seed": seed,
                    "before": {k: evaluate(target, drafter, v, batch_tokens, max_len) for k, v in evals.items() if v}}

    target.model.requires_grad_(False)  # only the adapter learns
    params = drafter.trainable().float().train().requires_grad_(True)
    opt = torch.optim.AdamW(params.parameters(), lr=lr, weight_decay=0.0)
    steps_per_epoch = sum(1 for _ in batches(train, batch_tokens, None, max_len))
    total = epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    start_epoch = 0
    if checkpoint is not None and checkpoint.is_file():
        state = torch.load(checkpoint, map_location=device, weights_only=False)
        if state.get("config") == _config(report):
            params.load_state_dict(state["params"])
            opt.load_state_dict(state["opt"])
            sched.load_state_dict(state["sched"])
            start_epoch = state["epoch"]
    pad = _pad_id(target)
    started = time.perf_counter()
    for epoch in range(start_epoch, epochs):
        epoch_rng = random.Random(seed * 1000 + epoch)
        bar = tqdm(batches(train, batch_tokens, epoch_rng, max_len), total=steps_per_epoch,
                   desc=f"epoch {epoch + 1}/{epochs}", unit="batch")
        for group in bar:
            ids, attn, pred = _pack(group, max_len, pad, device)
            with _autocast(device, dtype):
                p = _teacher(target, ids, attn, pred)
                logq = _student(drafter, ids, attn, pred)
            loss = -(_restrict(p, drafter.vocab_ids) * logq).sum(-1).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params.parameters(), 1.0)
            opt.step()
            sched.step()
            bar.set_postfix(loss=f"{loss.item():.3f}")
        if checkpoint is not None:
            torch.save({"config": _config(report), "params": params.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch + 1}, checkpoint)
    params.to(dtype).eval()
    report["train_seconds"] = round(time.perf_counter() - started, 1)
    report["after"] = {k: evaluate(target, drafter, v, batch_tokens, max_len) for k, v in evals.items() if v}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    drafter.save_adapter(out, train=report)
    return report


def _config(report: dict) -> dict:
    keys = ("layers", "adapter", "rank", "draft_vocab", "train_sequences", "epochs", "lr", "seed")
    return {k: report[k] for k in keys}
