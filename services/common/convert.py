"""Protobuf <-> domain conversion shared by every service: sampling
parameters, exact draft distributions and model descriptions."""

from __future__ import annotations

import numpy as np
import torch

from services.proto.specd.common.v1 import common_pb2
from specd.grammar import GrammarSpec
from specd.runtime.loading import LoadedModel, tokenizer_fingerprint
from specd.types import SamplingParams

# A distribution with at most this fraction of non-zero entries is sent sparse: 8 bytes per
# non-zero entry instead of 4 per vocabulary entry.
SPARSE_FRACTION = 0.5


def sampling_to_proto(s: SamplingParams) -> common_pb2.Sampling:
    msg = common_pb2.Sampling(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, logit_bias=dict(s.logit_bias))
    if s.seed is not None:
        msg.seed = s.seed
    if s.presence_penalty:
        msg.presence_penalty = s.presence_penalty
    if s.frequency_penalty:
        msg.frequency_penalty = s.frequency_penalty
    if s.repetition_penalty != 1.0:
        msg.repetition_penalty = s.repetition_penalty
    if s.grammar is not None:
        msg.grammar.kind, msg.grammar.schema = s.grammar.kind, s.grammar.schema
    return msg


def sampling_from_proto(msg: common_pb2.Sampling, max_new_tokens: int = 1,
                        stop: tuple[str, ...] = ()) -> SamplingParams:
    seed = msg.seed if msg.HasField("seed") else None
    # An unset message means greedy: proto3 defaults give top_p 0, which means "off" here.
    return SamplingParams(msg.temperature, msg.top_k, msg.top_p or 1.0, seed, max_new_tokens, stop,
                          msg.presence_penalty, msg.frequency_penalty,
                          msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
                          tuple(sorted(msg.logit_bias.items())),
                          GrammarSpec(msg.grammar.kind, msg.grammar.schema) if msg.HasField("grammar") else None)


def distribution_to_proto(q: torch.Tensor) -> common_pb2.Distribution:
    """q [V] float32 -> Distribution, exact: sparse when most entries are zero."""
    # numpy, not torch: tiny torch ops pay the intra-op thread pool's wake-up (ms on a busy CPU).
    q = q.detach().to("cpu", torch.float32).numpy()
    if np.count_nonzero(q) <= SPARSE_FRACTION * q.size:
        nonzero = np.flatnonzero(q)
        return common_pb2.Distribution(sparse=common_pb2.SparseDistribution(
            indices=nonzero.tolist(), values=q[nonzero].tolist()))
    return common_pb2.Distribution(dense_f32=q.astype("<f4", copy=False).tobytes())


def distribution_from_proto(msg: common_pb2.Distribution, vocab_size: int,
                            device: torch.device) -> torch.Tensor:
    if msg.WhichOneof("encoding") == "dense_f32":
        q = torch.from_numpy(np.frombuffer(msg.dense_f32, dtype="<f4").copy())
        if q.numel() != vocab_size:
            raise ValueError(f"distribution has {q.numel()} entries, the vocabulary {vocab_size}")
    else:
        dense = np.zeros(vocab_size, dtype=np.float32)
        dense[np.asarray(msg.sparse.indices, dtype=np.int64)] = np.asarray(msg.sparse.values, dtype=np.float32)
        q = torch.from_numpy(dense)
    return q.to(device)


def model_info(m: LoadedModel) -> common_pb2.ModelInfo:
    fingerprint = tokenizer_fingerprint(m.tokenizer) if m.tokenizer is not None else ""
    dtype = str(next(m.model.parameters()).dtype).removeprefix("torch.")
    return common_pb2.ModelInfo(name=m.name, vocab_size=m.vocab_size, tokenizer_fingerprint=fingerprint,
                                max_context=m.max_context, eos_token_ids=sorted(m.eos_token_ids),
                                device=f"{m.device}/{dtype}")


def top_logprobs_to_proto(top: tuple[torch.Tensor, torch.Tensor] | None) -> list[common_pb2.TopLogprobs]:
    """(log-probs [j, k], ids [j, k]) from specd.dvi.top_logprobs -> one message per position."""
    if top is None:
        return []
    lps, ids = top
    return [common_pb2.TopLogprobs(ids=i, logprobs=lp) for i, lp in zip(ids.tolist(), lps.tolist())]


def top_logprobs_from_proto(msgs) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per position (ids [k], log-probs [k]); a message with unequal lengths is refused."""
    out = []
    for m in msgs:
        if len(m.ids) != len(m.logprobs) or not m.ids:
            raise ValueError(f"{len(m.ids)} ids but {len(m.logprobs)} log-probs")
        out.append((torch.tensor(list(m.ids), dtype=torch.long), torch.tensor(list(m.logprobs), dtype=torch.float32)))
    return out


def features_to_proto(start: int, hidden: torch.Tensor) -> common_pb2.Features:
    """Hidden states [rows, H] of positions start.. as float32 bytes."""
    h = hidden.detach().to("cpu", torch.float32).contiguous()
    return common_pb2.Features(start=start, rows=h.shape[0], hidden_size=h.shape[1], data=h.numpy().tobytes())


def features_from_proto(msg: common_pb2.Features) -> tuple[int, torch.Tensor] | None:
    """(start, hidden [rows, H]) or None for an empty message; a size mismatch raises ValueError."""
    if msg.rows == 0:
        return None
    if msg.start < 0 or msg.hidden_size <= 0 or len(msg.data) != 4 * msg.rows * msg.hidden_size:
        raise ValueError(f"{len(msg.data)} bytes for {msg.rows} rows of {msg.hidden_size} float32 from {msg.start}")
    h = torch.frombuffer(bytearray(msg.data), dtype=torch.float32).view(msg.rows, msg.hidden_size)
    return msg.start, h
