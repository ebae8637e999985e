"""Offline training of the SpecDec++ acceptance head (Huang et al. 2024, "SpecDec++:
Boosting Speculative Decoding via Adaptive Candidate Lengths").

The head (specd.policies.specdecpp.AcceptanceHead) reads the draft's last hidden state h_t
and predicts the probability that the token drafted from it is accepted. Pipeline:

  1. generate_targets: the target alone answers each prompt (the responses the drafter will
     be asked to speculate on at serving time);
  2. build_examples: *token mixing*: each generated token is replaced with probability
     r = 0.15 by a token drawn from the draft distribution q, so that training contexts
     contain draft mistakes as they do while drafting. Then one teacher-forced forward of
     the target and one of the draft over the mixed sequence give p_t, q_t and h_t at every
     generated position t. The label is for the draft's greedy token x = argmax q_t:
         soft label  y_t = min(1, p_t(x) / q_t(x))     (p, q at temperature 1)
         hard label  a_t = [argmax q_t == argmax p_t]   (acceptance under greedy decoding)
  3. train_head: weighted binary cross-entropy, the rejection term weighted by w_rej
         L = -mean( y log sigmoid(z) + w_rej (1 - y) log(1 - sigmoid(z)) )
     Rejections are the rare class for a well-matched pair, and predicting acceptance past
     a rejection wastes every later draft token, so the head is biased towards rejection:
     for a soft label y the loss is minimised at sigmoid(z) = y / (y + w_rej (1 - y)).

Simplification: the replacement token at t is drawn from q conditioned on the *unmixed*
prefix (one extra draft forward instead of one per token), and the target tokens after a
replacement are not regenerated; the paper mixes while generating.
"""

from __future__ import annotations

import copy
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import DynamicCache

from specd.drafters.base import Drafter, fit_vocab
from specd.drafters.early_exit import EarlyExitDrafter
from specd.drafters.hf import HfDrafter
from specd.engine import SpeculativeEngine
from specd.errors import InvalidRequest
from specd.runtime.loading import LoadedModel
from specd.runtime.session import ForwardFn, hf_forward
from specd.policies.specdecpp import AcceptanceHead
from specd.types import SamplingParams, SpecParams

MIX_RATE = 0.15  # SpecDec++'s r


# -- 1. target generations --------------------------------------------------------------------
def generate_targets(target: LoadedModel, prompts: list[list[int]], max_new_tokens: int,
                     temperature: float, seed: int) -> list[list[int]]:
    """The target's own continuation of every prompt (generated ids only)."""
    engine = SpeculativeEngine(target)
    generations = []
    for i, ids in enumerate(tqdm(prompts, desc="target generations", unit="prompt")):
        sampling = SamplingParams(temperature=temperature, seed=seed + i, max_new_tokens=max_new_tokens)
        generations.append(engine.generate(ids, sampling, SpecParams(policy="none")).token_ids)
    return generations


# -- 2. labelled examples ---------------------------------------------------------------------
def draft_forward_fn(drafter: Drafter) -> ForwardFn:
    """The ForwardFn (logits and hidden states) of a model drafter."""
    if isinstance(drafter, EarlyExitDrafter):
        forward, device = drafter.forward, drafter.target.device
    elif isinstance(drafter, HfDrafter):
        forward, device = hf_forward(drafter.draft.model), drafter.draft.device
    else:
        raise InvalidRequest("drafter", f"the specdec++ head needs a model drafter with hidden states "
                                        f"(early-exit or hf), not {drafter.kind}")

    def on_device(input_ids, cache, num_logits, want_hidden):
        return forward(input_ids.to(device), cache, num_logits, want_hidden)

    return on_device


