"""Tensor parallelism for a target of any family the lean forward runs (Megatron-LM's split, as
gpt-fast applies it).

Each of N ranks holds 1/N of every layer: the query, key and value projections of its share of
the attention heads (column-parallel), the attention output projection over those heads
(row-parallel), and its share of the MLP's intermediate columns (gate and up column-parallel,
down row-parallel). The two row-parallel products are summed across ranks (one all-reduce each
per layer), so every rank ends a layer with the full hidden state; embeddings, norms and the LM
head are replicated (so are q/k norms, which act on each head alike); biases of column-parallel
products are split with their rows, those of row-parallel ones added once, after the sum. A fused
q/k/v or gate/up linear (Phi-3) is split part by part. Each rank's KV pool holds its own heads'
keys and values.

Rank 0 runs the service. Every forward it runs over its KV pool, and every rearrangement of a
slot's cache (a draft tree's `keep_path`), is broadcast to the other ranks first (`KVPool.tp`),
which run the same forward over their shards (`follow`): the same rows, the same positions,
their own heads. Sums across ranks round differently from one process's products, so logits
agree with the unsharded model within float32 tolerance, not bit for bit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from specd.errors import InvalidRequest


@dataclass(frozen=True)
class TensorParallel:
    rank: int
    world: int
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> TensorParallel | None:
        """The process's place in a torchrun launch (RANK, WORLD_SIZE, LOCAL_RANK), or None."""
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            return None
        return cls(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0")))

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def init(self, device: torch.device) -> None:
        """Join the process group (NCCL between GPUs, gloo on the CPU), once."""
        if not dist.is_initialized():
            # A follower waits in a broadcast while the service is idle: no collective timeout.
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=self.rank,
                                    world_size=self.world, timeout=timedelta(days=365))

    def close(self) -> None:
        """Leave the process group. A process that exits without it can abort in a destructor
        of the group's threads ("terminate called without an active exception")."""
        if dist.is_initialized():
            if dist.get_backend() == "gloo":  # every rank done before any tears its connections down
                try:  # (without, one exit in three aborted); a rank that died must not hold the rest
                    dist.monitored_barrier(timeout=timedelta(seconds=30))
                except RuntimeError:
                    pass
            dist.destroy_process_group()

    def broadcast(self, message: object = None) -> object:
        """Rank 0's message on every rank."""
        box = [message]
        dist.broadcast_object_list(box, src=0)
        return box[0]


class AllReduce(torch.nn.Module):
    """A row-parallel projection: this rank's partial product, summed over the ranks, then the
    bias (each rank holds all of it)."""

    def __init__(self, linear: torch.nn.Module):
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.linear(x, self.linear.weight)
        dist.all_reduce(y)
        return y if self.linear.bias is None else y + self.linear.bias


def check_shardable(config, world: int) -> None:
    """InvalidRequest naming tensor_parallel when the model's heads or MLP do not split N ways."""
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, name)
        if value % world:
            raise InvalidRequest("tensor_parallel", f"the model's {name} ({value}) does not split over {world} ranks")


@torch.no_grad()
def shard(model: torch.nn.Module, tp: TensorParallel) -> None:
    """Keep this rank's share of every layer of a transformers causal LM the lean forward runs,
    in place (before its linear kernels are packed), and sum the row-parallel products across
    ranks."""
    config = model.config
    check_shardable(config, tp.world)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q, kv, inner = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim, config.intermediate_size
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        if hasattr(a, "qkv_proj"):  # Phi-3's fused q/k/v: this rank's heads of each part
            _keep_parts(a.qkv_proj, (q, kv, kv), tp)
        else:
            for proj in (a.q_proj, a.k_proj, a.v_proj):
                _keep(proj, 0, tp)  # output rows: this rank's heads
        if hasattr(m, "gate_up_proj"):
            _keep_parts(m.gate_up_proj, (inner, inner), tp)
        else:
            for proj in (m.gate_proj, m.up_proj):
                _keep(proj, 0, tp)  # output rows: this rank's intermediate columns
        for proj in (a.o_proj, m.down_proj):
            _keep(proj, 1, tp)  # input columns: the same heads / columns
        a.o_proj, m.down_proj = AllReduce(a.o_proj), AllReduce(m.down_proj)
    config.head_dim = head_dim
    config.num_attention_heads //= tp.world
    config.num_key_value_heads //= tp.world
    config.intermediate_size //= tp.world


def _keep(linear: torch.nn.Linear, dim: int, tp: TensorParallel) -> None:
    weight = linear.weight
    share = weight.shape[dim] // tp.world
    linear.weight = torch.nn.Parameter(weight.narrow(dim, tp.rank * share, share).clone(), requires_grad=False)
    if dim == 0:
        linear.out_features = share
        if linear.bias is not None:
            linear.bias = torch.nn.Parameter(linear.bias.narrow(0, tp.rank * share, share).clone(), requires_grad=False)
    else:
        linear.in_features = share


def _keep_parts(linear: torch.nn.Linear, parts: tuple[int, ...], tp: TensorParallel) -> None:
    """_keep(linear, 0) for each of the output parts a fused linear stacks (q, k, v or gate, up)."""
    def mine(t: torch.Tensor) -> torch.Tensor:
        pieces, at = [], 0
        for n in parts:
            share = n // tp.world
            pieces.append(t.narrow(0, at + tp.rank * share, share))
            at += n
        return torch.cat(pieces).clone()

    linear.weight = torch.nn.Parameter(mine(linear.weight), requires_grad=False)
    if linear.bias is not None:
        linear.bias = torch.nn.Parameter(mine(linear.bias), requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def agree(tp: TensorParallel, value: int) -> int:
    """The smallest of every rank's value (each rank sizes its KV pool from its own free memory;
    the pools must hold the same slots)."""
    values = [None] * tp.world
    dist.all_gather_object(values, value)
    return min(values)


def follow(pool, tp: TensorParallel) -> None:
    """A rank other than 0: run the forwards rank 0 broadcasts over this rank's KV pool until it
    says stop. SIGTERM and SIGINT (which torchrun sends every rank) are rank 0's to act on: it
    drains its calls, then says stop."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    while True:
        message = tp.broadcast()
        kind = message[0]
        if kind == "forward":
            pool.follow(message[1])
        elif kind == "keep_path":
            pool.keep_path(*message[1:])
        else:
            return


def stop_followers(tp: TensorParallel) -> None:
    tp.broadcast(("stop",))
