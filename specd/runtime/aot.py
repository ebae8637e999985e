"""Pooled forwards compiled ahead of time for the CPU (AOTInductor): the CPU's counterpart of
CUDA graphs.

A decoding step of the embedded 135M model on a CPU streams its weights once (the floor, set by
memory bandwidth) and then spends about a third more time in Python dispatching some sixty
small operations a layer (docs/engine.md, "Compiled CPU forwards"). This module traces the KV
pool's own forward (`KVPool.hidden`, the same code the eager path runs) with torch.export,
compiles it with AOTInductor into a shared library whose C++ runs the whole forward, and
calls that library for every forward it can take: the decode steps and verification windows
of any number of sessions, with dynamic batch rows, query width (up to MAX_WIDTH) and key
span. Wider forwards (prompt prefill chunks), draft trees, and forwards that read so many keys
(long contexts) that the eager forward's attention is cheaper run eagerly.

One library serves every shape, so there are no buckets and no padding: dimensions are
symbolic in the compiled code. It is compiled once per model, thread count,
torch version and specd source, then loaded from the cache directory (`<cache>/aot/`), with
a lock so that processes starting together compile it once. The library holds no weights:
it reads the model's own tensors (user-managed constants), and the KV pool's per-layer
keys and values are its inputs, written in place.

The compiled kernels fuse and vectorise the small operations, so logits differ from the
eager forward's in the last bits (as MKL's row and window products already do); greedy
identity with target-alone decoding is checked end to end. At load, a probe forward compares
the library with the eager forward and refuses it (eager, with a warning) if they disagree.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from specd.errors import InvalidRequest
from specd.runtime import rows
from specd.runtime.pool import KVPool, PoolRow, StepInputs, unpack

log = logging.getLogger(__name__)

CPU_COMPILE_MODES = ("auto", "on", "off")
MAX_WIDTH = 32  # query rows of a compiled forward: decode steps and verification windows
MAX_POOL_DIM = 1 << 20  # bound of the symbolic sizes (rows, slots, positions)
PROBE_TOLERANCE = 1e-3  # largest |compiled - eager| of a probe's hidden states the library may show
# Keys and values a compiled forward that gathers them for SDPA (one compiled without the few-row
# operator) may read, every row up to the longest context, as a share of the weights' bytes;
# beyond it the eager forward's attention is faster (docs/engine.md). A library that attends with
# the operator reads each row's own keys in place and is faster at every context measured.
KEY_READ_SHARE = 1 / 2


def compile_supported() -> str | None:
    """Why ahead-of-time compilation cannot run here, or None when it can."""
    if not hasattr(torch._inductor, "aoti_compile_and_package"):
        return f"torch {torch.__version__} has no AOTInductor"
    if rows.compiler() is None:
        return "no C++ compiler (g++) on this machine"
    return None


def check_cpu_compile(mode: str) -> None:
    if mode not in CPU_COMPILE_MODES:
        raise InvalidRequest("cpu_compile", f"unknown mode {mode!r} ({', '.join(CPU_COMPILE_MODES)})")


class _Step(torch.nn.Module):
    """What is exported: the pool's forward over explicit inputs. The key span is the length of
    `span_like`, so that it is a symbolic size, not a constant of the trace. `real`: the flat
    indices of the real queries (the packed layout, KVPool.hidden), every index for equal rows."""

    def __init__(self, pool: KVPool):
        super().__init__()
        self.pool = pool

    def forward(self, ids, write, rope, qpos, slots, span_like, real, kv, tables):
        layers = len(kv) // 2
        x = StepInputs(ids, write, rope, slots, qpos, span_like.shape[0], packed=real)
        return self.pool.hidden(x, kv[:layers], kv[layers:], tables)


def _source_hash() -> str:
    """The code a library is compiled from: these modules' sources (an edit compiles anew)."""
    from specd.runtime import kernels, lean, pool

    h = hashlib.sha256()
    for path in (kernels.__file__, lean.__file__, pool.__file__, rows.__file__, rows.SOURCE, __file__):
        h.update(Path(path).read_bytes())
    return h.hexdigest()


def _known_tensors(pool: KVPool) -> dict[str, torch.Tensor]:
    """Every tensor the pool's forward may read as a constant, by a name stable across processes."""
    known = {f"model.{n}": t for n, t in pool.lean.model.named_parameters()}
    known.update({f"model.{n}": t for n, t in pool.lean.model.named_buffers()})
    known.update(pool.lean.derived())
    return known


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)


