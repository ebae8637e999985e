"""CUDA graphs for pooled forwards: one captured forward per bucket of (batch rows, query
width, key span), replayed with new inputs copied into its static tensors.

A step of a small model on a GPU is bound by kernel launches, not arithmetic: the embedded
135M model runs about fifteen kernels per layer, thirty layers, each launched from Python.
A graph replays all of them with one launch. It needs every tensor of the forward at a fixed
address and shape, which the KV pool (`specd.runtime.pool`) provides: its keys and values are
allocated once and written in place, and a forward's shape is fixed by (B, T, S).

A forward is padded up to the smallest bucket that holds it (padded rows and columns write
only the pool's trash slot and column, and are masked out), and runs eagerly when none does
(a prompt longer than the widest prefill bucket, a batch wider than the largest bucket, a draft
tree's custom mask). A prompt's prefill runs alone (one row) and is wider than any window:
one-row buckets of 32 to 512 columns hold it, since eagerly its thirty layers are launched one
kernel at a time, and on a serving GPU every other session waits for it.
`capture` captures every bucket a forward can meet (`keys`) at start-up, which the target
service does before it serves and then turns `lazy` off: a running server never captures, and
a forward with no graph (none should have none) runs eagerly and is counted in `missed`.
One-shot commands (`specd generate`, `specd bench`) keep `lazy` on and capture a bucket on its
first use instead. All graphs share one memory pool: they replay one at a time, on the pool's
compute thread.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence

import torch

from specd.runtime.pool import KVPool, PoolRow, unpack

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
WIDTH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 17)  # a verification window is at most 16 drafts + 1
PREFILL_WIDTHS = (32, 64, 128, 256, 512)  # one row: a prompt's prefill (or a chunk of it)
SPAN_BUCKETS = (256, 512, 1024, 2048, 4096, 8192)


def buckets_up_to(buckets: Sequence[int], limit: int) -> tuple[int, ...]:
    """The buckets below limit, then limit itself (so that every size up to it has a bucket)."""
    kept = [b for b in buckets if b < limit]
    return tuple(kept + [limit])


def pick_bucket(tables: Sequence[Sequence[int]], sizes: Sequence[int]) -> tuple[int, ...] | None:
    """Per dimension the smallest bucket >= the size (tables sorted), or None if one has none."""
    found = []
    for table, size in zip(tables, sizes):
        i = bisect.bisect_left(table, size)
        if i == len(table):
            return None
        found.append(table[i])
    return tuple(found)


def bucket_of(batches: Sequence[int], widths: Sequence[int], prefill_widths: Sequence[int],
              spans: Sequence[int], batch: int, width: int, span: int) -> tuple[int, int, int] | None:
    """The smallest (B, T, S) of these tables holding a forward of `batch` rows of `width` new
    tokens over `span` keys, or None; one row may take a prefill width."""
    row_widths = tuple(widths) + tuple(prefill_widths) if batch == 1 else widths
    return pick_bucket((batches, row_widths, spans), (batch, width, span))


def all_keys(batches: Sequence[int], widths: Sequence[int], prefill_widths: Sequence[int],
             spans: Sequence[int]) -> list[tuple[int, int, int]]:
    """Every bucket bucket_of can give: each batch x window width x span, and one row of each
    prefill width at each span that holds it (a forward's span counts its new tokens)."""
    keys = [(b, w, s) for s in spans for b in batches for w in widths]
    return keys + [(1, w, s) for w in prefill_widths for s in spans if s >= w]


class _Graph:
    def __init__(self, graph: torch.cuda.CUDAGraph, flat: torch.Tensor, output: torch.Tensor):
        self.graph, self.flat, self.output = graph, flat, output  # flat: the static inputs (pool.unpack)


class GraphRunner:
    """Captures and replays pooled forwards on one CUDA device."""

    def __init__(self, pool: KVPool, max_batch: int | None = None, max_width: int = WIDTH_BUCKETS[-1],
                 compiled: bool = False):
        """compiled: capture each layer compiled by torch.compile (KVPool.compile_layers), which
        fuses its elementwise kernels; compiled during the warm-up of each new branch's first
        capture."""
        assert pool.device.type == "cuda", "CUDA graphs need a CUDA pool"
        self.pool = pool
        if compiled:
            pool.compile_layers()
        self.batches = buckets_up_to(BATCH_BUCKETS, min(max_batch or pool.num_slots, pool.num_slots))
        self.widths = buckets_up_to(WIDTH_BUCKETS, max_width)
        self.spans = buckets_up_to(SPAN_BUCKETS, pool.max_len)
        self.prefill_widths = tuple(w for w in PREFILL_WIDTHS if self.widths[-1] < w <= pool.max_len)
        self.graphs: dict[tuple[int, int, int], _Graph] = {}
        self.mempool = torch.cuda.graph_pool_handle()
        self.replays = self.eager = 0  # forwards run each way (the device check reports them)
        self.lazy = True  # capture a bucket on its first use (off once `capture` has taken every key)
        self.captures = self.missed = 0  # graphs captured; forwards a bucket held but no graph had
        pool.runner = self

    def invalidate(self) -> None:
        """Drop the captured graphs (they hold the addresses of weights since replaced)."""
        self.graphs.clear()

    def uncompile(self) -> None:
        """Capture plain layers from now on (where compiling them failed): drops the compiled
        layer and every graph captured with it."""
        self.pool.compiled_layer = None
        self.invalidate()

    def bucket(self, batch: int, width: int, span: int) -> tuple[int, int, int] | None:
        """The smallest (B, T, S) holding a forward, or None when none does; one row wider than
        a window takes a prefill width."""
        return bucket_of(self.batches, self.widths, self.prefill_widths, self.spans, batch, width, span)

    def keys(self) -> list[tuple[int, int, int]]:
        """Every bucket a forward can be given (all_keys)."""
        return all_keys(self.batches, self.widths, self.prefill_widths, self.spans)

    def run(self, rows: Sequence[PoolRow], width: int, span: int) -> tuple[torch.Tensor, int] | None:
        """hidden [B', T', H] of rows (padded; row b's columns first) and the width T'; None when
        no bucket holds the forward (the pool then runs it eagerly)."""
        key = self.bucket(len(rows), width, span)
        if key is None:
            self.eager += 1
            return None
        graph = self.graphs.get(key)
        if graph is None:
            if not self.lazy:
                self.missed += 1
                self.eager += 1
                return None
            graph = self._capture(key)
        # the whole forward's inputs in one host-to-device copy, which does not wait for the device
        self.pool.to_device(self.pool.pack(rows, key[0], key[1]), graph.flat)
        graph.graph.replay()
        self.replays += 1
        return graph.output, key[1]

    @torch.inference_mode()
    def _capture(self, key: tuple[int, int, int]) -> _Graph:
        batch, width, span = key
        flat = self.pool.pack([], batch, width).to(self.pool.device)  # every row padded: writes only the trash
        static = unpack(flat, batch, width, span)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph (lazy initialisations, autotuning)
            for _ in range(2):
                self.pool.hidden(static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            output = self.pool.hidden(static)
        self.graphs[key] = _Graph(graph, flat, output)
        self.captures += 1
        return self.graphs[key]

    def capture(self, keys: Sequence[tuple[int, int, int]] | None = None,
                progress: Callable[[str], None] | None = None) -> float:
        """Capture the given buckets (default: every one, `keys`) now; the seconds it took."""
        keys = list(keys) if keys is not None else self.keys()
        t0 = time.perf_counter()
        for i, key in enumerate(keys):
            if key not in self.graphs:
                self._capture(key)
            if progress is not None and (i + 1 == len(keys) or (i + 1) % 8 == 0):
                progress(f"captured {i + 1}/{len(keys)} CUDA graphs")
        torch.cuda.synchronize(self.pool.device)
        return time.perf_counter() - t0
