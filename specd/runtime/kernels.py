"""Linear kernels for CPU float32: specd's few-row product, or oneDNN with weights packed once.

PyTorch's default CPU linear (MKL sgemm) is slow exactly where speculative decoding lives: it
runs 2-3 rows as repeated matrix-vector products and packs the weight again on every call
above that, so a verification window costs far more than a decoding step.

`rows` (specd.runtime.rows) reads each weight row once for all of a forward's rows, so a window
of a few rows costs about what one row does, and one row streams the weight as fast as MKL's
matrix-vector product; it needs nothing but the weight itself. `auto` runs it on float32 CPU
models wherever it builds (a C++ compiler; built once per machine), else `onednn`.

`onednn`: the weight reordered once into oneDNN's blocked layout costs about the same for any of
1-8 rows (docs/engine.md, "Linear kernels on the CPU", has the measurements). One row is the
exception where MKL's matrix-vector product streams the weight faster than the blocked kernel
(a decoding step on an Intel Xeon; not on the AMD EPYC the packing was first measured on): the
layers are timed at load time and, where MKL's is faster, single rows run through it
(`PackedLinear._gemv`). The pack is a second copy of each weight (the original stays: tied
embeddings, the drafters' reduced heads and training read it); a weight changed in place is
packed again on its next call.

Outputs differ from MKL's in the last bits (at most 3e-6 with random weights of the embedded
model's shapes), as MKL's own matrix-vector and matrix-matrix paths differ from each other;
greedy identity with target-alone decoding is checked end to end. With gradients enabled
(training through frozen layers) every layer runs the default kernel, which has a backward.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specd.errors import InvalidRequest
from specd.runtime import rows

KERNELS = ("auto", "rows", "onednn", "torch")


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear(torch.nn.Linear):
    """An nn.Linear whose inference forward runs oneDNN on a pre-packed copy of its weight.
    Made by swapping the class of an existing layer (pack_linear), so parameters, state dict
    and tied weights are untouched."""

    _packed: torch.Tensor
    _packed_from: tuple[int, int] | None  # (id, version) of the weight the pack was made from
    _gemv: bool = False  # a single row runs F.linear (MKL's matrix-vector product), measured faster

    def __getstate__(self):  # copies and pickles leave the opaque pack out; it is rebuilt on use
        state = self.__dict__.copy()
        state.pop("_packed", None)
        state["_packed_from"] = None
        return state

    def _repack(self) -> None:
        w = self.weight.detach()
        self._packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        self._packed_from = _stamp(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (torch.compiler.is_compiling() or torch.is_grad_enabled() or x.dtype != torch.float32
                or x.device.type != "cpu"):  # traced for compilation (specd.runtime.aot): the plain product
            if torch.compiler.is_compiling() and self.bias is None:
                return rows.linear(x, self.weight)
            return F.linear(x, self.weight, self.bias)
        if self._gemv and single_row(x):
            return F.linear(x, self.weight, self.bias)
        if self._packed_from != _stamp(self.weight):
            self._repack()
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")


class RowsLinear(torch.nn.Linear):
    """An nn.Linear whose float32 CPU inference forward runs specd's few-row product (made by
    swapping the class of an existing layer, like PackedLinear)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        y = rows.linear(x, self.weight)
        return y if self.bias is None else y + self.bias


def single_row(x: torch.Tensor) -> bool:
    """One row of inputs (a decoding step), which `_gemv` layers run through F.linear."""
    return x.numel() == x.shape[-1]


def _stamp(w: torch.Tensor) -> tuple[int, int]:
    """Which weight, at which in-place version (an inference tensor has none: it only changes
    inside inference mode, where nothing here writes weights)."""
    return id(w), -1 if w.is_inference() else w._version


def pack_linear(layer: torch.nn.Linear) -> None:
    layer.__class__ = PackedLinear
    layer._repack()


