"""The target's side of the round for one request, with no transport in it: the committed
sequence, its KV cache and, for unseeded sampling, its random generator; each window a
verdict. After each verification the cache keeps the committed tokens plus the accepted drafts;
the recovered or bonus token is fed with the next window (engine.py's invariant,
docs/engine.md, "The round"). Every driver verifies with it: the engine (specd.engine), PEARL in
process (specd.speculation.overlap) and the target service (services.target.session)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specd.dvi import top_logprobs
from specd.errors import InvalidRequest
from specd.runtime.loading import LoadedModel
from specd.grammar import Grammar
from specd.logprobs import TokenLogprob, check_logprobs, emitted_logprobs
from specd.penalties import check_logit_bias
from specd.speculation.round import judged_window, validate_prompt
from specd.sampling import request_generator
from specd.tree import DraftTree, verify_tree
from specd.types import SamplingParams, SpecParams
from specd.verify import Verdict, Window, verify_window

MAX_TOP_LOGPROBS = 64
PROB_SLACK = 1e-5  # float32 round-off over q(x) = 1


@dataclass(frozen=True, kw_only=True)
class Judged:
    """One window's verdict, with what the session returns besides (on the compute thread)."""
    verdict: Verdict
    top: tuple[torch.Tensor, torch.Tensor] | None = None  # top log-probabilities of the judged positions
    features: tuple[int, torch.Tensor] | None = None  # (first position, hidden states) now committed
    accepted: list[int] = field(default_factory=list)  # the tokens kept: a tree's path, drafts made here
    drafted: int = 0  # drafts of a session that drafts on the target
    emitted: list[TokenLogprob] = field(default_factory=list)  # where the session returns them