def _teacher_forced(forward: ForwardFn, seq: list[int], prompt_len: int, vocab_size: int,
                    device: torch.device, want_hidden: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One uncached forward over seq; logits [T, V] and hidden [T, H] at rows prompt_len-1 ..
    len-2, i.e. the T = len - prompt_len positions that predict the generated tokens."""
    ids = torch.tensor([seq], dtype=torch.long, device=device)
    logits, hidden = forward(ids, DynamicCache(), len(seq) - prompt_len + 1, want_hidden)
    logits = fit_vocab(logits.float(), vocab_size)[:-1].to(device)
    return logits, (hidden[:-1].float().to(device) if hidden is not None else None)


def mix_tokens(seq: list[int], prompt_len: int, q: torch.Tensor, mix_rate: float,
               generator: torch.Generator) -> list[int]:
    """Replace each generated token, with probability mix_rate, by a draw from q [T, V]
    (q[i] is the draft distribution of token prompt_len + i). The prompt is kept."""
    q = q.float().cpu()  # the generator lives on the CPU
    replace = torch.rand(q.shape[0], generator=generator) < mix_rate
    drafts = torch.multinomial(q, 1, generator=generator).squeeze(-1)
    generated = torch.tensor(seq[prompt_len:], dtype=torch.long)
    return seq[:prompt_len] + torch.where(replace, drafts, generated).tolist()


def acceptance_labels(p_logits: torch.Tensor, q_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft label min(1, p(x)/q(x)) and hard label [argmax q == argmax p] for x = argmax q.

    [T, V] logits -> [T], [T]; p and q are temperature-1 softmaxes."""
    p, q = p_logits.float().softmax(-1), q_logits.float().softmax(-1)
    x = q.argmax(-1, keepdim=True)  # [T, 1] the draft's greedy token
    soft = (p.gather(-1, x) / q.gather(-1, x)).clamp(max=1.0).squeeze(-1)
    return soft, x.squeeze(-1) == p.argmax(-1)


@torch.no_grad()
def build_examples(target: LoadedModel, drafter_forward: ForwardFn, sequences: list[list[int]],
                   prompt_lens: list[int], mix_rate: float = MIX_RATE,
                   seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Examples at every generated position of every sequence (prompt + generation):
    draft hidden [N, H], soft label [N], hard label [N] (bool)."""
    if len(sequences) != len(prompt_lens):
        raise InvalidRequest("prompt_lens", "needs one prompt length per sequence")
    if not 0.0 <= mix_rate <= 1.0:
        raise InvalidRequest("mix_rate", f"must be in [0, 1], got {mix_rate}")
    generator = torch.Generator().manual_seed(seed)
    target_forward, vocab, device = hf_forward(target.model), target.vocab_size, target.device
    hidden, soft, hard = [], [], []
    for seq, n in tqdm(list(zip(sequences, prompt_lens)), desc="labelling", unit="seq"):
        if not 1 <= n < len(seq):
            continue  # no generated token to learn from
        mixed = list(seq)
        if mix_rate > 0:
            q_logits, _ = _teacher_forced(drafter_forward, mixed, n, vocab, device, False)
            mixed = mix_tokens(mixed, n, q_logits.softmax(-1), mix_rate, generator)
        p_logits, _ = _teacher_forced(target_forward, mixed, n, vocab, device, False)
        q_logits, h = _teacher_forced(drafter_forward, mixed, n, vocab, device, True)
        s, a = acceptance_labels(p_logits, q_logits)
        hidden.append(h)
        soft.append(s)
        hard.append(a)
    if not hidden:
        raise InvalidRequest("prompts", "the target generated no tokens to learn from")
    return torch.cat(hidden), torch.cat(soft), torch.cat(hard)


# -- 3. the head --------------------------------------------------------------------------------
def weighted_bce(logits: torch.Tensor, soft: torch.Tensor, w_rej: float) -> torch.Tensor:
    """-mean(y log sigmoid(z) + w_rej (1 - y) log(1 - sigmoid(z)))."""
    return -(soft * F.logsigmoid(logits) + w_rej * (1 - soft) * F.logsigmoid(-logits)).mean()


def auc(scores: torch.Tensor, positive: torch.Tensor) -> float:
    """Area under the ROC curve: P(score of an accepted example > score of a rejected one)
    (Mann-Whitney U; ties count one half). NaN when one class is absent."""
    num_pos = int(positive.sum())
    num_neg = len(positive) - num_pos
    if not num_pos or not num_neg:
        return math.nan
    # U = (sum of the positives' ranks) - P(P+1)/2, with tied scores sharing their mean rank.
    _, inverse, counts = torch.unique(scores, return_inverse=True, return_counts=True)
    mean_rank = counts.cumsum(0) - (counts - 1) / 2  # 1-based
    u = mean_rank[inverse][positive].sum() - num_pos * (num_pos + 1) / 2
    return float(u) / (num_pos * num_neg)


@torch.no_grad()
def evaluate_head(head: AcceptanceHead, hidden: torch.Tensor, soft: torch.Tensor, hard: torch.Tensor,
                  w_rej: float) -> dict:
    """Loss, accuracy of sigmoid(z) > 0.5 against the hard labels, ROC AUC (ranking quality,
    informative when acceptances are rare), mean predicted acceptance."""
    logits = head(hidden)
    return {"loss": float(weighted_bce(logits, soft, w_rej)),
            "accuracy": float(((logits > 0) == hard).float().mean()),
            "auc": auc(logits, hard),
            "mean_predicted_acceptance": float(torch.sigmoid(logits).mean()),
            "base_rate": float(hard.float().mean()),
            "mean_soft_label": float(soft.mean())}


def _train_epoch(head: AcceptanceHead, opt: torch.optim.Optimizer, hidden: torch.Tensor,
                 soft: torch.Tensor, w_rej: float, batch_size: int, generator: torch.Generator) -> float:
    head.train()
    order = torch.randperm(hidden.shape[0], generator=generator).to(hidden.device)
    total = 0.0
    for batch in order.split(batch_size):
        loss = weighted_bce(head(hidden[batch]), soft[batch], w_rej)
        opt.zero_grad()
        loss.backward()
        opt.step()
        total += float(loss.detach()) * len(batch)
    head.eval()
    return total / hidden.shape[0]


def _check_training(n: int, epochs: int, lr: float, batch_size: int, w_rej: float,
                    val_fraction: float) -> None:
    checks = [(n >= 2, "hidden", f"needs at least 2 examples, got {n}"),
              (epochs >= 1, "epochs", f"must be >= 1, got {epochs}"),
              (math.isfinite(lr) and lr > 0, "lr", f"must be > 0, got {lr}"),
              (batch_size >= 1, "batch_size", f"must be >= 1, got {batch_size}"),
              (math.isfinite(w_rej) and w_rej > 0, "w_rej", f"must be > 0, got {w_rej}"),
              (0 < val_fraction < 1, "val_fraction", f"must be in (0, 1), got {val_fraction}")]
    for ok, field, message in checks:
        if not ok:
            raise InvalidRequest(field, message)


def train_head(hidden: torch.Tensor, soft: torch.Tensor, hard: torch.Tensor, depth: int = 3,
               width: int = 256, w_rej: float = 6.0, epochs: int = 30, lr: float = 1e-3,
               batch_size: int = 256, seed: int = 0,
               val_fraction: float = 0.1) -> tuple[AcceptanceHead, dict]:
    """Fit an AcceptanceHead with AdamW on weighted BCE; keeps the epoch with the lowest
    validation loss. Returns the head (on the CPU, eval mode) and a report."""
    n = hidden.shape[0]
    _check_training(n, epochs, lr, batch_size, w_rej, val_fraction)
    # Clones: examples built under inference mode cannot be saved for backward.
    hidden, soft, hard = hidden.detach().float().clone(), soft.detach().float().clone(), hard.detach().bool()
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(n, generator=generator).to(hidden.device)
    n_val = min(n - 1, max(1, round(n * val_fraction)))  # both splits non-empty
    val, train = order[:n_val], order[n_val:]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = AcceptanceHead(hidden.shape[1], depth, width).to(hidden.device).eval()
    opt = torch.optim.AdamW(head.parameters(), lr=lr)
    best = (math.inf, 0, 0.0, copy.deepcopy(head.state_dict()))
    for epoch in tqdm(range(1, epochs + 1), desc="training head", unit="epoch"):
        train_loss = _train_epoch(head, opt, hidden[train], soft[train], w_rej, batch_size, generator)
        val_loss = evaluate_head(head, hidden[val], soft[val], hard[val], w_rej)["loss"]
        if val_loss < best[0]:
            best = (val_loss, epoch, train_loss, copy.deepcopy(head.state_dict()))
    head.load_state_dict(best[3])
    metrics = evaluate_head(head, hidden[val], soft[val], hard[val], w_rej)
    report = {"num_examples": n, "num_train": n - n_val, "num_val": n_val, "epochs": epochs,
              "best_epoch": best[1], "train_loss": best[2], "w_rej": w_rej,
              "base_rate": float(hard.float().mean()), "mean_soft_label": float(soft.mean())}
    report.update({f"val_{k}": v for k, v in metrics.items()})
    report["val_majority_accuracy"] = max(report["val_base_rate"], 1 - report["val_base_rate"])
    return head.cpu(), report


# -- 4. from a prompts file -----------------------------------------------------------------
def read_prompts(path: str | Path, limit: int) -> list[str]:
    """First turns of a JSONL file whose lines hold {"turns": [str, ...]} (MT-Bench format)."""
    path = Path(path)
    if not path.is_file():
        raise InvalidRequest("prompts", f"file not found: {path}")
    prompts: list[str] = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if len(prompts) >= limit:
            break
        if not line.strip():
            continue
        try:
            first = json.loads(line)["turns"][0]
        except (json.JSONDecodeError, KeyError, IndexError, TypeError):
            first = None
        if not isinstance(first, str) or not first.strip():
            raise InvalidRequest("prompts", f"{path}:{lineno}: expected {{\"turns\": [non-empty str, ...]}}")
        prompts.append(first)
    if not prompts:
        raise InvalidRequest("prompts", f"{path} holds no prompts")
    return prompts


def _check_run(limit: int, max_new_tokens: int, temperature: float, epochs: int, seed: int) -> None:
    checks = [(limit >= 1, "limit", f"must be >= 1, got {limit}"),
              (max_new_tokens >= 1, "max_new_tokens", f"must be >= 1, got {max_new_tokens}"),
              (math.isfinite(temperature) and 0 <= temperature <= 100, "temperature",
               f"must be in [0, 100], got {temperature}"),
              (epochs >= 1, "epochs", f"must be >= 1, got {epochs}"),
              (0 <= seed < 2**62, "seed", f"must be a non-negative 62-bit integer, got {seed}")]
    for ok, field, message in checks:
        if not ok:
            raise InvalidRequest(field, message)


def train_head_from_prompts(target: LoadedModel, drafter: Drafter, prompts_path: str | Path, limit: int,
                            max_new_tokens: int, temperature: float, epochs: int, out_path: str | Path,
                            seed: int = 0, chat: bool = True) -> dict:
    """`specd train-head`: generate, label, train and save a head for this drafter/target pair."""
    _check_run(limit, max_new_tokens, temperature, epochs, seed)
    forward = draft_forward_fn(drafter)  # refuse an unsuitable drafter before generating
    prompts = [target.encode_prompt(text, chat) for text in read_prompts(prompts_path, limit)]
    t0 = time.perf_counter()
    generations = generate_targets(target, prompts, max_new_tokens, temperature, seed)
    t1 = time.perf_counter()
    examples = build_examples(target, forward, [p + g for p, g in zip(prompts, generations)],
                              [len(p) for p in prompts], MIX_RATE, seed)
    t2 = time.perf_counter()
    head, report = train_head(*examples, epochs=epochs, seed=seed)
    t3 = time.perf_counter()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    head.save(out_path)
    report.update({"target": target.name, "drafter": drafter.name, "num_prompts": len(prompts),
                   "generated_tokens": sum(map(len, generations)), "mix_rate": MIX_RATE,
                   "generate_s": t1 - t0, "label_s": t2 - t1, "train_s": t3 - t2, "out_path": str(out_path)})
    return report
