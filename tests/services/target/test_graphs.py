"""The target service's CUDA graphs at start-up (a CUDA device only): with `auto`, a target
whose layers fail to compile still starts, on plain graphs, and its forwards equal eager ones;
with `compiled` the failure is the service's. Skipped without a GPU."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

from services.common.settings import TargetSettings
from services.target.main import use_pool
from specd.runtime.pool import KVPool
from specd.runtime.tiny import loaded, tiny_llama

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def _on_cuda(seed: int, name: str):
    target = loaded(tiny_llama(seed=seed), name)
    target.model.to("cuda")
    return replace(target, device=torch.device("cuda"))


def _failing_compile(self):
    def layer(*args, **kwargs):
        raise RuntimeError("no compiler here")

    self.compiled_layer = layer


def test_layers_that_fail_to_compile_fall_back_to_plain_graphs_under_auto(monkeypatch, caplog):
    monkeypatch.setattr(KVPool, "compile_layers", _failing_compile)
    target = _on_cuda(3, "tiny")
    reference = _on_cuda(3, "tiny-eager")
    with caplog.at_level(logging.WARNING):
        use_pool(target, TargetSettings(port=0, kv_slots=2, kv_max_len=128, cuda_graphs="auto"))
    assert "plain CUDA graphs instead" in caplog.text
    runner = target.pool.runner
    assert target.pool.compiled_layer is None and runner.graphs  # captured, plain
    session, eager = target.session(), reference.session()
    prompt = [5, 9, 14, 20, 33, 40, 7, 11]
    got, want = session.extend(prompt, 1)[0], eager.extend(prompt, 1)[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    replays = runner.replays
    torch.testing.assert_close(session.extend([3, 4], 2)[0], eager.extend([3, 4], 2)[0], rtol=1e-4, atol=1e-4)
    assert runner.replays == replays + 1  # the window ran from a graph


def test_compiled_asked_for_by_name_fails_to_start_where_compiling_fails(monkeypatch):
    monkeypatch.setattr(KVPool, "compile_layers", _failing_compile)
    target = _on_cuda(3, "tiny")
    with pytest.raises(RuntimeError, match="no compiler here"):
        use_pool(target, TargetSettings(port=0, kv_slots=2, kv_max_len=128, cuda_graphs="compiled"))