class Verifier:
    def __init__(self, target: LoadedModel, prompt: list[int], sampling: SamplingParams, features: bool = False,
                 logprobs: int | None = None, grammar: Grammar | None = None):
        """grammar: the sampling's grammar state, where the caller built it (off its event loop:
        the first one builds the tokenizer's tables, about a second); else built here."""
        sampling.validate(max_new_tokens_limit=target.max_context)
        validate_prompt(prompt, target.emitted_vocab, target.max_context)
        check_logit_bias(sampling, target.emitted_vocab)
        self.target, self.sampling = target, sampling
        self.seq = list(prompt)
        self.prompt_len = len(prompt)
        self.grammar = grammar if grammar is not None or sampling.grammar is None else \
            Grammar.for_model(sampling.grammar, target)
        self.kv = target.session()
        check_logprobs(logprobs, SpecParams())
        self.logprobs = logprobs  # return emitted tokens' log-probabilities with this many alternatives
        self.features = features  # return the hidden states of committed positions (feature drafters)
        self.prompt_features: torch.Tensor | None = None  # the prefill's, sent with the first verification
        self.generator = request_generator(sampling, target.device)
        self.vocab = target.emitted_vocab  # logits beyond it are never read: no id there is emitted

    def prefill(self, chunk: int = 0) -> bool:
        """Cache the next `chunk` tokens (0: all) of the prompt but its last, while the draft
        drafts its first window; True while more remain. A long prompt prefilled in chunks lets
        other sessions' verifications run between them (chunked prefill)."""
        todo = self.seq[self.kv.length:len(self.seq) - 1]
        if not todo:
            return False
        part = todo[:chunk] if chunk > 0 else todo
        _, hidden = self.kv.extend(part, len(part) if self.features else 1, self.features)
        if self.features:
            self.prompt_features = hidden if self.prompt_features is None else torch.cat([self.prompt_features,
                                                                                         hidden])
        return len(part) < len(todo)

    def window(self, drafts: list[int], tree: DraftTree | None = None) -> list[int]:
        """The ids to feed for verifying drafts: uncached committed tokens, then the drafts (with
        a tree: its nodes, the drafts first)."""
        if len(self.seq) + (len(tree) if tree is not None else len(drafts)) >= self.target.max_context + 1:
            raise InvalidRequest("tokens", f"the window would pass the context of {self.target.max_context}")
        if drafts and (min(drafts) < 0 or max(drafts) >= self.vocab):
            raise InvalidRequest("tokens", f"draft token ids must be in [0, {self.vocab})")
        return self.seq[self.kv.length:] + (tree.tokens if tree is not None else drafts)

    def tree(self, drafts: list[int], side_tokens: list[int], side_parents: list[int], relaxed: bool,
             top_k: int) -> DraftTree | None:
        """The window as a draft tree when it brings side nodes (None: a chain); InvalidRequest
        for a malformed tree or one asked with what is defined for chains only."""
        if not side_tokens and not side_parents:
            return None
        if relaxed:
            raise InvalidRequest("side_tokens", "relaxed verification is defined for chains, not draft trees")
        if self.sampling.adjusts_logits:
            raise InvalidRequest("side_tokens", "penalties and logit_bias are applied along chains, not draft trees")
        if self.logprobs is not None:
            raise InvalidRequest("side_tokens", "log-probabilities are returned along chains, not draft trees")
        if top_k:
            raise InvalidRequest("side_tokens", "top_logprobs are returned for chains, not draft trees")
        if self.features:
            raise InvalidRequest("side_tokens", "a session that returns features verifies chains, not draft trees")
        return DraftTree.from_nodes(drafts, side_tokens, side_parents, self.vocab)

    def judge_tree(self, logits: torch.Tensor, tree: DraftTree, q: torch.Tensor | None) -> Judged:
        """A tree forward's logits [len(tree) + 1, V] -> its verdict (num_accepted the path's
        length, num_strict its leading chain nodes) and the path's tokens; commits it and keeps
        the path's keys and values."""
        committed = len(self.seq)
        logits, q = self.within_vocab(logits, q)
        v = verify_tree(logits, tree, self.sampling, self.generator, committed, list(q) if q is not None else None)
        self.kv.keep_path(committed, v.path)
        accepted = [tree.tokens[i] for i in v.path]
        self.seq += accepted + [v.next_token]
        return Judged(verdict=Verdict(len(v.path), v.next_token, tree.main_prefix(v.path)), accepted=accepted)

    def check_window(self, drafts: list[int], probs: list[float], has_distributions: bool, relaxed: bool,
                     top_k: int) -> None:
        """InvalidRequest for a window this session cannot verify losslessly: sampling against
        a point mass when the drafts came from a real q (probs < 1) without their distributions,
        relaxed verification without them, or too many top log-probabilities asked for."""
        if len(probs) not in (0, len(drafts)):
            raise InvalidRequest("probs", f"expected {len(drafts)} probabilities, got {len(probs)}")
        # q(x) <= 0 would accept every draft (u * q(x) <= p(x)): a drafted token had q(x) > 0.
        bad = next((i for i, p in enumerate(probs) if not 0.0 < p <= 1.0 + PROB_SLACK), None)
        if bad is not None:
            raise InvalidRequest("probs", f"q(x) of a drafted token is in (0, 1]; got {probs[bad]} at {bad}")
        if not has_distributions and not self.sampling.greedy and any(p < 1.0 for p in probs):
            raise InvalidRequest("distributions", "sampling verification of drafts with q(x) < 1 "
                                                  "needs their distributions")
        if relaxed and not has_distributions and drafts:
            raise InvalidRequest("distributions", "relaxed verification needs the draft distributions")
        if not 0 <= top_k <= MAX_TOP_LOGPROBS:
            raise InvalidRequest("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {top_k}")

    def batch_window(self, drafts: list[int], q: torch.Tensor | None, relaxed: bool,
                     tree: DraftTree | None = None) -> Window | None:
        """The window as a batched forward judges it with the other sessions' (verify_windows,
        StepBatcher.submit), or None where this session judges it alone: relaxed, a tree, or logits
        the request adjusts first (penalties, a bias, a grammar)."""
        if relaxed or tree is not None or self.sampling.adjusts_logits:
            return None
        return Window(drafts, self.sampling, q[..., :self.vocab] if q is not None else None, len(self.seq),
                      self.generator, self.vocab)

    def judge(self, logits: torch.Tensor, hidden: torch.Tensor | None, drafts: list[int], q: torch.Tensor | None,
              relaxed_threshold: float | None, relaxed: bool, top_k: int, start: int,
              verdict: Verdict | None = None) -> Judged:
        """One window's forward -> its verdict, the top-k log-probabilities of the judged
        positions (up to the first rejection), the committed positions' hidden states from start
        (copied to the host: hidden may be a buffer the next forward reuses) and the emitted
        tokens' log-probabilities where the session returns them; commits the verdict. start:
        the position of the window's first fed token; verdict: the batched forward's
        (verify_windows of its batch_window), else judged here."""
        logits, q = self.within_vocab(logits, q)
        verdict = self.commit(verdict, drafts) if verdict is not None else \
            self.verify(logits, drafts, q, relaxed_threshold, relaxed)
        top = top_logprobs(logits[:min(verdict.num_strict + 1, len(drafts))], top_k) if top_k and drafts else None
        feats = self.committed_features(start, hidden, verdict) if hidden is not None else None
        emitted = (emitted_logprobs(logits, drafts[:verdict.num_accepted] + [verdict.next_token], self.logprobs)
                   if self.logprobs is not None else [])
        return Judged(verdict=verdict, top=top, emitted=emitted,
                      features=(feats[0], feats[1].to("cpu", torch.float32, copy=True)) if feats else None)

    def within_vocab(self, logits: torch.Tensor, q: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits (and q) without the columns past the tokenizer: a view, so every path (greedy,
        sampled, seeded, trees; drafted or the target alone) samples and takes its argmax as if
        those ids were masked to -inf. Nothing changes where the tokenizer covers every row."""
        if logits.shape[-1] <= self.vocab:
            return logits, q
        return logits[..., :self.vocab], q[..., :self.vocab] if q is not None else None

    def verify(self, logits: torch.Tensor, drafts: list[int], q: torch.Tensor | None,
               relaxed_threshold: float | None, relaxed: bool) -> Verdict:
        """logits [k+1, V] of the window's last k+1 positions -> verdict; commits it."""
        logits, q, drafts = judged_window(logits, q, drafts, self.sampling, self.grammar, self.seq[:self.prompt_len],
                                          self.seq[self.prompt_len:])
        verdict = verify_window(logits, drafts, q, self.sampling, self.generator, relaxed_threshold, relaxed,
                                len(self.seq))
        return self.commit(verdict, drafts)

    def commit(self, verdict: Verdict, drafts: list[int]) -> Verdict:
        """Keep the verdict's accepted drafts and its token."""
        n = verdict.num_accepted
        self.kv.rollback(len(self.seq) + n)
        self.seq += drafts[:n] + [verdict.next_token]
        if self.grammar is not None:
            self.grammar.commit(drafts[:n] + [verdict.next_token])
        return verdict

    def committed_features(self, start: int, hidden: torch.Tensor, verdict: Verdict) -> tuple[int, torch.Tensor]:
        """The hidden states of the positions a verification fed from `start` that are now
        committed and cached (up to the last accepted draft), after the prompt's on the first."""
        rows = hidden[:verdict.num_accepted + 1]
        if self.prompt_features is not None:
            rows, start = torch.cat([self.prompt_features, rows]), 0
            self.prompt_features = None
        return start, rows

    def close(self) -> None:
        self.kv.close()
