"""Static KV memory: one preallocated pool of per-session slots, and a batched lean forward
that reads and writes it in place.

The pool holds every layer's keys and values in two tensors allocated once,

    k, v: [layers, slots + 1, kv_heads, max_len + 1, head_dim]

A session owns one slot and a length; rollback sets the length, closing returns the slot at
once. A forward takes rows from any number of slots (a decode step, a verification window, a
prefill chunk each) as one rectangular batch [B, T], right-padded:

- each real new token writes its keys/values at (slot, position) in place (`index_put_`);
- padded query columns write into the *trash column* `max_len`, and padded batch rows into the
  *trash slot* `slots`, which nothing ever reads;
- each row attends over the first S columns of its slot (gathered once per layer) under the
  mask `key <= query position`, so stale keys past a row's length (rejected drafts, a shorter
  rollback) are never seen: they are overwritten before a later query could reach them.

Nothing is copied per session and nothing grows: every tensor of a forward has a shape fixed by
(B, T, S). That is what lets `specd.runtime.graphs` capture a forward per bucket of those three
in a CUDA graph and replay it. The arithmetic is the lean forward's (`specd.runtime.lean`), in
the same order; only the attention reads a padded key range, whose masked keys get exactly
zero weight.
"""

from __future__ import annotations

import mmap
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from specd.errors import InvalidRequest, Overloaded
from specd.runtime import rows as few_rows
from specd.runtime.lean import LeanModel

# Windows up to this many query rows attend through batched matrix products rather than a fused
# attention kernel, whose tiles are mostly idle for so few rows (docs/engine.md, "Static KV memory").
MATMUL_ATTENTION_WIDTH = 32
# Fused forwards of 2..GEMV_ROWS query rows in all run each projection as one matrix-vector product
# per row, batched (KVPool.gemv_rows; 0: never): float32 matrix products of a few rows pick tiled
# GPU kernels that cost more (docs/engine.md, "Static KV memory").
GEMV_ROWS = 8

Head = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class PoolRow:
    """One row of a pooled forward: feed `ids` after the slot's first `start` positions and
    return logits (and, if wanted, final-normed hidden states) of the last `num_logits`."""

    slot: int
    start: int
    ids: Sequence[int]
    num_logits: int
    want_hidden: bool = False
    mask: torch.Tensor | None = None  # a draft tree's bool mask [T, start + T] (True: attend)
    positions: torch.Tensor | None = None  # a draft tree's rotary positions [T]


@dataclass(frozen=True)
class StepInputs:
    """The padded tensors of one forward; what a CUDA graph takes as its static inputs."""

    input_ids: torch.Tensor  # [B, T] long
    write_pos: torch.Tensor  # [B, T] long: cache column each query writes (trash when padded)
    rope_pos: torch.Tensor  # [B, T] long: rotary position of each query
    slots: torch.Tensor  # [B] long: pool slot of each row (trash when padded)
    query_pos: torch.Tensor  # [B, T] long: a query sees keys 0..query_pos (padded queries: key 0)
    span: int  # S: key columns read
    tree_mask: torch.Tensor | None = None  # [B, 1, T, S] bool, replacing the causal rule (trees)
    slot_run: int | None = None  # eager forwards only: rows are slots slot_run, slot_run + 1, ... (no gather)
    write_run: tuple[int, int, int] | None = None  # eager, one unpadded row: (slot, start, n), written by slices
    packed: torch.Tensor | None = None  # exact eager forwards of unequal rows: flat indices of the real queries
    # exact eager forwards whose rows' contexts differ widely: (rows, key span, the slot of a lone row)
    # groups, each attending alone (a lone row reads its slot as a view, without a gather)
    groups: tuple[tuple[torch.Tensor, int, int | None], ...] | None = None


def _madvise_dontneed():
    """madvise(addr, length, MADV_DONTNEED) from the C library, or None where there is none."""
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    madvise = libc.madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return lambda addr, length: madvise(addr, length, 4)  # MADV_DONTNEED