class AotRunner:
    """Runs a KV pool's forwards through its compiled library where one fits (see module doc)."""

    def __init__(self, pool: KVPool, cache_dir: Path):
        assert pool.device.type == "cpu" and not pool.fused, "ahead-of-time forwards are for the CPU pool"
        self.pool = pool
        self.kv = [pool.k[i] for i in range(pool.k.shape[0])] + [pool.v[i] for i in range(pool.v.shape[0])]
        # rotary cos and sin for every column, per rotary kind: as long as the pool's slots
        self.tables = tuple(t for pair in pool.tables for t in pair)
        self._spans = torch.empty(pool.max_len)
        self.runs = self.eager = 0
        self.compile_seconds = 0.0  # spent compiling in this process (0: loaded from the cache)
        rows.load(cache_dir)  # the few-row product the library calls, where it builds here
        weights = sum(t.numel() * t.element_size() for t in pool.lean.model.parameters())
        in_place = rows.attends(pool.dtype, pool.device)  # traced with the operator's attention
        self.key_read_limit = float("inf") if in_place else KEY_READ_SHARE * weights
        self.key = self._key()  # which library: part of the cost curve's key too (specd.costs)
        self.path = Path(cache_dir) / "aot" / f"{self.key}.pt2"
        self._load_or_compile()
        self._probe()
        pool.runner = self

    def _key(self) -> str:
        p = self.pool
        config = p.lean.model.config.to_dict()
        # The fused loops' thread count is compiled in: fixed at one, 8 sessions' decode steps ran
        # 10% slower on 2 cores (docs/engine.md), so a library is compiled per thread count.
        what = [torch.__version__, _source_hash(), json.dumps(config, sort_keys=True, default=str), str(p.dtype),
                MAX_WIDTH, torch.get_num_threads(), rows.loaded()]
        return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:20]

    def _example(self) -> StepInputs:
        """Two padded rows of width two over three key columns, three of the four queries real
        (sizes above 1, which a trace would otherwise take as constants): writes only the
        pool's trash slot."""
        x = unpack(self.pool.pack([], 2, 2), 2, 2, 3)
        return replace(x, packed=torch.tensor([0, 2, 3]))

    def _args(self, x: StepInputs) -> tuple:
        """The library's inputs for a forward (_Step.forward's order)."""
        real = torch.arange(x.input_ids.numel()) if x.packed is None else x.packed
        return (x.input_ids, x.write_pos, x.rope_pos, x.query_pos, x.slots, self._spans[:x.span], real, self.kv,
                self.tables)

    def _load_or_compile(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        names_file = self.path.with_suffix(".json")
        with open(self.path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one process compiles; the others wait and load its library
            if not (self.path.is_file() and names_file.is_file()):
                self._compile(names_file)
        self._names = json.loads(names_file.read_text())
        with warnings.catch_warnings():  # torch's own deprecation notices about its pytree types
            warnings.simplefilter("ignore", FutureWarning)
            self.library = torch._inductor.aoti_load_package(str(self.path))
        self.invalidate()

    def invalidate(self) -> None:
        """Point the library at the model's tensors as they are now (after a weight was replaced)."""
        known = _known_tensors(self.pool)
        # a constant the compiler folded away is not the library's to take (the probe checks the rest)
        fqns = set(self.library.get_constant_fqns())
        self.library.load_constants({fqn: known[name] for fqn, name in self._names.items() if fqn in fqns},
                                    check_full_update=True, user_managed=True)

    def _compile(self, names_file: Path) -> None:
        from torch.export import Dim

        p = self.pool
        log.warning("compiling the CPU forward ahead of time, once per model and thread count (a few minutes; "
                    "later starts load it)")
        t0 = time.perf_counter()
        # Pool geometry is symbolic too: one library for every pool of this model (a service's, an engine's).
        slots, columns = Dim("slots", min=2, max=MAX_POOL_DIM), Dim("columns", min=3, max=MAX_POOL_DIM)
        batch, width, span = Dim("batch", min=1, max=MAX_POOL_DIM), Dim("width", min=1, max=MAX_WIDTH), \
            Dim("span", min=1, max=MAX_POOL_DIM)
        real = Dim("real", min=1, max=MAX_POOL_DIM)
        row_dims = {0: batch, 1: width}
        # The rotary tables are inputs with a symbolic length: as constants their length, the pool's
        # max_len, was compiled in, and a pool with longer slots that loaded the library aborted
        # on its first position past it (an index check in the compiled loops).
        shapes = (row_dims, row_dims, row_dims, row_dims, {0: batch}, {0: span}, {0: real}, [{0: slots, 2: columns}] * len(self.kv),
                  tuple({0: columns} for _ in self.tables))
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            program = torch.export.export(_Step(p), self._args(self._example()), dynamic_shapes=shapes)
        known = _known_tensors(p)
        names = {}
        for lifted, tensor in program.constants.items():
            match = next((n for n, t in known.items() if isinstance(tensor, torch.Tensor) and _same(t, tensor)), None)
            if match is None:
                raise RuntimeError(f"the traced forward reads a tensor specd does not know: {lifted}")
            names[lifted.replace("lifted_tensor_", "_tensor_constant")] = match
        tmp = self.path.with_suffix(f".tmp{os.getpid()}.pt2")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            configs = {"aot_inductor.package_constants_in_so": False}
            if rows.loaded():  # the operators called directly (C functions), not through the proxy executor
                configs["aot_inductor.custom_ops_to_c_shims"] = rows.c_shims()
            torch._inductor.aoti_compile_and_package(program, package_path=str(tmp), inductor_configs=configs)
            library = torch._inductor.aoti_load_package(str(tmp))
        missing = set(library.get_constant_fqns()) - set(names)
        if missing:
            raise RuntimeError(f"the compiled forward names constants the trace did not: {sorted(missing)[:3]}")
        names_file.write_text(json.dumps(names))
        tmp.replace(self.path)
        self.compile_seconds = time.perf_counter() - t0
        log.warning("compiled the CPU forward in %.0f s: %s", self.compile_seconds, self.path)

    @torch.inference_mode()
    def _probe(self) -> None:
        """One padded forward (the trash slot only) compiled and eager: they must agree."""
        x = self._example()
        compiled = self.library(*self._args(x)).clone()
        eager = self.pool.hidden(x)
        gap = (compiled - eager).abs().max().item()
        if not gap <= PROBE_TOLERANCE:
            raise RuntimeError(f"the compiled CPU forward disagrees with the eager one (max gap {gap:.2e})")

    def run(self, rows: Sequence[PoolRow], width: int, span: int) -> tuple[torch.Tensor, int] | None:
        """hidden [B, T, H] of rows and the width T; None (the pool then runs the forward eagerly)
        when it is wider than MAX_WIDTH, or when it reads so many keys that the eager forward is
        faster (`eager_is_faster`). Rows of unequal length run packed: the projections see the
        real tokens only."""
        if width > MAX_WIDTH or not rows or self.eager_is_faster(rows, span):
            self.eager += 1
            return None
        x = unpack(self.pool.pack(rows, len(rows), width), len(rows), width, span)
        x = replace(x, packed=self.pool.real_queries(rows, width))
        self.runs += 1
        return self.library(*self._args(x)), width

    def eager_is_faster(self, rows: Sequence[PoolRow], span: int) -> bool:
        """Whether the eager forward beats the compiled one: never where the library attends with
        the few-row operator; else where the compiled forward, every row gathering keys and values
        up to the longest context for SDPA, would read more than KEY_READ_SHARE of the weights'
        bytes (it then costs more per key than the eager forward, which also attends in span
        groups where contexts differ widely, KVPool._span_groups; docs/engine.md)."""
        return len(rows) * span * self.pool.bytes_per_token() > self.key_read_limit


def use_compiled(pool: KVPool, cache_dir: Path, required: bool) -> AotRunner | None:
    """Compile (or load) the pool's forward; None, with a warning, where that fails and the
    mode was auto (required: the failure is an error)."""
    reason = compile_supported()
    if reason is None:
        try:
            return AotRunner(pool, cache_dir)
        except Exception as e:  # noqa: BLE001 (a compiler or loader failure: the eager forward still works)
            reason = f"{type(e).__name__}: {e}"
    if required:
        raise InvalidRequest("cpu_compile", f"cannot compile the CPU forward: {reason}")
    log.warning("CPU forward stays eager: %s", reason)
    return None
