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


def test_start_up_captures_every_bucket_and_serving_captures_none():
    target = _on_cuda(4, "tiny")
    use_pool(target, TargetSettings(port=0, kv_slots=4, kv_max_len=600, cuda_graphs="on"))
    runner = target.pool.runner
    assert not runner.lazy and set(runner.graphs) == set(runner.keys()) and runner.captures == len(runner.keys())
    sessions = [target.session() for _ in range(3)]
    sessions[0].extend(list(range(5, 305)), 1)  # a prompt's prefill in a prefill bucket, past 256 keys
    for s in sessions[1:]:
        s.extend([5, 9, 14, 20], 1)
    for width in (1, 3, 9, 17):  # windows, one session at a time
        for s in sessions:
            s.extend(list(range(7, 7 + width)), width)
            s.rollback(s.length - width + 1)
    assert runner.captures == len(runner.keys()) and runner.missed == 0 and runner.replays > 0
