"""The target service's messages <-> services.target.core's requests and replies."""

from __future__ import annotations

import numpy as np
import torch

from services.common.convert import (
    distribution_from_proto,
    features_to_proto,
    sampling_from_proto,
    top_logprobs_to_proto,
)
from services.proto.specd.target.v1 import target_pb2
from services.target.core import OpenRequest, Reply, WindowRequest
from services.target.drafting import Closed, LocalSpec
from specd.errors import InvalidRequest
from specd.types import SpecParams

Q_SUM_SLACK = 1e-3  # a dense q sums to 1 within float32 round-off over a large vocabulary


def open_from_proto(msg: target_pb2.OpenTarget) -> OpenRequest:
    speculate = None
    if msg.HasField("speculate"):
        s = msg.speculate
        spec = SpecParams(s.policy, s.max_draft_tokens if s.HasField("max_draft_tokens") else None,
                          dict(s.policy_params))
        speculate = LocalSpec(spec=spec, max_length=s.max_length, policy_state=dict(s.policy_state))
    return OpenRequest(prompt=list(msg.prompt_ids), sampling=sampling_from_proto(msg.sampling),
                       features=msg.features, tenant=msg.tenant,
                       logprobs=msg.logprobs if msg.HasField("logprobs") else None, speculate=speculate)


def window_from_proto(msg: target_pb2.Verify, vocab_size: int, device: torch.device) -> WindowRequest:
    """The request of a Verify; its distributions are decoded (and checked) when the core asks."""
    drafts = list(msg.tokens)
    return WindowRequest(
        verify_id=msg.verify_id, drafts=drafts, probs=list(msg.probs),
        distributions=lambda: distributions_from_proto(msg, drafts, vocab_size, device),
        has_distributions=bool(msg.distributions), side_tokens=list(msg.side_tokens),
        side_parents=list(msg.side_parents), relaxed=msg.relaxed,
        relaxed_threshold=msg.relaxed_threshold if msg.HasField("relaxed_threshold") else None,
        top_logprobs=msg.top_logprobs, steps=msg.steps)


def reply_to_proto(reply: Reply) -> target_pb2.TargetResponse:
    j, batch, verdict = reply.judged, reply.batch, reply.judged.verdict
    return target_pb2.TargetResponse(verified=target_pb2.Verified(
        top_logprobs=top_logprobs_to_proto(j.top), features=features_to_proto(*j.features) if j.features else None,
        accepted_tokens=j.accepted, verify_id=reply.verify_id, num_accepted=verdict.num_accepted,
        next_token=verdict.next_token, num_strict=verdict.num_strict, js_distances=verdict.js_distances,
        forward_seconds=batch.forward_seconds, batch_size=batch.batch_size, batch_tokens=batch.batch_tokens,
        decode_seconds_per_token=reply.decode_cost, drafted=j.drafted, prefill_seconds=reply.prefill_seconds,
        emitted_logprobs=[target_pb2.EmittedLogprob(logprob=e.logprob, top_ids=e.top_ids,
                                                    top_logprobs=e.top_logprobs) for e in j.emitted]))


def closed_to_proto(closed: Closed) -> target_pb2.TargetResponse:
    return target_pb2.TargetResponse(closed=target_pb2.TargetClosed(
        policy_state=closed.policy_state, policy_scale=closed.policy_scale, num_drafted=closed.num_drafted,
        draft_seconds=closed.draft_seconds, grammar_drafted=closed.grammar_drafted))


def distributions_from_proto(msg: target_pb2.Verify, drafts: list[int], vocab: int,
                             device: torch.device) -> torch.Tensor | None:
    """q [k, V] from the request; None for a point mass (n-gram) or greedy verification.
    Checked before use (check_distributions): the rule accepts x when u * q(x) <= p(x), so a
    q(x) <= 0 accepts every draft, and NaNs or negative entries break the residual."""
    if not msg.distributions:
        return None
    k = len(drafts)
    if len(msg.distributions) != k:
        raise InvalidRequest("distributions", f"expected {k} distributions, got {len(msg.distributions)}")
    rows = []
    for i, d in enumerate(msg.distributions):
        if d.WhichOneof("encoding") != "dense_f32":
            idx = np.asarray(d.sparse.indices, dtype=np.int64)
            if len(idx) != len(d.sparse.values) or (idx.size and (idx.min() < 0 or idx.max() >= vocab)):
                raise InvalidRequest("distributions", f"distribution {i}: sparse indices must be in "
                                                      f"[0, {vocab}), one per value")
        try:  # on the CPU: checked there, then one copy to the device
            rows.append(distribution_from_proto(d, vocab, torch.device("cpu")))
        except ValueError as e:
            raise InvalidRequest("distributions", f"distribution {i}: {e}") from None
    q = torch.stack(rows)
    check_distributions(q, drafts)
    return q.to(device)


def check_distributions(q: torch.Tensor, drafts: list[int]) -> None:
    """InvalidRequest naming `distributions` unless every row of q [k, V] is finite,
    non-negative, sums to 1 and gives its drafted token q(x) > 0 (it was drawn from it)."""
    finite = torch.isfinite(q).all(-1)
    nonneg = (q >= 0).all(-1)
    sums = q.sum(-1, dtype=torch.float64)
    ids = torch.tensor(drafts, dtype=torch.long).clamp(0, q.shape[-1] - 1)  # ids are range-checked later
    qx = q[torch.arange(len(drafts)), ids]
    for i in range(len(drafts)):
        if not (finite[i] and nonneg[i]):
            raise InvalidRequest("distributions", f"distribution {i}: entries must be finite and non-negative")
        if abs(float(sums[i]) - 1.0) > Q_SUM_SLACK:
            raise InvalidRequest("distributions", f"distribution {i}: must sum to 1, sums to {float(sums[i]):.6g}")
        if not qx[i] > 0:
            raise InvalidRequest("distributions", f"distribution {i}: q(x) of its drafted token {drafts[i]} must "
                                                  f"be > 0 (it was drafted from q)")