_MADVISE = _madvise_dontneed()
_PAGE = mmap.PAGESIZE


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on the CPU in an anonymous memory mapping of its own, whose pages the kernel
    maps only when first written (and takes back on MADV_DONTNEED, KVPool._discard), so a pool
    costs memory for the positions open sessions use, not for every slot's whole length
    (torch.zeros writes every page at once; a calloc'd block may come from already resident heap)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import numpy as np

    size = torch.empty((), dtype=dtype).element_size()
    if size not in (1, 2, 4, 8):
        return torch.zeros(shape, dtype=dtype)
    count = 1
    for n in shape:
        count *= n
    mapping = mmap.mmap(-1, max(count * size, 1))
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # one write must map one page, not 2 MB
        mapping.madvise(mmap.MADV_NOHUGEPAGE)
    raw = np.frombuffer(mapping, dtype={1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[size], count=count)
    return torch.from_numpy(raw.reshape(shape)).view(dtype)  # zero bits, reinterpreted; keeps the mapping alive


def unpack(flat: torch.Tensor, batch: int, width: int, span: int) -> StepInputs:
    """StepInputs as views of one flat long tensor (ids, write, rope, query positions: [B, T]
    each; then slots [B]): one host-to-device copy fills a whole forward's inputs."""
    n = batch * width
    ids, write, rope, qpos = (flat[i * n:(i + 1) * n].view(batch, width) for i in range(4))
    return StepInputs(ids, write, rope, flat[4 * n:4 * n + batch], qpos, span)


class KVPool:
    """Preallocated KV slots for one lean model. Slots may be taken and given back from any
    thread; forwards run on one compute thread at a time (the target service's batcher)."""

    def __init__(self, lean: LeanModel, slots: int, max_len: int, head: Head | None = None,
                 fused: bool | None = None):
        """head: final-normed hidden states [n, H] -> (float32 logits [n, V], what a row that wants
        hidden states gets); default the model's LM head and the states themselves (an
        early-exit drafter brings its adapter and reduced head).

        fused (default: on a GPU): fewer kernels for the same math (a fused RMSNorm, q and k
        rotated together, keys gathered per query head in one kernel, attention of a few query
        rows as batched matrix products).
        A GPU step of a small model is bound by the number of kernels it launches; the sums
        round differently from transformers' order, so the CPU keeps the exact path, whose
        logits are the lean forward's bit for bit."""
        if slots < 1:
            raise InvalidRequest("kv_slots", "must be at least 1")
        if max_len < 2:
            raise InvalidRequest("kv_max_len", "must be at least 2")
        self.lean = lean
        self.head = head or (lambda h: (lean.logits(h).float(), h))
        self.num_slots, self.max_len = slots, max_len
        self.device, self.dtype = lean.device, lean.dtype
        shape = (len(lean.layers), slots + 1, lean.kv_heads, max_len + 1, lean.head_dim)
        # Zeros, not garbage: a masked key gets zero weight, and 0 * finite stays 0 in the sum.
        with torch.inference_mode(False):
            self.k, self.v = _zeros(shape, self.dtype, self.device), _zeros(shape, self.dtype, self.device)
        # per rotary kind (Gemma 3's local and global layers), cos and sin for every column, trash included
        self.tables = [(c[:max_len + 1], s[:max_len + 1]) for c, s in lean.rope_tables(max_len + 1)]
        self.cos, self.sin = self.tables[0]
        self.fused = self.device.type == "cuda" if fused is None else fused
        self.gemv_rows = GEMV_ROWS
        self.pinned = self.device.type == "cuda"  # host-side inputs in page-locked memory (to_device)
        half = lean.rotary_dim // 2
        # rotate_half(x) * sin == roll(x, half) * (sin with its first half negated)
        self.signed_tables = [(c, torch.cat([-s[:, :half], s[:, half:]], dim=-1)) for c, s in self.tables]
        self._free = list(range(slots - 1, -1, -1))  # pop() hands out the lowest free slot
        self._lock = threading.Lock()
        self.lengths = [0] * slots
        self.written = [0] * slots  # each slot's high-water mark: the positions whose pages are mapped
        # what runs forwards that fit it: a specd.runtime.graphs.GraphRunner (CUDA graphs) or a
        # specd.runtime.aot.AotRunner (compiled for the CPU); None: every forward eager
        self.runner = None
        self.layer = FusedLayer(lean)  # the fused path's layer
        self.compiled_layer = None  # self.layer through torch.compile (compile_layers)
        self._weights = None  # what the layer reads, per layer (_layer_weights)
        self.tp = None  # rank 0 of a tensor-parallel target: each forward is mirrored (specd.runtime.tp)
        self.virtual = None  # a specd.runtime.virtual.VirtualDevice: each forward takes its profile's time

    # slots ---------------------------------------------------------------------------------

    @property
    def trash_slot(self) -> int:
        return self.num_slots

    def in_use(self) -> int:
        return self.num_slots - len(self._free)

    def acquire(self) -> int:
        """A free slot, emptied; Overloaded when every slot is taken (never a wait)."""
        with self._lock:
            if not self._free:
                raise Overloaded(f"all {self.num_slots} KV slots are in use")
            slot = self._free.pop()
            self.lengths[slot] = 0
            return slot

    def release(self, slot: int) -> None:
        """Give the slot back; on the CPU its written pages go back to the kernel at once."""
        with self._lock:
            assert 0 <= slot < self.num_slots and slot not in self._free, slot
            self._discard(slot)
            self.lengths[slot] = 0
            self._free.append(slot)
            self._free.sort(reverse=True)

    def _discard(self, slot: int) -> None:
        """Return the pages of the slot's written positions to the kernel (MADV_DONTNEED on the
        pool's anonymous mapping: they read as zeros again and cost no memory until written).
        A CPU pool's memory then follows its open sessions, not every session it ever held."""
        written, self.written[slot] = self.written[slot], 0
        if self.device.type != "cpu" or written == 0 or _MADVISE is None:
            return
        layers, _, heads, _, dim = self.k.shape
        run = written * dim * self.k.element_size()  # one (layer, head)'s written positions, contiguous
        for t in (self.k, self.v):
            for layer in range(layers):
                for head in range(heads):
                    start = t[layer, slot, head].data_ptr()
                    first = -(-start // _PAGE) * _PAGE  # whole pages only: neighbours share the edges
                    last = (start + run) // _PAGE * _PAGE
                    if last > first:
                        _MADVISE(first, last - first)

    @torch.inference_mode()
    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Slot src's first n positions into slot dst, which then holds them (a prompt prefix
        two sessions share: computed once). On the compute thread, between forwards."""
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.lengths[dst] = n
        self.written[dst] = max(self.written[dst], n)
        if self.virtual is not None:
            self.virtual.copied(src, dst, n)

    def bytes_per_token(self) -> int:
        layers, _, heads, _, dim = self.k.shape
        return 2 * layers * heads * dim * self.k.element_size()

    def session(self) -> PoolSession:
        fused = self.lean._fused_from
        self.lean._refresh()  # weights trained in place since (an early-exit adapter layer): fuse anew
        if self.lean._fused_from is not fused and self.runner is not None:
            self.runner.invalidate()  # captured or compiled with the old weights' addresses
        return PoolSession(self)

    # forwards ------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, rows: Sequence[PoolRow]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """One forward over every row; per row float32 logits [num_logits, V] and the hidden
        states of the same positions when wanted. Advances each slot's length by len(ids)."""
        for r in rows:
            assert 1 <= r.num_logits <= len(r.ids), (r.num_logits, len(r.ids))
            assert r.start == self.lengths[r.slot], (r.start, self.lengths[r.slot])
            if r.start + len(r.ids) > self.max_len:
                raise InvalidRequest("tokens", f"the session would pass the KV slot's {self.max_len} positions")
        assert len({r.slot for r in rows}) == len(rows), "a slot appears twice in one batch"
        started = time.perf_counter()
        if self.tp is not None:
            self.tp.broadcast(("forward", list(rows)))
        hidden, width = self._hidden_rows(rows)
        # Only the wanted rows go through the LM head (on a CPU the head is a large part of a step).
        picks = [b * width + len(r.ids) - r.num_logits + j for b, r in enumerate(rows) for j in range(r.num_logits)]
        flat = hidden.reshape(-1, hidden.shape[-1])
        if picks == list(range(picks[0], picks[0] + len(picks))):  # one run of rows: no index to copy over
            chosen = flat[picks[0]:picks[0] + len(picks)]
            if any(r.want_hidden for r in rows):
                chosen = chosen.clone()  # a graph's output is overwritten by its next replay
        else:
            chosen = flat[self.to_device(torch.tensor(picks, pin_memory=self.pinned))]
        logits, states = self.head(chosen)
        out, at = [], 0
        for r in rows:
            n = r.num_logits
            out.append((logits[at:at + n], states[at:at + n] if r.want_hidden else None))
            at += n
        if self.virtual is not None:
            self.virtual.finish(started, rows, out)
        return out

    def _hidden_rows(self, rows: Sequence[PoolRow]) -> tuple[torch.Tensor, int]:
        """The rows' hidden states (replayed from a CUDA graph where one fits) and the width they
        are padded to; advances each slot's length."""
        width, span = max(len(r.ids) for r in rows), self.span(rows)
        replayed = None
        if self.runner is not None and all(r.mask is None for r in rows):
            replayed = self.runner.run(rows, width, span)
        if replayed is not None:
            hidden, width = replayed
        else:
            hidden = self.hidden(self.inputs(rows, len(rows), width, span))
        for r in rows:
            self.lengths[r.slot] = r.start + len(r.ids)
            self.written[r.slot] = max(self.written[r.slot], self.lengths[r.slot])
        return hidden, width

    @torch.inference_mode()
    def follow(self, rows: Sequence[PoolRow]) -> None:
        """A tensor-parallel rank other than 0: the forward rank 0 broadcast, over this rank's
        heads (its slots' lengths are rank 0's; the LM head is rank 0's alone)."""
        for r in rows:
            self.lengths[r.slot] = r.start
        self._hidden_rows(rows)

    @torch.inference_mode()
    def keep_path(self, slot: int, base: int, nodes: list[int]) -> None:
        """After a tree forward whose nodes start at column `base` of a slot: move the kept nodes'
        keys and values to base, base + 1, ... (PoolSession.keep_path)."""
        if self.tp is not None:
            self.tp.broadcast(("keep_path", slot, base, nodes))
        if nodes != list(range(len(nodes))):
            src = torch.tensor(nodes, device=self.device) + base
            for t in (self.k, self.v):
                t[:, slot, :, base:base + len(nodes)] = t[:, slot].index_select(2, src)
        self.lengths[slot] = min(self.lengths[slot], base + len(nodes))

    def span(self, rows: Sequence[PoolRow]) -> int:
        """Key columns a forward must read: up to the furthest position any row writes."""
        return max(r.start + len(r.ids) for r in rows)

    def pack(self, rows: Sequence[PoolRow], batch: int, width: int) -> torch.Tensor:
        """The integer inputs of rows in a [batch, width] forward (batch >= len(rows), width >=
        every row's length) as one flat CPU tensor (unpack's layout): padded queries write the
        trash column of their row's slot, padded rows the trash slot; a padded query sees key 0
        only, so its attention stays finite. Built as one Python list and one tensor: on a GPU
        this host work sits between a step's token and the next step's launch. For a GPU pool the
        tensor is page-locked, so that its copy to the device does not wait for the device."""
        n = batch * width
        ids, rope, qpos = [0] * n, [0] * n, [0] * n
        write, slots = [self.max_len] * n, [self.trash_slot] * batch
        for b, r in enumerate(rows):
            k, at = len(r.ids), b * width
            pos = range(r.start, r.start + k)
            ids[at:at + k] = r.ids
            write[at:at + k] = qpos[at:at + k] = pos
            rope[at:at + k] = pos if r.positions is None else r.positions.tolist()
            slots[b] = r.slot
        return torch.tensor(ids + write + rope + qpos + slots, dtype=torch.long, pin_memory=self.pinned)

    def to_device(self, flat: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """A packed forward's inputs on the pool's device (into `out` when given). A GPU copy
        goes from page-locked memory without waiting for the device: a plain copy_ from pageable
        memory synchronizes the stream, so the host could not prepare a step while one runs."""
        if out is None:
            return flat.to(self.device, non_blocking=flat.is_pinned())
        return out.copy_(flat, non_blocking=flat.is_pinned())

    def inputs(self, rows: Sequence[PoolRow], batch: int, width: int, span: int) -> StepInputs:
        """The padded inputs of rows on the pool's device, reading `span` key columns (span >=
        self.span(rows)); with a draft tree's mask where a row brings one."""
        x = unpack(self.to_device(self.pack(rows, batch, width)), batch, width, span)
        first = rows[0].slot if rows else None
        if len(rows) == batch and all(r.slot == first + b for b, r in enumerate(rows)):
            x = replace(x, slot_run=first)  # the rows' slots are one run: read them as a view
        if len(rows) == batch == 1 and len(rows[0].ids) == width:  # a lone row: plain slice writes
            x = replace(x, write_run=(first, rows[0].start, width))
        if not self.fused and len(rows) == batch:
            x = replace(x, packed=self.real_queries(rows, width))
        if not self.fused and len(rows) == batch > 1:
            x = replace(x, groups=self._span_groups(rows))
        trees = [(b, r) for b, r in enumerate(rows) if r.mask is not None]
        if not trees:
            return x
        mask = torch.arange(span, device=self.device) <= x.query_pos[:, :, None]  # [B, T, S]
        for b, r in trees:
            n, cols = len(r.ids), r.start + len(r.ids)
            mask[b, :n] = False
            mask[b, :n, :cols] = r.mask.to(self.device)
        return replace(x, tree_mask=mask[:, None])

    def real_queries(self, rows: Sequence[PoolRow], width: int) -> torch.Tensor | None:
        """The flat indices of rows' real queries in a [len(rows), width] forward (the packed
        layout, `hidden`); None when every row fills the width."""
        if all(len(r.ids) == width for r in rows):
            return None
        real = [b * width + j for b, r in enumerate(rows) for j in range(len(r.ids))]
        return torch.tensor(real, device=self.device)

    def _span_groups(self, rows: Sequence[PoolRow]) -> tuple[tuple[torch.Tensor, int, int | None], ...] | None:
        """Rows whose key spans differ more than twofold attend in separate groups, each over its
        own longest span: one long context in a batch would otherwise make every row gather and
        attend over its length. None when one group holds every row."""
        spans = [r.start + len(r.ids) for r in rows]
        order = sorted(range(len(rows)), key=spans.__getitem__)
        groups, current = [], [order[0]]
        for b in order[1:]:
            if spans[b] > 2 * spans[current[0]]:
                groups.append(current)
                current = []
            current.append(b)
        groups.append(current)
        if len(groups) == 1:
            return None
        return tuple((torch.tensor(g, device=self.device), max(spans[b] for b in g),
                      rows[g[0]].slot if len(g) == 1 else None) for g in groups)

    def hidden(self, x: StepInputs, ks: Sequence[torch.Tensor] | None = None,
               vs: Sequence[torch.Tensor] | None = None,
               tables: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """The final-normed hidden states [B, T, H] of a padded forward; writes the pool. Every
        shape is fixed by x, and nothing here reads a tensor back to the host (capturable).
        ks, vs: each layer's keys and values, tables: the rotary cos and sin tables, per rotary
        kind cos then sin (default the pool's own; a compiled forward takes them as inputs, specd.runtime.aot, so that their
        lengths, the pool's, are not constants of its library).

        Rows of unequal length (x.packed) run packed: the projections and the MLP, nearly all of
        a step's arithmetic, see only the real tokens, one after another; only the attention
        takes the padded [B, T] layout. So a verification window joining decode steps costs its
        own tokens, not the window's width for every row."""
        if self.fused:
            return self._hidden_fused(x)
        ks, vs = (self.k if ks is None else ks), (self.v if vs is None else vs)
        lean = self.lean
        batch, width = x.input_ids.shape
        span = x.span
        real = x.packed

        def padded(t: torch.Tensor) -> torch.Tensor:  # packed [1, N, C] -> [B, T, C], zeros between
            if real is None:
                return t
            return t.new_zeros(batch * width, t.shape[-1]).index_copy_(0, real, t[0]).view(batch, width, -1)
        # A compiled forward attends with the few-row operator, which reads the pool in place and
        # applies the causal rule itself; the eager one keeps SDPA (a run of slots is a view there,
        # and its logits stay transformers').
        compiled_attention = (torch.compiler.is_compiling() and x.tree_mask is None and lean.arch.plain_attention
                              and few_rows.attends(self.dtype, self.device))
        mask = x.tree_mask
        windows = {layer.window for layer in lean.layers} - {None}
        # One query sees every key up to itself: no mask (a traced forward takes any shape: masked).
        if mask is None and not compiled_attention and (torch.compiler.is_compiling() or (batch, width) != (1, 1)
                                                        or any(span > w for w in windows)):
            mask = (torch.arange(span, device=self.device) <= x.query_pos[:, :, None])[:, None]  # [B, 1, T, S]
        masks = {None: mask}
        for w in windows:  # a sliding layer's: the keys within its window of the query's position
            near = torch.compiler.is_compiling() or span > w  # else every key is within the window
            masks[w] = lean.window_mask(mask, w, torch.arange(span, device=self.device), x.rope_pos[:, None]) \
                if near else mask
        tables = self.tables if tables is None else [(tables[j], tables[j + 1]) for j in range(0, len(tables), 2)]
        rope = [(c[x.rope_pos][:, None], s[x.rope_pos][:, None]) for c, s in tables]  # [B, 1, T, D] per kind
        rows = x.slots[:, None]
        h = lean.embed_ids(x.input_ids if real is None else x.input_ids.reshape(-1)[real][None])
        for i, layer in enumerate(lean.layers):
            cos, sin = rope[layer.rope]
            mask = masks[layer.window]
            a = lean.rms(layer.norm_in, h)
            q, k, v = lean.split_heads(layer, padded(lean.project_qkv(layer, a)))
            q = lean.rotate(q, cos, sin)
            k = lean.rotate(k, cos, sin)
            pool_k, pool_v = ks[i], vs[i]
            if x.write_run is not None:  # a copy into a slice costs less than an index_put (a CPU decode step)
                slot, start, n = x.write_run
                pool_k[slot, :, start:start + n] = k[0]
                pool_v[slot, :, start:start + n] = v[0].transpose(0, 1)
            else:
                pool_k[rows, :, x.write_pos] = k.transpose(1, 2)  # [B, T, kv_heads, D] at (slot, column)
                pool_v[rows, :, x.write_pos] = v
            if x.groups is not None:  # contexts of very different lengths: each group over its own span
                out = q.new_empty(q.shape)
                for members, group_span, lone in x.groups:
                    if lone is not None:
                        keys, values = pool_k[lone:lone + 1, :, :group_span], pool_v[lone:lone + 1, :, :group_span]
                    else:
                        slots = x.slots.index_select(0, members)
                        keys = pool_k[:, :, :group_span].index_select(0, slots)
                        values = pool_v[:, :, :group_span].index_select(0, slots)
                    out[members] = lean.attend(q.index_select(0, members), keys, values,
                                               mask.index_select(0, members)[..., :group_span])
            elif compiled_attention:  # each row's keys read in place, each query's only up to its position
                out = few_rows.attention(q, pool_k, pool_v, x.slots, x.query_pos, lean.scaling)
            else:
                if x.slot_run is not None:
                    run = slice(x.slot_run, x.slot_run + batch)
                    keys, values = pool_k[run, :, :span], pool_v[run, :, :span]
                else:
                    keys = pool_k[:, :, :span].index_select(0, x.slots)
                    values = pool_v[:, :, :span].index_select(0, x.slots)
                out = lean.attend(q, keys, values, mask)
            out = out.transpose(1, 2).reshape(batch, width, lean.q_size)
            h = lean.finish(layer, h, out if real is None else out.reshape(-1, lean.q_size)[real][None])
        return padded(lean.final_norm(h))

    def _hidden_fused(self, x: StepInputs) -> torch.Tensor:
        """hidden(), in far fewer kernels than the exact path: a fused RMSNorm, q and k rotated
        together, each residual sum written by its matrix product (addmm_), and the g query heads
        that share a KV head attending as one block of g x T rows, so a forward gathers each row's
        keys and values once per KV head rather than once per query head. Each layer runs
        `FusedLayer`, or its compiled form (compile_layers), which fuses its elementwise work."""
        lean = self.lean
        batch, width = x.input_ids.shape
        kv_heads, groups = lean.kv_heads, lean.groups
        span = x.span
        mask = x.tree_mask
        if mask is None:
            mask = torch.arange(span, device=self.device) <= x.query_pos[:, :, None]
            mask = mask[:, None]
        keys = torch.arange(span, device=self.device)
        biases = {}
        for w in {layer.window for layer in lean.layers}:  # per sliding window (None: global layers)
            m = lean.window_mask(mask, w, keys, x.rope_pos[:, None])
            # An additive mask, made once per forward rather than converted by every layer's attention.
            bias = torch.zeros(m.shape, dtype=self.dtype, device=self.device).masked_fill_(~m, float("-inf"))
            # per (row, KV head): its g query heads' T queries, head-major (query head = KV head * g + j)
            biases[w] = bias, bias[:, :, None].expand(batch, kv_heads, groups, width, span).reshape(
                -1, groups * width, span)
        rope = [(c[x.rope_pos][:, :, None], s[x.rope_pos][:, :, None]) for c, s in self.signed_tables]  # [B, T, 1, D]
        gemv = 1 < batch * width <= self.gemv_rows
        # compiled for inference: a forward that tracks gradients (a drafter learning) runs eagerly
        run = self.layer if self.compiled_layer is None or torch.is_grad_enabled() else self.compiled_layer
        h = lean.embed_ids(x.input_ids)
        for i, (layer, weights) in enumerate(zip(lean.layers, self._layer_weights())):
            bias, bias_rows = biases[layer.window]
            cos, sin = rope[layer.rope]
            h = run(h, weights, self.k[i], self.v[i], bias, bias_rows, cos, sin, x.slots, x.write_pos, gemv)
        return _norm(h, *self._final_norm, lean.arch.gemma_norm)

    def _layer_weights(self) -> list[tuple]:
        """Per layer the tensors FusedLayer reads (FusedLayer.forward's order). A projection that
        keeps only a packed CPU copy (weight None) is read from its source linears, concatenated."""
        if self._weights is None or self._weights[0] is not self.lean.layers:  # fused anew since
            with torch.inference_mode(False), torch.no_grad():  # plain tensors: forwards may track gradients
                self._weights = (self.lean.layers, self._read_layer_weights())
                self._final_norm = _norm_weights(self.lean.norm, self.lean.arch.gemma_norm)
        return self._weights[1]

    def _read_layer_weights(self) -> list[tuple]:
        weights = []
        gemma = self.lean.arch.gemma_norm
        for layer in self.lean.layers:
            qkv_w = layer.qkv.weight if layer.qkv.weight is not None else torch.cat(_weights_of(layer.sources, "qkv"))
            gate_up_w = layer.gate_up.weight if layer.gate_up.weight is not None else torch.cat(
                _weights_of(layer.sources, "gate_up"))
            o, down = _linear(layer.o), _linear(layer.down)
            none = (None, 0.0)
            weights.append((
                *_norm_weights(layer.norm_in, gemma), qkv_w, layer.qkv_bias,
                *(_norm_weights(layer.q_norm, gemma) if layer.q_norm is not None else none),
                *(_norm_weights(layer.k_norm, gemma) if layer.k_norm is not None else none),
                o.weight, o.bias,
                *(_norm_weights(layer.norm_attn, gemma) if layer.norm_attn is not None else none),
                *_norm_weights(layer.norm_mlp_in, gemma), gate_up_w, layer.gate_up_bias,
                down.weight, down.bias,
                *(_norm_weights(layer.norm_mlp_out, gemma) if layer.norm_mlp_out is not None else none)))
        return weights

    def compile_layers(self) -> None:
        """Run every fused layer through torch.compile (inductor: on a GPU, Triton kernels that
        fuse a layer's norms, rotary embedding, KV writes and activations), one compiled function
        for all layers, its sizes symbolic. Compiles lazily, per branch of FusedLayer taken."""
        import torch._dynamo

        assert self.fused, "compiled layers are the fused path's"
        # one recompilation per branch taken (rows/width of 1 or more, few-row products or not)
        config = torch._dynamo.config
        limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # before torch 2.6
        setattr(config, limit, max(getattr(config, limit), 64))
        self.compiled_layer = torch.compile(self.layer, dynamic=True, fullgraph=True)


def _linear(module: torch.nn.Module) -> torch.nn.Linear:
    """The linear a row-parallel projection wraps (specd.runtime.tp.AllReduce), or the module."""
    return getattr(module, "linear", module)


def _weights_of(sources: list[torch.nn.Linear], which: str) -> list[torch.Tensor]:
    """The source weights of a layer's fused q/k/v (the linears before the MLP's) or gate/up."""
    split = 1 if len(sources) == 2 else 3  # Phi-3: one q/k/v linear and one gate/up linear
    return [m.weight for m in (sources[:split] if which == "qkv" else sources[split:])]


def _norm_weights(norm: torch.nn.Module, gemma: bool) -> tuple[torch.Tensor, float]:
    """An RMSNorm's weight as F.rms_norm takes it, and its epsilon: Gemma's (1 + w), in float32."""
    eps = getattr(norm, "variance_epsilon", None)
    eps = norm.eps if eps is None else eps
    return ((1.0 + norm.weight.float()) if gemma else norm.weight), eps


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    if gemma:  # in float32, as Gemma's norm computes
        return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(x.dtype)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


class FusedLayer(torch.nn.Module):
    """One decoder layer of the fused forward (KVPool._hidden_fused), for every layer: its
    weights come in as arguments, the model's sizes and family traits are attributes, which
    torch.compile takes as constants (with dynamic sizes, integers passed as arguments would be
    symbolic like the batch's)."""

    def __init__(self, lean: LeanModel):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.scaling = lean.heads, lean.kv_heads, lean.head_dim, lean.scaling
        arch = lean.arch
        self.rotary_dim, self.gemma_norm, self.softcap = lean.rotary_dim, arch.gemma_norm, arch.attn_softcap
        self.act = arch.act
        # tensor parallelism: the row-parallel products are summed over the ranks before their residual sums
        self.reduce = any(_linear(layer.o) is not layer.o for layer in lean.layers)

    def forward(self, h: torch.Tensor, weights: tuple, pool_k: torch.Tensor, pool_v: torch.Tensor,
                bias: torch.Tensor, bias_rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                slots: torch.Tensor, write_pos: torch.Tensor, gemv: bool) -> torch.Tensor:
        """Writes this layer's new keys and values into its pool tensors; the new residual stream
        [B, T, H]. gemv as in _add_product."""
        heads, kv_heads, dim, scaling = self.heads, self.kv_heads, self.head_dim, self.scaling
        (norm_in, eps_in, qkv_w, qkv_b, q_norm, q_eps, k_norm, k_eps, o_w, o_b, norm_attn, eps_attn,
         norm_mlp, eps_mlp, gate_up_w, gate_up_b, down_w, down_b, norm_out, eps_out) = weights
        gemma = self.gemma_norm
        batch, width = h.shape[0], h.shape[1]
        groups, q_size, kv_size, span = heads // kv_heads, heads * dim, kv_heads * dim, bias.shape[-1]
        project = _rows_product if gemv else F.linear
        a = _norm(h, norm_in, eps_in, gemma)
        qkv = project(a, qkv_w)
        if qkv_b is not None:
            qkv = qkv + qkv_b
        qk = qkv[..., :q_size + kv_size].view(batch, width, heads + kv_heads, dim)
        if q_norm is not None:  # Qwen3, Gemma 3: each head's query and key normed before rotation
            qk = torch.cat([_norm(qk[:, :, :heads], q_norm, q_eps, gemma),
                            _norm(qk[:, :, heads:], k_norm, k_eps, gemma)], dim=2)
        r = self.rotary_dim
        if r == dim:  # q and k rotated together
            qk = torch.addcmul(qk * cos, qk.roll(dim // 2, dims=-1), sin)
        else:  # partial rotary: the rest of each head passes through
            rot = qk[..., :r]
            qk = torch.cat([torch.addcmul(rot * cos, rot.roll(r // 2, dims=-1), sin), qk[..., r:]], dim=-1)
        v = qkv[..., q_size + kv_size:].view(batch, width, kv_heads, dim)
        pool_k[slots[:, None], :, write_pos] = qk[:, :, heads:]
        pool_v[slots[:, None], :, write_pos] = v
        keys = pool_k[:, :, :span].index_select(0, slots)  # [B, kv_heads, S, D]
        values = pool_v[:, :, :span].index_select(0, slots)
        if width <= MATMUL_ATTENTION_WIDTH or self.softcap is not None:  # a few query rows: three small kernels
            q = qk[:, :, :heads].view(batch, width, kv_heads, groups, dim).permute(0, 2, 3, 1, 4)
            q, k_t = q.reshape(-1, groups * width, dim), keys.reshape(-1, span, dim).transpose(1, 2)
            if self.softcap is None:
                scores = torch.baddbmm(bias_rows, q, k_t, alpha=scaling)
            else:  # Gemma 2: scores capped by tanh before the mask
                scores = torch.tanh(torch.bmm(q, k_t) * (scaling / self.softcap)) * self.softcap + bias_rows
            out = torch.bmm(scores.softmax(-1), values.reshape(-1, span, dim))  # [B * kv_heads, g * T, D]
            out = out.view(batch, kv_heads, groups, width, dim).permute(0, 3, 1, 2, 4)
        else:
            out = F.scaled_dot_product_attention(qk[:, :, :heads].transpose(1, 2), keys, values, attn_mask=bias,
                                                 scale=scaling, enable_gqa=groups > 1).transpose(1, 2)
        h = self._output(h, out.reshape(batch, width, q_size), o_w, o_b, norm_attn, eps_attn, gemv)
        a = _norm(h, norm_mlp, eps_mlp, gemma)
        gate_up = project(a, gate_up_w)
        if gate_up_b is not None:
            gate_up = gate_up + gate_up_b
        gate, up = gate_up.chunk(2, dim=-1)
        return self._output(h, self.act(gate) * up, down_w, down_b, norm_out, eps_out, gemv)

    def _output(self, h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                norm: torch.Tensor | None, eps: float, gemv: bool) -> torch.Tensor:
        """h + x @ weight.T (+ bias): the residual sum written by the product's own kernel where
        nothing comes between (no norm of the output, no sum over ranks)."""
        if norm is None and not self.reduce and bias is None:
            return _add_product(h, x, weight, gemv)
        y = (_rows_product if gemv else F.linear)(x, weight)
        if self.reduce:
            y = _all_reduce(y)
        if bias is not None:  # after the sum over ranks (each holds the whole bias)
            y = y + bias
        if norm is not None:
            y = _norm(y, norm, eps, self.gemma_norm)
        return h + y


def _all_reduce(y: torch.Tensor) -> torch.Tensor:
    """y summed over the tensor-parallel ranks (traceable under torch.compile)."""
    import torch.distributed as dist

    if torch.compiler.is_compiling():
        from torch.distributed import _functional_collectives as funcol

        return funcol.all_reduce(y, "sum", dist.group.WORLD)
    dist.all_reduce(y)
    return y


def _add_product(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, gemv: bool = False) -> torch.Tensor:
    """h + x @ weight.T with the sum written into h by the product's own kernel (beta = 1): one
    kernel where h + linear(x) takes two. h is the forward's own residual stream. gemv: as one
    matrix-vector product per row (_rows_product)."""
    rows = x.reshape(-1, x.shape[-1])
    if gemv:
        n, k = weight.shape
        h.view(-1, n, 1).baddbmm_(weight.expand(rows.shape[0], n, k), rows[:, :, None])
    else:
        h.view(-1, h.shape[-1]).addmm_(rows, weight.t())
    return h


def _rows_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T as a batch of matrix-vector products, one per row, all reading the one
    weight (a batch stride of 0): for a few rows a float32 GPU matrix product picks tiled kernels
    that cost more than the one-row kernel, which streams the weight once."""
    rows = x.reshape(-1, x.shape[-1])
    n, k = weight.shape
    return torch.bmm(weight.expand(rows.shape[0], n, k), rows[:, :, None]).view(*x.shape[:-1], n)


class PoolSession:
    """A KV session (specd.runtime.session.KVSession's surface) whose cache is a pool slot."""

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.device = pool.device
        self.slot = pool.acquire()
        self.cache = pool  # None once closed, as KVSession's

    @property
    def length(self) -> int:
        return self.pool.lengths[self.slot] if self.cache is not None else 0

    def row(self, ids: Sequence[int], num_logits: int = 1, want_hidden: bool = False) -> PoolRow:
        return PoolRow(self.slot, self.length, list(ids), num_logits, want_hidden)

    def extend(self, ids: Sequence[int], num_logits: int = 1,
               want_hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.pool.forward([self.row(ids, num_logits, want_hidden)])[0]

    def extend_tree(self, pending: Sequence[int], tree, dtype: torch.dtype) -> torch.Tensor:
        """KVSession.extend_tree on the pool: nodes are cached after the pending tokens in tree
        order until keep_path."""
        return self.pool.forward([self.tree_row(list(pending) + tree.tokens, tree)])[0][0]

    def tree_row(self, ids: Sequence[int], tree) -> PoolRow:
        """The row of a tree forward: ids are the pending committed tokens, then the tree's nodes;
        logits after the last pending token and after each node."""
        from specd.tree import tree_mask

        pending = len(ids) - len(tree)
        assert pending > 0, "a tree hangs from the last committed token"
        additive, positions = tree_mask(tree, self.length, pending, torch.float32, self.device)
        return PoolRow(self.slot, self.length, list(ids), len(tree) + 1, False, additive[0, 0] == 0, positions[0])

    def keep_path(self, base: int, nodes: list[int]) -> None:
        self.pool.keep_path(self.slot, base, nodes)

    def rollback(self, length: int) -> None:
        if length < self.length:
            self.pool.lengths[self.slot] = length

    def copy_from(self, other: PoolSession, n: int) -> bool:
        """Take other's first n cached positions as this empty session's own; False (nothing
        copied) where they are not there to take: other closed or shorter, another pool, or a
        tensor-parallel pool (whose other ranks would not see the copy)."""
        if (other.pool is not self.pool or self.pool.tp is not None or other.cache is None or self.cache is None
                or other.length < n or self.length or n <= 0):
            return False
        self.pool.copy_prefix(other.slot, self.slot, n)
        return True

    def nbytes(self) -> int:
        """Bytes of the positions this session has cached (its slot is allocated either way)."""
        return self.length * self.pool.bytes_per_token()

    def close(self) -> None:
        if self.cache is not None:
            self.pool.release(self.slot)
            self.cache = None


def pooled_extend(sessions: Sequence[PoolSession], ids: Sequence[Sequence[int]], num_logits: Sequence[int],
                  want_hidden: Sequence[bool] | None = None,
                  trees: Sequence | None = None) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """batched_extend_hidden for sessions of one pool: one forward, no copies. trees: a draft
    tree per session or None (its ids end with the tree's nodes; PoolSession.tree_row)."""
    pool = sessions[0].pool
    assert all(s.pool is pool for s in sessions), "sessions of different pools"
    want = list(want_hidden) if want_hidden is not None else [False] * len(sessions)
    trees = list(trees) if trees is not None else [None] * len(sessions)
    return pool.forward([s.tree_row(i, t) if t is not None else s.row(i, k, w)
                         for s, i, k, w, t in zip(sessions, ids, num_logits, want, trees)])
