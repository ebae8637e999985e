"""Linear kernels (specd/runtime/kernels.py): specd's few-row product, and oneDNN with weights
packed at load time."""

from __future__ import annotations

import copy
import io
import logging
import shutil

import pytest
import torch

from specd.errors import InvalidRequest
from specd.runtime import load_model, rows
from specd.runtime.kernels import PackedLinear, RowsLinear, kernels_of, onednn_available, use_kernels

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this PyTorch has no oneDNN")


@pytest.fixture(scope="module")
def few_rows():
    reason = rows.load()
    if reason is not None:
        pytest.skip(f"the few-row product cannot be built here: {reason}")


def _layers():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 96, bias=False))


@needs_onednn
def test_packed_layers_compute_what_the_default_kernels_compute():
    model = _layers()
    x = torch.randn(2, 5, 64)
    with torch.inference_mode():
        want = model(x)
        assert use_kernels(model, "onednn") == "onednn" and kernels_of(model) == "onednn"
        assert all(isinstance(m, PackedLinear) for m in model)
        got = model(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert model.state_dict().keys() == {"0.weight", "0.bias", "1.weight"}  # nothing extra saved


@needs_onednn
def test_a_weight_changed_in_place_is_packed_again():
    model = _layers()
    use_kernels(model, "onednn")
    x = torch.randn(3, 64)
    with torch.inference_mode():
        before = model(x)
    with torch.no_grad():
        model[0].weight.mul_(2.0)
    with torch.inference_mode():
        after = model(x)
    model2 = copy.deepcopy(model)
    use_kernels(model2, "torch")
    with torch.inference_mode():
        torch.testing.assert_close(after, model2(x), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(before, after)


@needs_onednn
@pytest.mark.parametrize("kernels", ["onednn", "rows"])
def test_training_runs_the_default_kernel_with_its_backward(kernels, request):
    if kernels == "onednn" and not onednn_available():
        pytest.skip("this PyTorch has no oneDNN")
    if kernels == "rows":
        request.getfixturevalue("few_rows")
    model = _layers()
    use_kernels(model, kernels)
    x = torch.randn(4, 64, requires_grad=True)
    model(x).sum().backward()
    assert x.grad is not None and model[0].weight.grad is not None


@needs_onednn
def test_copies_and_pickles_rebuild_the_pack():
    model = _layers()
    use_kernels(model, "onednn")
    x = torch.randn(2, 64)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    with torch.inference_mode():
        want = model(x)
        for other in (copy.deepcopy(model), torch.load(buf, weights_only=False)):
            assert isinstance(other[0], PackedLinear)
            assert torch.equal(other(x), want)


def test_torch_kernels_undo_the_pack_and_unknown_kernels_are_named():
    model = _layers()
    use_kernels(model)
    assert use_kernels(model, "torch") == "torch" and kernels_of(model) == "torch"
    assert all(type(m) is torch.nn.Linear for m in model)
    with pytest.raises(InvalidRequest, match="linear_kernels"):
        use_kernels(model, "fast")
    with pytest.raises(InvalidRequest, match="linear_kernels"):
        load_model("embedded", device="cpu", linear_kernels="fast")


def test_half_precision_models_keep_the_default_kernels():
    model = _layers().to(torch.bfloat16)
    assert use_kernels(model) == "torch"
    for kernels in ("onednn", "rows"):
        with pytest.raises(InvalidRequest, match="linear_kernels"):
            use_kernels(model, kernels)


def test_load_model_runs_the_few_row_product_by_default(tiny_dirs, few_rows):
    assert kernels_of(load_model(str(tiny_dirs[0]), device="cpu").model) == "rows"
    assert kernels_of(load_model(str(tiny_dirs[0]), device="cpu", linear_kernels="torch").model) == "torch"
    if onednn_available():
        assert kernels_of(load_model(str(tiny_dirs[0]), device="cpu", linear_kernels="onednn").model) == "onednn"


def test_the_suites_tiny_models_run_the_few_row_product(tiny_target, tiny_draft, few_rows):
    """Every lossless engine test on the tiny pair then checks the kernels production runs."""
    assert kernels_of(tiny_target.model) == "rows" and kernels_of(tiny_draft.model) == "rows"


def test_few_row_layers_compute_what_the_default_kernels_compute(few_rows):
    model = _layers()
    x = torch.randn(2, 5, 64)
    with torch.inference_mode():
        want = model(x)
        assert use_kernels(model) == "rows" and kernels_of(model) == "rows"
        assert all(isinstance(m, RowsLinear) for m in model)
        got = model(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(model[:1](x[:1, :1]), model[:1](x)[:1, :1])  # a row alone or among others: the same
    assert model.state_dict().keys() == {"0.weight", "0.bias", "1.weight"}  # nothing extra saved
    assert use_kernels(model, "torch") == "torch" and all(type(m) is torch.nn.Linear for m in model)


def test_single_rows_run_unpacked_where_measured_faster_and_windows_stay_packed():
    """PackedLinear._gemv: one row through F.linear (MKL's matrix-vector product) exactly, two or
    more through the packed kernel; `auto` leaves a model this small packed for every row."""
    import torch.nn.functional as F

    from specd.runtime.kernels import PackedLinear, kernels_of, pack_linear, single_rows_faster_unpacked

    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48, bias=False)
    pack_linear(layer)
    assert isinstance(layer, PackedLinear) and not layer._gemv
    assert not single_rows_faster_unpacked(torch.nn.Sequential(layer))  # a tiny model: no timing at all
    row, rows = torch.randn(1, 64), torch.randn(3, 64)
    with torch.inference_mode():
        packed_rows = layer(rows)
        layer._gemv = True
        assert kernels_of(torch.nn.Sequential(layer)) == "onednn+gemv"  # keys cached cost curves apart
        assert torch.equal(layer(row), F.linear(row, layer.weight))
        assert torch.equal(layer(rows), packed_rows)  # a window keeps the packed kernel
        torch.testing.assert_close(layer(row), torch.ops.mkldnn._linear_pointwise(row, layer._packed, None, "none",
                                                                                   [], ""))


def test_where_the_few_row_product_cannot_run_auto_falls_back_and_rows_is_refused(few_rows):
    """A machine without a C++ compiler (or a failed build): auto packs for oneDNN as before."""
    model = _layers()
    with rows.disabled():
        assert use_kernels(model) == ("onednn" if onednn_available() else "torch")
        with pytest.raises(InvalidRequest, match="linear_kernels"):
            use_kernels(model, "rows")
    assert use_kernels(model) == "rows"


def _no_source(tmp_path, monkeypatch):  # an install without csrc/ (a wheel that left it out)
    monkeypatch.setattr(rows, "SOURCE", tmp_path / "csrc" / "rows_linear.cpp")


def _no_compiler(tmp_path, monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))


def _compile_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", shutil.which("false"))


def _load_error(tmp_path, monkeypatch):  # a damaged library where the cache keeps the built one
    if rows.compiler() is None:
        pytest.skip("no C++ compiler: the cached library is never looked at")
    built = tmp_path / "ops" / f"rows_linear-{rows._key()}.so"
    built.parent.mkdir()
    built.write_bytes(b"not a shared library")


@pytest.mark.parametrize("failure, reason", [
    (_no_source, "rows_linear.cpp"), (_no_compiler, "no C++ compiler"), (_compile_error, "failed"),
    (_load_error, "rows_linear-")], ids=["no-source", "no-compiler", "compile-error", "load-error"])
def test_auto_falls_back_with_one_warning_wherever_the_operator_cannot_be_had(failure, reason, tmp_path,
                                                                              monkeypatch, caplog):
    """Any failure to find, build or load the operator: auto keeps oneDNN (or torch's kernels) and
    says why once; rows is refused as a bad linear_kernels, naming the same reason."""
    monkeypatch.setattr(rows, "_state", {})  # this process has not tried to load it yet
    failure(tmp_path, monkeypatch)
    model = _layers()
    with caplog.at_level(logging.WARNING, logger=rows.__name__):
        assert use_kernels(model, "auto", tmp_path) == ("onednn" if onednn_available() else "torch")
        with pytest.raises(InvalidRequest, match="linear_kernels") as refused:
            use_kernels(model, "rows", tmp_path)
    assert reason in str(refused.value)
    (warning,) = [r for r in caplog.records if r.name == rows.__name__]
    assert reason in warning.getMessage()