def check_kernels(kernels: str) -> None:
    if kernels not in KERNELS:
        raise InvalidRequest("linear_kernels", f"unknown kernels {kernels!r} ({', '.join(KERNELS)})")


def use_kernels(model: torch.nn.Module, kernels: str = "auto", cache_dir: Path | None = None) -> str:
    """Apply the linear kernels to every nn.Linear of a model in place; returns what it uses.
    auto: rows for a float32 model on the CPU where the operator builds (under cache_dir), else
    onednn where PyTorch has oneDNN, else torch."""
    check_kernels(kernels)
    params = next(model.parameters(), None)
    fits = params is not None and params.device.type == "cpu" and params.dtype == torch.float32
    if kernels == "rows" and not fits:
        raise InvalidRequest("linear_kernels", "rows needs a float32 model on the CPU")
    if kernels == "onednn" and not (fits and onednn_available()):
        raise InvalidRequest("linear_kernels", "onednn needs a float32 model on the CPU and a PyTorch "
                                               "built with oneDNN")
    few_rows = kernels in ("auto", "rows") and fits and rows.load(cache_dir) is None
    if kernels == "rows" and not few_rows:
        raise InvalidRequest("linear_kernels", f"the few-row product cannot run here: {rows.load(cache_dir)}")
    for m in model.modules():  # back to plain layers, then the chosen kind
        if isinstance(m, (PackedLinear, RowsLinear)):
            m.__class__ = torch.nn.Linear
            m.__dict__.pop("_packed", None)
            m.__dict__.pop("_packed_from", None)
    if few_rows:
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.__class__ = RowsLinear
        return "rows"
    if kernels == "torch" or not (fits and onednn_available()):
        return "torch"
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            pack_linear(m)
    gemv = kernels == "auto" and single_rows_faster_unpacked(model)
    for m in model.modules():
        if isinstance(m, PackedLinear):
            m._gemv = gemv
    return "onednn"


# Below this many linear weights (a test's tiny model) a matrix-vector product costs microseconds
# either way: every row count keeps the packed kernel.
GEMV_MIN_WEIGHTS = 16_000_000
# Single rows switch to MKL only when it is this much faster: where the two are close, every
# process on a machine makes the same choice (a service and its client compare outputs).
GEMV_MARGIN = 0.85


@torch.inference_mode()
def single_rows_faster_unpacked(model: torch.nn.Module, layers: int = 6, repeats: int = 5) -> bool:
    """Whether one row through F.linear (MKL's matrix-vector product) beats the packed oneDNN
    kernel on this model's own linears on this machine: the first `layers` decoder layers'
    linears, each called once per pass as a decoding step does, best of `repeats` passes."""
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    if sum(m.weight.numel() for m in linears) < GEMV_MIN_WEIGHTS:
        return False
    per_layer = max(1, len(linears) // max(1, getattr(model.config, "num_hidden_layers", 1)))
    sample = linears[:layers * per_layer]
    inputs = [torch.randn(1, m.in_features) for m in sample]

    def packed() -> None:
        for m, x in zip(sample, inputs):
            torch.ops.mkldnn._linear_pointwise(x, m._packed, m.bias, "none", [], "")

    def unpacked() -> None:
        for m, x in zip(sample, inputs):
            F.linear(x, m.weight, m.bias)

    best_packed = best_unpacked = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        packed()
        t1 = time.perf_counter()
        unpacked()
        t2 = time.perf_counter()
        best_packed, best_unpacked = min(best_packed, t1 - t0), min(best_unpacked, t2 - t1)
    return best_unpacked < GEMV_MARGIN * best_packed


def kernels_of(model: torch.nn.Module) -> str:
    """Which linear kernels a model runs: rows, onednn if its layers are packed ("onednn+gemv"
    where single rows run unpacked), else torch."""
    if any(isinstance(m, RowsLinear) for m in model.modules()):
        return "rows"
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    if not packed:
        return "torch"
    return "onednn+gemv" if packed[0]._gemv else "onednn"
