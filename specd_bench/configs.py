"""What `specd bench` runs: its settings and the configurations (drafter x policy, peers).

A configuration is one row of the report. `ar` (policy "none" through our engine) is the
baseline every speedup is measured against and is always run. The oracle policy is run
through the engine only for the model-free drafters (ngram, retrieval: nothing to teacher-force);
model drafters get the computed oracle bound instead (specd_bench.oracle).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specd_bench.peers import BASELINES, PEERS
from specd.drafters import DRAFTERS, MODEL_FREE
from specd.errors import InvalidRequest
from specd.policies import NO_SPECULATION, POLICIES, policy_class
from specd.tree import TREE_BRANCHES

BASELINE = "ar"
SWEEP_K = range(1, 9)
ORACLE_SKIP = "the oracle needs a reproducible target output: greedy, or sampled with --seed (coupled)"


@dataclass(frozen=True)
class BenchSettings:
    dataset: Path | None = None  # None: the built-in set (specd_bench.datasets)
    turn: str = "1"
    limit: int | None = None
    policies: tuple[str, ...] | None = None  # None: every policy except oracle
    drafters: tuple[str, ...] = ("ngram",)
    draft_model: str | None = None
    draft_layers: int = 4
    target_model: str = "embedded"
    max_new_tokens: int = 256
    temperature: float = 0.0
    seed: int | None = None
    repeats: int = 1
    baselines: tuple[str, ...] = (BASELINE, "hf-prompt-lookup")
    sweep_k: bool = False
    out: Path = Path("bench-out")
    device: str = "auto"
    dtype: str = "auto"
    cache_dir: Path | None = None
    draft_adapter: Path | None = None  # trained early-exit adapter
    linear_kernels: str = "auto"  # specd/runtime/kernels.py
    datastore: Path | None = None  # retrieval's; None: the bundled one
    trees: bool = False  # also run lookup drafters with draft trees (specd.tree)
    forward: str = "auto"  # auto | lean | hf (specd/runtime/lean.py)
    offset: int = 0  # questions skipped before the first one used
    cuda_graphs: str = "auto"  # auto | on | off (specd/runtime/graphs.py)
    # Every run starts as a fresh `specd generate` would: empty policy state and the start-up
    # cost curve, so nothing learned on earlier prompts helps (or hurts) this one.
    cold_start: bool = False
    cpu_compile: str = "auto"  # auto | on | off (specd/runtime/aot.py)
    overlap: bool = False  # also run every configuration with PEARL in process (specd.speculation.overlap)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def reproducible(self) -> bool:
        """Greedy or seeded (coupled) sampling: the output is a function of the prompt alone, so
        it is checked against `ar` and the oracle is defined."""
        return self.greedy or self.seed is not None

    def validate(self) -> None:
        for p in self.policies or ():
            if p != NO_SPECULATION:
                policy_class(p)  # InvalidRequest naming an unknown policy
        for d in self.drafters:
            if d not in DRAFTERS:
                raise InvalidRequest("drafter", f"unknown drafter {d!r}; choose one of {', '.join(DRAFTERS)}")
        for b in self.baselines:
            if b not in BASELINES:
                raise InvalidRequest("baselines", f"unknown baseline {b!r}; choose one of {', '.join(BASELINES)}")
        if "hf" in self.drafters and not self.draft_model:
            raise InvalidRequest("draft_model", "--drafter hf needs --draft-model DIR")
        if self.repeats < 1:
            raise InvalidRequest("repeats", f"must be >= 1, got {self.repeats}")
        if self.limit is not None and self.limit < 1:
            raise InvalidRequest("limit", f"must be >= 1, got {self.limit}")
        if self.offset < 0:
            raise InvalidRequest("offset", f"must be >= 0, got {self.offset}")


@dataclass(frozen=True)
class Config:
    """One benchmarked configuration. kind: "engine" (our loop) or "peer" (transformers)."""

    label: str
    kind: str
    drafter: str | None = None
    policy: str = NO_SPECULATION
    policy_params: dict = field(default_factory=dict)
    skip: str | None = None  # why it was not run
    branches: int | None = None  # draft-tree side branches (None: the drafter's default)
    overlap: bool = False  # PEARL in process (SpeculativeEngine.start(overlap=True))

    def to_dict(self) -> dict:
        return {"label": self.label, "kind": self.kind, "drafter": self.drafter, "policy": self.policy,
                "policy_params": dict(self.policy_params), "branches": self.branches, "overlap": self.overlap,
                "skipped": self.skip}


def default_policies() -> tuple[str, ...]:
    return tuple(p for p in POLICIES if p != "oracle")


def build_configs(s: BenchSettings, has_head: dict[str, bool], peer_skips: dict[str, str | None]) -> list[Config]:
    """Every configuration in report order; the baseline first. has_head: drafter -> specdec++ head."""
    configs = [Config(BASELINE, "engine")]
    for d in s.drafters:
        for p in s.policies or default_policies():
            if p != NO_SPECULATION:
                skip = _policy_skip(s, d, p, has_head)
                configs.append(Config(f"{d}/{p}", "engine", d, p, skip=skip))
                if s.trees and d in MODEL_FREE and p != "oracle":
                    configs.append(Config(f"{d}/{p}/tree", "engine", d, p, skip=skip, branches=TREE_BRANCHES))
                if s.overlap and p != "oracle":
                    configs.append(Config(f"{d}/{p}/pearl", "engine", d, p, skip=skip, branches=0, overlap=True))
        if d in MODEL_FREE and (s.policies is None or "oracle" not in s.policies):
            reason = None if s.reproducible else ORACLE_SKIP
            configs.append(Config(f"{d}/oracle", "engine", d, "oracle", skip=reason))
        if s.sweep_k:
            configs += [Config(f"{d}/constant-k{k}", "engine", d, "constant", {"k": k}) for k in SWEEP_K]
    configs += [Config(p, "peer", skip=peer_skips.get(p)) for p in PEERS if p in s.baselines]
    return configs


def _policy_skip(s: BenchSettings, drafter: str, policy: str, has_head: dict[str, bool]) -> str | None:
    if policy == "oracle" and not s.reproducible:
        return ORACLE_SKIP
    if policy == "oracle" and drafter not in MODEL_FREE:
        return "model drafters get the computed oracle bound (see oracle)"
    if policy == "specdec++" and drafter in MODEL_FREE:
        return "specdec++ needs a model drafter with hidden states"
    if policy == "specdec++" and not has_head.get(drafter):
        return "no specdec++ head for this pair (bench loads only the bundled embedded early-exit-4 head)"
    return None
