"""Stopping policies (docs/engine.md), one per file, and the registry that names them."""

from __future__ import annotations

from typing import Any

from specd.errors import InvalidRequest
from specd.policies.adaedl import AdaEdlPolicy
from specd.policies.adasd import AdaSdPolicy
from specd.policies.base import Decision, PolicyParams, PolicyResources, StoppingPolicy
from specd.policies.constant import ConstantPolicy
from specd.policies.cost_aware import CostAwarePolicy
from specd.policies.heuristic import HeuristicPolicy
from specd.policies.max_confidence import MaxConfidencePolicy
from specd.policies.oracle import OraclePolicy
from specd.policies.specdecpp import AcceptanceHead, SpecDecPPPolicy, bundled_head_path
from specd.policies.svip import SvipPolicy

POLICIES: dict[str, type[StoppingPolicy]] = {
    cls.name: cls
    for cls in (ConstantPolicy, HeuristicPolicy, MaxConfidencePolicy, SvipPolicy, AdaEdlPolicy,
                AdaSdPolicy, SpecDecPPPolicy, CostAwarePolicy, OraclePolicy)
}
NO_SPECULATION = "none"  # target-only decoding, the baseline


def policy_class(name: str) -> type[StoppingPolicy]:
    try:
        return POLICIES[name]
    except KeyError:
        raise InvalidRequest("policy", f"unknown policy {name!r}; choose one of "
                                       f"{', '.join([NO_SPECULATION, *POLICIES])}") from None


def build_policy(name: str, overrides: dict[str, Any], state: dict[str, float] | None = None,
                 resources: PolicyResources | None = None) -> StoppingPolicy:
    cls = policy_class(name)
    return cls(cls.Params.from_overrides(overrides), state, resources)


__all__ = ["POLICIES", "NO_SPECULATION", "AcceptanceHead", "bundled_head_path", "Decision", "PolicyParams",
           "PolicyResources", "StoppingPolicy", "build_policy", "policy_class"]
