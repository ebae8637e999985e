"""The draft -> verify loop (Leviathan et al. 2023; Chen et al. 2023), with an adaptive
stopping policy deciding after every drafted token whether to keep drafting.

One round:
  1. the drafter proposes x_1, x_2, ... after the committed tokens; after each, the policy
     says continue / stop (or drop, for the oracle); the hard cap bounds the window;
  2. the target runs one forward over [pending committed tokens, x_1..x_k] and yields
     p_1..p_{k+1};
  3. verification keeps the first n drafts and yields one recovered or bonus token;
  4. both KV caches roll back to committed + accepted; the policy observes the outcome.
With no drafter (policy "none") or an empty window a round is one plain decoding step,
so target-only decoding is the same loop with k = 0. The round is sequenced by
specd.speculation.driver (PEARL's by specd.speculation.overlap), with the parts the services
move too.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specd.costs import CostCurve, cached_cost_curve, measure_cost_curve
from specd.detok import TextStream, first_stop
from specd.drafters.base import Drafter
from specd.dvi import ReplayStream
from specd.errors import InvalidRequest
from specd.runtime.loading import LoadedModel
from specd.grammar import Grammar
from specd.logprobs import TokenLogprob, check_logprobs
from specd.penalties import check_logit_bias
from specd.policies import (
    NO_SPECULATION,
    PolicyResources,
    StoppingPolicy,
    check_drafter,
    check_spec,
    request_policy,
)
from specd.speculation.driver import RoundDriver, RoundStats
from specd.speculation.overlap import Overlap
from specd.speculation.round import validate_prompt
from specd.speculation.verifier import Verifier
from specd.sampling import request_generator
from specd.state import MemoryStateStore, StateKey, StateStore, StateUpdate
from specd.stats import GenerationStats
from specd.tree import TreePlanner, tree_shape
from specd.types import SamplingParams, SpecParams


@dataclass
class Generation:
    token_ids: list[int]  # generated ids only (an EOS that ended generation is included)
    text: str
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, where asked



class SpeculativeEngine:
    """Holds the models; each generate() call runs one request with its own KV caches."""

    def __init__(self, target: LoadedModel, drafter: Drafter | None = None,
                 state_store: StateStore | None = None, specdecpp_head: torch.nn.Module | None = None,
                 costs: CostCurve | None = None, costs_cache_dir: Path | None = None,
                 replay: ReplayStream | None = None, fallback: bool = True):
        """fallback: a drafter that raises leaves the target alone for the rest of the request
        (RoundStats.fallback); False raises its error instead (a benchmark, which must not time
        the target alone as the configuration)."""
        self.target = target
        self.fallback = fallback
        self.drafter = drafter
        self.state_store = state_store if state_store is not None else MemoryStateStore()
        self.specdecpp_head = specdecpp_head
        self._costs = costs
        self.costs_cache_dir = costs_cache_dir  # keep the start-up measurement on disk (one-shot commands)
        if replay is not None and (drafter is None or not drafter.learns_online):
            raise InvalidRequest("drafter", "online learning (DVI) needs an early-exit or feature drafter")
        self.replay = replay  # DVI: judged draft positions are logged here (specd.dvi)

    @property
    def costs(self) -> CostCurve:
        """The pair's cost curve: measured on first use (a few seconds on a CPU; read from
        costs_cache_dir when one is given and holds it), then refreshed by every round this
        engine runs."""
        if self._costs is None:
            if self.drafter is None:
                raise InvalidRequest("policy", "a cost curve needs a drafter")
            if self.costs_cache_dir is not None:
                self._costs = cached_cost_curve(self.target, self.drafter, self.costs_cache_dir)
            else:
                self._costs = measure_cost_curve(self.target, self.drafter)
        return self._costs

    @costs.setter
    def costs(self, curve: CostCurve) -> None:
        self._costs = curve

    def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams = SamplingParams(),
                 spec: SpecParams = SpecParams(), reference: Sequence[int] | None = None,
                 logprobs: int | None = None, overlap: bool = False) -> Generation:
        run = self.start(prompt_ids, sampling, spec, reference, logprobs, overlap)
        try:
            for _ in run:
                pass
        finally:
            run.close()
        return run.result()

    def start(self, prompt_ids: Sequence[int], sampling: SamplingParams = SamplingParams(),
              spec: SpecParams = SpecParams(), reference: Sequence[int] | None = None,
              logprobs: int | None = None, overlap: bool = False) -> GenerationRun:
        """A request to iterate round by round (each step yields the newly emitted ids).
        logprobs: keep each emitted token's log-probability and this many alternatives
        (specd.logprobs; None: none). overlap: PEARL, the next window drafted on a thread of
        its own while this one is verified (OverlapRun); sequential where a round has nothing to
        overlap or must be sequential: the target alone, relaxed verification, the oracle,
        online learning (DVI)."""
        if overlap and spec.policy != NO_SPECULATION and not spec.relaxed and reference is None \
                and self.replay is None:
            return OverlapRun(self, list(prompt_ids), sampling, spec, logprobs)
        return GenerationRun(self, list(prompt_ids), sampling, spec, reference, logprobs)

    def state_key(self, policy: str, task_tag: str) -> StateKey:
        return StateKey(self.drafter.name if self.drafter else "-", self.target.name, policy, task_tag)


class GenerationRun:
    def __init__(self, engine: SpeculativeEngine, prompt: list[int], sampling: SamplingParams,
                 spec: SpecParams, reference: Sequence[int] | None, logprobs: int | None = None):
        target = engine.target
        sampling.validate(max_new_tokens_limit=target.max_context)
        check_logprobs(logprobs, spec)
        validate_prompt(prompt, target.emitted_vocab, target.max_context)
        check_logit_bias(sampling, target.emitted_vocab)
        self.engine, self.target, self.sampling, self.spec = engine, target, sampling, spec
        self.policy, self.drafter = self._build_policy(reference)
        self.costs = self.policy.resources.costs if self.policy is not None else None  # refreshed by this run
        self.stats = RoundStats(spec.policy, self.drafter.kind if self.drafter else None,
                                prompt_tokens=len(prompt), lossy=spec.relaxed)
        self.seq = prompt  # committed tokens
        self.prompt_len = len(prompt)
        self.max_len = min(len(prompt) + sampling.max_new_tokens, target.max_context)
        self.generator = request_generator(sampling, target.device)  # the drafter's
        self.grammar = Grammar.for_model(sampling.grammar, target) if sampling.grammar is not None else None
        # The target's side of each round (specd.speculation.verifier): its cache and verdicts.
        self.verifier = Verifier(target, prompt, sampling, logprobs=logprobs, grammar=self.grammar)
        self.target_kv = self.verifier.kv
        self.draft_session = self.drafter.open(target.vocab_size) if self.drafter else None
        self.feed_features = self.drafter is not None and self.drafter.needs_target_features
        shape = tree_shape(spec.branches, self.drafter, spec.policy, spec.relaxed)
        # Draft trees (specd.tree); not under penalties, whose counts follow one chain, nor with
        # log-probabilities, which are a chain's.
        chains = sampling.adjusts_logits or logprobs is not None
        self.trees = TreePlanner(*shape) if shape[0] and not chains else None
        self.top_logprobs = logprobs
        self.logprobs: list[TokenLogprob] = []  # of the generated tokens, where asked
        self.replay = engine.replay if self.drafter is not None else None
        # Stop strings, found incrementally in the text of each round's new tokens.
        self.stops = TextStream(target.tokenizer, sampling.stop) if sampling.stop else None
        self.finish_reason: str | None = None
        self.started = time.perf_counter()
        self.driver = self._driver()

    def _driver(self) -> RoundDriver:
        return RoundDriver(self, self.stats)

    # -- setup ------------------------------------------------------------------------------
    def _build_policy(self, reference) -> tuple[StoppingPolicy | None, Drafter | None]:
        spec, engine = self.spec, self.engine
        check_spec(spec, self.sampling, oracle=True)
        if spec.policy == NO_SPECULATION:
            return None, None
        if engine.drafter is None:
            raise InvalidRequest("policy", f"policy {spec.policy!r} needs a drafter; use policy 'none' "
                                           "to decode with the target alone")
        check_drafter(spec, engine.drafter.name, engine.drafter.has_distribution)
        resources = PolicyResources(tuple(reference) if reference is not None else None, engine.specdecpp_head)
        state = engine.state_store.load(engine.state_key(spec.policy, spec.task_tag))
        self.policy_start = dict(state)  # what close() folds this request's learning into the store against
        return request_policy(spec, state, resources, lambda: engine.costs), engine.drafter

    def tree_costs(self) -> CostCurve:
        """The cost curve draft trees are priced on: this run's, else the engine's."""
        return self.costs if self.costs is not None else self.engine.costs

    # -- the loop (specd.speculation.driver) ------------------------------------------------
    def __iter__(self) -> Iterator[list[int]]:
        while self.finish_reason is None:
            emitted, self.finish_reason, lps = self.driver.round()
            new = self._emit(emitted, lps)
            if new:
                yield new

    def _emit(self, out: list[int], lps: list[TokenLogprob] | None) -> list[int]:
        """Append committed tokens, cut after the fewest whose text holds a stop string."""
        self.seq += out
        if self.stops is not None:
            kept = len(self.stops.push(out).token_ids)
            if self.stops.stopped:
                del self.seq[len(self.seq) - len(out) + kept:]
                out, self.finish_reason = out[:kept], "stop"
        if lps is not None:
            self.logprobs += lps[:len(out)]
        return out

    # -- results ----------------------------------------------------------------------------
    def generated(self) -> list[int]:
        return self.seq[self.prompt_len:]

    def text(self) -> str:
        text = self.target.decode(self.generated())
        cut = first_stop(text, self.sampling.stop, 0)
        return text if cut is None else text[:cut]

    def result(self) -> Generation:
        return Generation(self.generated(), self.text() if self.target.tokenizer else "",
                          self.finish_reason or "length", self.stats,
                          list(self.logprobs) if self.top_logprobs is not None else None)

    def close(self) -> None:
        """Free both KV caches and save the policy's adaptive state (idempotent)."""
        stats = self.stats
        if self.target_kv.cache is None:
            return
        if not self.driver.close():
            self.draft_session = None  # still in a step on the drafting thread, which keeps it
        stats.wall_time_s = time.perf_counter() - self.started
        stats.new_tokens = len(self.generated())
        stats.finish_reason = self.finish_reason or "cancelled"
        self.target_kv.close()
        if self.draft_session is not None:
            self.draft_session.close()
        if self.policy is not None:
            update = StateUpdate.between(self.policy_start, self.policy.state(), self.policy.state_scale())
            self.engine.state_store.update(self.engine.state_key(self.spec.policy, self.spec.task_tag), update)


class OverlapRun(GenerationRun):
    """A request's rounds with PEARL's overlap (specd.speculation.overlap): the same checks,
    policy, stop strings, results and close as GenerationRun; windows are chains (no trees)."""

    def __init__(self, engine: SpeculativeEngine, prompt: list[int], sampling: SamplingParams, spec: SpecParams,
                 logprobs: int | None = None):
        super().__init__(engine, prompt, sampling, spec, None, logprobs)

    def _driver(self) -> Overlap:
        self.trees = None
        return Overlap(self, self.stats)
