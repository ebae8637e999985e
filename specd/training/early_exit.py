"""Training the early-exit drafter's adapter by distillation from the target, and the
distillation loop every drafter kind shares (`distill`; the feature head's step is in
specd.training.feature).

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
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from specd.drafters.early_exit import EarlyExitDrafter
from specd.errors import InvalidRequest
from specd.runtime.loading import LoadedModel
from specd.training.corpus import Answered

# (target, drafter, ids, attn, pred) -> (teacher p [N, V], student log q [N, V'], extra loss | None,
# drafting depth of each row [N] | None: all depth 1)
Step = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]]


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


def _teacher_features(target: LoadedModel, ids, attn) -> torch.Tensor:
    """The target's last hidden states [B, T, H] (after its final norm)."""
    with torch.no_grad():
        return target.model.get_decoder()(input_ids=ids, attention_mask=attn).last_hidden_state


def _teacher_probs(target: LoadedModel, f: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return target.model.get_output_embeddings()(f).float().softmax(-1)


def early_exit_step(target: LoadedModel, drafter: EarlyExitDrafter, ids, attn, pred
                    ) -> tuple[torch.Tensor, torch.Tensor, None, None]:
    """(teacher p [N, V], student log q [N, V'] over the draft vocabulary, no extra loss, every
    row depth 1) at the rows that predict an answer token."""
    p = _teacher_probs(target, _teacher_features(target, ids, attn)[pred])
    h = drafter.adapter(drafter.decoder(input_ids=ids, attention_mask=attn).last_hidden_state[pred])
    return p, (h @ drafter.head_weight.T).float().log_softmax(-1), None, None


def _restrict(p: torch.Tensor, vocab_ids: torch.Tensor | None) -> torch.Tensor:
    if vocab_ids is None:
        return p
    sub = p[:, vocab_ids]
    return sub / sub.sum(-1, keepdim=True).clamp_min(1e-12)


@torch.no_grad()
def evaluate(target: LoadedModel, drafter, seqs: Sequence[Answered], batch_tokens: int = 4096,
             max_len: int = 1024, step: Step | None = None) -> dict:
    """Over the answer positions of seqs: top-1 agreement (draft argmax == target argmax, the
    greedy acceptance rate of one token), the expected acceptance of a T=1 sampled draft token
    sum_x min(p, q), and the distillation loss. (For the feature drafter: of its first token
    after a verified prefix, with the target's own features; where the step also drafts deeper,
    `by_depth` gives the same numbers for the d-th token past the prefix.)"""
    step = step or early_exit_step
    if not seqs:
        return {"positions": 0}
    device, dtype = target.device, next(target.model.parameters()).dtype
    pad = _pad_id(target)
    sums: dict[int, list[float]] = {}  # depth -> [agree, accept, loss, n]
    for group in batches(seqs, batch_tokens, None, max_len):
        ids, attn, pred = _pack(group, max_len, pad, device)
        with _autocast(device, dtype):
            p, logq, _, depths = step(target, drafter, ids, attn, pred)
        q_sub = logq.exp()
        p_sub = p if drafter.vocab_ids is None else p[:, drafter.vocab_ids]
        draft_top = q_sub.argmax(-1)
        if drafter.vocab_ids is not None:
            draft_top = drafter.vocab_ids[draft_top]
        rows = torch.stack([(draft_top == p.argmax(-1)).float(), torch.minimum(p_sub, q_sub).sum(-1),
                            -(_restrict(p, drafter.vocab_ids) * logq).sum(-1)], 1)
        if depths is None:
            depths = torch.ones(p.shape[0], dtype=torch.long, device=p.device)
        for d in depths.unique().tolist():
            acc = sums.setdefault(d, [0.0, 0.0, 0.0, 0])
            sel = rows[depths == d]
            for k, v in enumerate(sel.sum(0).tolist()):
                acc[k] += v
            acc[3] += sel.shape[0]

    def summary(agree: float, accept: float, loss: float, n: int) -> dict:
        return {"positions": n, "top1_agreement": round(agree / n, 4),
                "expected_acceptance_t1": round(accept / n, 4), "loss": round(loss / n, 4)}

    report = summary(*sums[1]) if 1 in sums else {"positions": 0}
    if len(sums) > 1:
        report["by_depth"] = {str(d): summary(*sums[d]) for d in sorted(sums)}
    return report


def _pad_id(target: LoadedModel) -> int:
    pad = target.model.generation_config.pad_token_id
    if pad is None:
        pad = min(target.eos_token_ids) if target.eos_token_ids else 0
    return int(pad)


def split_holdout(seqs: Sequence[Answered], holdout: float, seed: int) -> tuple[list[Answered], list[Answered]]:
    """(held out, train): answered sequences in a seeded order, at least one held out when asked."""
    if not 0 <= holdout < 1:
        raise InvalidRequest("holdout", f"must be in [0, 1), got {holdout}")
    shuffled = [s for s in seqs if len(s.ids) > s.prompt_len]
    if not shuffled:
        raise InvalidRequest("corpus", "holds no answered prompt to learn from")
    random.Random(seed).shuffle(shuffled)
    n_hold = max(1, int(len(shuffled) * holdout)) if holdout > 0 and len(shuffled) > 1 else 0
    return shuffled[:n_hold], shuffled[n_hold:]


def train_early_exit(target: LoadedModel, seqs: Sequence[Answered], out: Path, *, layers: int = 4,
                     adapter: str = "mlp", rank: int = 256, draft_vocab: int | None = None, epochs: int = 2,
                     lr: float = 1e-3, batch_tokens: int = 8192, max_len: int = 1024,
                     eval_seqs: dict[str, Sequence[Answered]] | None = None, holdout: float = 0.02,
                     seed: int = 0, checkpoint: Path | None = None) -> dict:
    """Train an early-exit adapter on seqs and write it to `out`; returns the report (also in
    the file's metadata): held-out agreement before and after, the vocabulary's coverage, timings."""
    held, train = split_holdout(seqs, holdout, seed)
    torch.manual_seed(seed)
    drafter = EarlyExitDrafter(target, layers, adapter=adapter, rank=rank)
    report = {"kind": "early-exit", "layers": layers, "adapter": adapter, "rank": rank}
    return distill(target, drafter, drafter.trainable(), early_exit_step, drafter.save_adapter, train, held, out,
                   report, draft_vocab=draft_vocab, epochs=epochs, lr=lr, batch_tokens=batch_tokens,
                   max_len=max_len, eval_seqs=eval_seqs, seed=seed, checkpoint=checkpoint)


def distill(target: LoadedModel, drafter, params: torch.nn.Module, step: Step, save: Callable[..., None],
            train: Sequence[Answered], held: Sequence[Answered], out: Path, report: dict, *,
            draft_vocab: int | None, epochs: int, lr: float, batch_tokens: int, max_len: int,
            eval_seqs: dict[str, Sequence[Answered]] | None, seed: int, checkpoint: Path | None,
            eval_step: Step | None = None) -> dict:
    """The training loop every drafter kind shares: distil the target into `params` (AdamW,
    warm-up then cosine decay, gradient clipping at 1) with `step`'s teacher/student pairs,
    evaluate (with `eval_step`, default `step`) before and after, save with
    `save(out, train=report)`."""
    if epochs < 1:
        raise InvalidRequest("epochs", f"must be at least 1, got {epochs}")
    if draft_vocab:
        drafter.set_vocab(choose_vocab(train, draft_vocab, target.vocab_size, sorted(target.eos_token_ids)))
    device, dtype = target.device, next(target.model.parameters()).dtype
    evals = {"corpus-holdout": held, **(eval_seqs or {})}
    report.update({"draft_vocab": draft_vocab or target.vocab_size,
                   "vocab_coverage": round(coverage(held or train, drafter.vocab_ids), 4),
                   "train_sequences": len(train), "train_positions": sum(len(s.ids) - s.prompt_len for s in train),
                   "epochs": epochs, "lr": lr, "seed": seed})
    report["before"] = {k: evaluate(target, drafter, v, batch_tokens, max_len, eval_step or step)
                        for k, v in evals.items() if v}

    target.model.requires_grad_(False)  # only the drafter's own modules learn
    params.float().train().requires_grad_(True)
    opt = torch.optim.AdamW(params.parameters(), lr=lr, weight_decay=0.0)
    steps_per_epoch = sum(1 for _ in batches(train, batch_tokens, None, max_len))
    total = epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    config = {k: report[k] for k in sorted(report) if k not in ("before", "vocab_coverage")}
    start_epoch = 0
    if checkpoint is not None and checkpoint.is_file():
        state = torch.load(checkpoint, map_location=device, weights_only=False)
        if state.get("config") == config:
            params.load_state_dict(state["params"])
            opt.load_state_dict(state["opt"])
            sched.load_state_dict(state["sched"])
            start_epoch = state["epoch"]
    pad = _pad_id(target)
    started = time.perf_counter()
    for epoch in range(start_epoch, epochs):
        bar = tqdm(batches(train, batch_tokens, random.Random(seed * 1000 + epoch), max_len), total=steps_per_epoch,
                   desc=f"epoch {epoch + 1}/{epochs}", unit="batch")
        for group in bar:
            ids, attn, pred = _pack(group, max_len, pad, device)
            with _autocast(device, dtype):
                p, logq, extra, _ = step(target, drafter, ids, attn, pred)
            loss = -(_restrict(p, drafter.vocab_ids) * logq).sum(-1).mean()
            if extra is not None:
                loss = loss + extra
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params.parameters(), 1.0)
            opt.step()
            sched.step()
            bar.set_postfix(loss=f"{loss.item():.3f}")
        if checkpoint is not None:
            torch.save({"config": config, "params": params.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch + 1}, checkpoint)
    params.to(dtype).eval()
    report["train_seconds"] = round(time.perf_counter() - started, 1)
    report["after"] = {k: evaluate(target, drafter, v, batch_tokens, max_len, eval_step or step)
                       for k, v in evals.items() if v}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save(out, train=report)
    return report
