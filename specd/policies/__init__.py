"""Stopping policies (docs/engine.md), one per file, and the registry that names them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
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
from specd.types import SamplingParams, SpecParams

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


def policy_overrides(spec: SpecParams) -> dict[str, Any]:
    """The request's policy parameters, with max_draft_tokens (when set) replacing the cap."""
    overrides = dict(spec.policy_params)
    if spec.max_draft_tokens is not None:
        overrides["max_draft_tokens"] = spec.max_draft_tokens
    return overrides


def check_spec(spec: SpecParams, sampling: SamplingParams, oracle: bool = False) -> None:
    """InvalidRequest unless a request's speculation can run, checked before any work: a known
    policy whose overrides are valid, relaxed verification only with adasd, and the oracle
    only where the target's answer is known in advance (oracle=True: the engine, which
    `specd bench` drives) and reproducible (greedy, or seeded: coupled sampling)."""
    if spec.policy != NO_SPECULATION:
        policy_class(spec.policy).Params.from_overrides(policy_overrides(spec))
    if spec.relaxed and spec.policy != "adasd":
        raise InvalidRequest("relaxed", "relaxed verification is AdaSD's and needs policy 'adasd'")
    if spec.branches and sampling.adjusts_logits:
        raise InvalidRequest("branches", "draft trees are not verified under penalties or logit_bias, which "
                                         "count along one chain; ask for 0 branches")
    if spec.policy == "oracle" and not oracle:
        raise InvalidRequest("policy", "the oracle policy needs the target's answer in advance; "
                                       "it runs only in `specd bench`")
    if spec.policy == "oracle" and not (sampling.greedy or sampling.coupled):
        raise InvalidRequest("policy", "the oracle policy needs greedy decoding or a seed (coupled "
                                       "sampling): it stops before the first token the target's own "
                                       "output rejects")


def check_drafter(spec: SpecParams, name: str, has_distribution: bool) -> None:
    """InvalidRequest unless the drafter `name` can serve the request's speculation."""
    if spec.relaxed and not has_distribution:
        raise InvalidRequest("relaxed", f"relaxed verification needs a drafter with a distribution; "
                                        f"{name} has none")


def request_policy(spec: SpecParams, state: dict[str, float] | None, resources: PolicyResources,
                   costs: Callable[[], Any] | None = None) -> StoppingPolicy | None:
    """The request's stopping policy (None for policy "none": the target alone), with its
    overrides and shared state; costs gives the cost curve, asked only by a policy that needs it."""
    if spec.policy == NO_SPECULATION:
        return None
    if costs is not None and policy_class(spec.policy).needs_costs:
        resources = dataclasses.replace(resources, costs=costs())
    return build_policy(spec.policy, policy_overrides(spec), state, resources)


__all__ = ["POLICIES", "NO_SPECULATION", "AcceptanceHead", "bundled_head_path", "Decision", "PolicyParams",
           "PolicyResources", "StoppingPolicy", "build_policy", "check_drafter", "check_spec", "policy_class",
           "policy_overrides", "request_policy"]
