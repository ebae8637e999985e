"""A float32 product for the few rows of a CPU decode step or verification window, reading each
weight row once for all of them (specd/runtime/csrc/rows_linear.cpp).

The compiled CPU forward (specd.runtime.aot) is bound by streaming the weights from memory. MKL's
product reaches that bound for one row, but from 4 rows up it packs the weight again on every
call, so a verification window cost far more than a decoding step (docs/engine.md, "The
few-row product", has the measurements). This product reads a block of four weight rows once,
multiplies it into every input row while it is in cache, and prefetches the next block; a
window of a few rows then costs about what a step does.

Each output is one vector of partial sums over the input in the same order, reduced by a fixed
tree, whatever the number of rows: a row's result does not depend on which rows came with it,
so a verification window's products equal the decoding steps' bit for bit.

The same library holds the compiled forward's attention (`attention`): each query over its own
row's keys in the KV pool, read where they lie and only up to the query's position, where SDPA
needs them gathered into a copy first; each query alone, so it too is the same whatever the batch.

The operator is compiled with the machine's C++ compiler (`-O3 -march=native`; vectors of 16
floats where the CPU has AVX-512, else 8) the first time it is needed and kept under
`<cache dir>/ops/`, keyed by its source, flags, torch's version and the CPU. The compiled
forward's library calls its C functions (`c_shims`) by name, so it is loaded (`load`, its symbols
global) before a library that uses it.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "rows_linear.cpp"
# No contraction of a product and a sum into one fused multiply-add: the compiler contracted them
# in some of the kernel's row-block variants and not in others, so a row's result depended on
# the rows beside it. It costs no speed here (docs/engine.md, "The few-row product").
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC", "-std=c++20", "-fopenmp", "-w")
_state: dict[str, str | None] = {}  # "reason": why the operator is not loaded ("" once it is)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _key() -> str:
    from specd.costs import cpu_model

    what = [SOURCE.read_text(), FLAGS, torch.__version__, cpu_model(), _cpu_flags()]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:20]


def compiler() -> str | None:
    """The machine's C++ compiler ($CXX, else g++, c++ or clang++), or None."""
    return next((c for c in (os.environ.get("CXX"), "g++", "c++", "clang++") if c and shutil.which(c)), None)


def _build(out: Path, compiler: str) -> None:
    from torch.utils import cpp_extension

    lib = Path(torch.__file__).parent / "lib"
    cmd = [compiler, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           *[f"-I{p}" for p in cpp_extension.include_paths()], str(SOURCE), "-o", str(out),
           f"-L{lib}", "-ltorch", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}"]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")


def load(cache_dir: Path | None = None) -> str | None:
    """Build (once per machine, under cache_dir, default $SPECD_CACHE_DIR or ~/.cache/specd) and
    load the operator; None when torch.ops.specd.rows_linear is ready, else why not (the caller
    keeps another product)."""
    if "reason" in _state:
        return _state["reason"] or None
    if cache_dir is None:
        from specd.runtime.embedded import default_cache_dir

        cache_dir = default_cache_dir()
    reason = None
    cxx = compiler()
    if cxx is None:
        reason = "no C++ compiler (g++) on this machine"
    else:
        try:  # the key reads the source: an install without it falls back like a failed build
            path = Path(cache_dir) / "ops" / f"rows_linear-{_key()}.so"
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path.with_suffix(".lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # processes starting together build it once
                if not path.is_file():
                    tmp = path.with_suffix(f".tmp{os.getpid()}.so")
                    _build(tmp, cxx)
                    tmp.replace(path)
            torch.ops.load_library(str(path))
            # Its C functions (c_shims) visible to the compiled forward's library, which calls them by name.
            ctypes.CDLL(str(path), mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL | os.RTLD_NOW)
            torch.library.register_fake("specd::rows_linear")(_shape)
            torch.library.register_fake("specd::rows_linear_cat")(_cat_shape)
            torch.library.register_fake("specd::rows_attention")(_attention_shape)
        except Exception as e:  # noqa: BLE001 (a compiler or loader failure: torch's product still works)
            reason = f"{type(e).__name__}: {e}"
    _state["reason"] = reason or ""
    if reason:
        log.warning("few-row CPU product unavailable (oneDNN or torch's products instead): %s", reason)
    return reason


def loaded() -> bool:
    return _state.get("reason") == ""


def c_shims() -> dict:
    """The operators' C functions, as AOTInductor's `custom_ops_to_c_shims` takes them: a compiled
    forward calls them directly (csrc/rows_linear.cpp), not through its proxy executor."""
    def declare(name: str, args: str) -> list[str]:
        return [f"AOTITorchError aoti_torch_cpu_{name}({args}, AtenTensorHandle* ret0)"]

    ops, t = torch.ops.specd, "AtenTensorHandle"
    return {
        ops.rows_linear.default: declare("rows_linear", f"{t} x, {t} weight"),
        ops.rows_linear_cat.default: declare("rows_linear_cat", f"{t} x, const {t}* weights, int64_t weights_len_"),
        ops.rows_attention.default: declare("rows_attention", f"{t} q, {t} k, {t} v, {t} slots, {t} qpos, double scale"),
    }


@contextlib.contextmanager
def disabled():
    """Forwards traced inside use torch's product (to compare the two products)."""
    saved = _state.get("reason")
    _state["reason"] = "disabled"
    try:
        yield
    finally:
        if saved is None:
            del _state["reason"]
        else:
            _state["reason"] = saved


def _shape(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _cat_shape(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)))


def _attention_shape(q, k, v, slots, qpos, scale) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return attends(x.dtype, x.device) and weight.dtype == x.dtype and weight.device.type == x.device.type


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T: the few-row operator where it is loaded and fits (float32 on the CPU), else
    torch's product."""
    if _fits(x, weight):
        return torch.ops.specd.rows_linear(x, weight)
    return F.linear(x, weight)


def linear_cat(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat([x @ w.T for w in weights], -1), equal to it bit for bit, in one pass of the
    few-row operator where it is loaded and fits (q/k/v or gate/up: one parallel region, no
    concatenation), else torch's products concatenated."""
    if all(_fits(x, w) for w in weights):
        return torch.ops.specd.rows_linear_cat(x, weights)
    return torch.cat([F.linear(x, w) for w in weights], dim=-1)


def attends(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the operators run for tensors of this dtype and device (`attention` for a pool of
    them): float32 on the CPU, the operator loaded."""
    return loaded() and dtype == torch.float32 and device.type == "cpu"


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, query_pos: torch.Tensor,
              scale: float) -> torch.Tensor:
    """Causal attention of queries q [B, H, T, D] over a KV pool's keys and values k, v [slots, KV
    heads, columns, D], row b reading slot slots[b] in place, query (b, t) the keys 0..query_pos[b, t]
    (KVPool.hidden's rule), where `attends`."""
    return torch.ops.specd.rows_attention(q, k, v, slots, query_pos, scale)
