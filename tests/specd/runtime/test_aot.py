"""Pooled forwards compiled ahead of time for the CPU (specd.runtime.aot): one library for every
shape, equal to the eager pool's forward (logits close, greedy identical) for decode steps,
verification windows and batches of unequal rows (packed); compiled once, then loaded from the
cache."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from dataclasses import replace

import pytest
import torch

from specd.costs import CostCurve, curve_key
from specd.drafters import EarlyExitDrafter, HfDrafter, NgramDrafter
from specd.engine import SpeculativeEngine
from specd.errors import InvalidRequest
from specd.runtime import rows
from specd.runtime.aot import AotRunner, compile_supported
from specd.runtime.pool import PoolRow, pooled_extend
from specd.runtime.tiny import loaded, tiny_llama
from specd.types import SamplingParams, SpecParams

pytestmark = pytest.mark.skipif(compile_supported() is not None, reason=f"{compile_supported()}")
TOL = {"atol": 1e-4, "rtol": 1e-4}


def _tokens(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (n,), generator=gen).tolist()


# The library with torch's products (test_the_library_calls_the_few_row_product_where_it_builds),
# compiled by another process into the same cache: a compile keeps one core busy for most of a
# minute, so the two libraries these tests need compile side by side on a 2-core machine. The
# test that loads it waits on the cache's lock (AotRunner); were this process to fail, it would
# compile the library itself.
PLAIN_LIBRARY = """
import sys, torch
from dataclasses import replace
from specd.runtime import rows
from specd.runtime.tiny import loaded, tiny_llama
torch.set_num_threads(int(sys.argv[2]))
model = replace(loaded(tiny_llama(0, layers=4), "tiny-target"), forward="lean")
with rows.disabled():
    model.use_pool(2, 128, compiled="on", cache_dir=sys.argv[1])
"""


@pytest.fixture(scope="module")
def aot_cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("aot")
    plain = subprocess.Popen([sys.executable, "-c", PLAIN_LIBRARY, str(path), str(torch.get_num_threads())],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    yield path
    plain.kill()
    plain.wait()


@pytest.fixture
def compiled(tiny_target, aot_cache):
    """The tiny target in a 4-slot pool whose forwards run the compiled library."""
    model = replace(tiny_target, forward="lean")
    model.use_pool(4, 256, compiled="on", cache_dir=aot_cache)
    assert isinstance(model.pool.runner, AotRunner)
    return model


@pytest.fixture
def eager(tiny_target):
    model = replace(tiny_target, forward="lean")
    model.use_pool(4, 256)
    return model


def test_compiled_forwards_equal_eager_ones_for_steps_windows_and_unequal_batches(compiled, eager):
    runner = compiled.pool.runner
    pairs = [(compiled.session(), eager.session()) for _ in range(3)]
    for (a, b), prefix in zip(pairs, (_tokens(40, 1), _tokens(30, 2), _tokens(20, 3))):
        a.extend(prefix, 1)  # the 40-token prefix is wider than MAX_WIDTH: eager
        b.extend(prefix, 1)
    runs = runner.runs
    for step in range(4):  # decode steps and windows, one session at a time
        for (a, b), n in zip(pairs, (1, 4, 9)):
            ids = _tokens(n, 10 + step)
            torch.testing.assert_close(a.extend(ids, n)[0], b.extend(ids, n)[0], **TOL)
    assert runner.runs == runs + 12
    # batches over several slots: equal rows, then rows of different lengths (packed: the
    # projections run only their real tokens), both compiled
    for new, compiled_batch in (([_tokens(2, 20), _tokens(2, 21), _tokens(2, 22)], True),
                                ([_tokens(1, 23), _tokens(6, 24), _tokens(3, 25)], True)):
        runs = runner.runs
        wanted = [len(ids) for ids in new]
        got = pooled_extend([a for a, _ in pairs], new, wanted)
        want = pooled_extend([b for _, b in pairs], new, wanted)
        for (x, _), (y, _) in zip(got, want):
            torch.testing.assert_close(x, y, **TOL)
        assert runner.runs == runs + compiled_batch
    runs = runner.runs
    # a rollback then a step: the compiled forward reads only the kept keys
    for a, b in pairs:
        a.rollback(a.length - 3)
        b.rollback(b.length - 3)
        torch.testing.assert_close(a.extend([7], 1)[0], b.extend([7], 1)[0], **TOL)
    assert runner.runs == runs + 3  # the steps after a rollback ran compiled


def _mixed_batch(compiled, eager, prefixes: list[int]) -> tuple[int, int]:
    """Sessions with prefixes of these lengths, then one forward of a 2-token window among decode
    steps, compiled and eager: the outputs must agree. (compiled forwards, eager ones) it took."""
    pairs = [(compiled.session(), eager.session()) for _ in prefixes]
    for (a, b), (i, n) in zip(pairs, enumerate(prefixes)):
        a.extend(_tokens(n, 7 + i), 1)
        b.extend(_tokens(n, 7 + i), 1)
    runner = compiled.pool.runner
    runs, before = runner.runs, runner.eager
    new = [_tokens(2, 9)] + [_tokens(1, 10 + i) for i in range(len(prefixes) - 1)]
    wanted = [len(ids) for ids in new]
    got = pooled_extend([a for a, _ in pairs], new, wanted)
    want = pooled_extend([b for _, b in pairs], new, wanted)
    for (x, _), (y, _) in zip(got, want):
        torch.testing.assert_close(x, y, **TOL)
    for a, b in pairs:
        a.close()
        b.close()
    return runner.runs - runs, runner.eager - before


def test_rows_whose_contexts_differ_run_compiled_over_the_longest_span(compiled, eager):
    """A 3-token context beside a 30-token one: two rows reading 32 keys each, far below the
    limit, so the batch runs compiled (the eager forward's grouped attention costs more)."""
    assert _mixed_batch(compiled, eager, [30, 3]) == (1, 0)


def test_a_batch_reading_many_keys_runs_eagerly_only_where_the_library_gathers_them(tiny_target, aot_cache,
                                                                                   compiled, eager):
    """Three rows, one of 200 keys: a library that attends with the few-row operator (each row's
    own keys, in place) runs it; one that gathers every row's keys up to the longest for SDPA
    (compiled without the operator) would read more than half the weights' bytes, so the eager
    forward runs, attending in span groups (the short rows over their own)."""
    if not rows.loaded():
        pytest.skip(f"the few-row product cannot be built here: {rows.load(aot_cache)}")
    assert _mixed_batch(compiled, eager, [200, 3, 5]) == (1, 0)
    gathers = replace(loaded(tiny_llama(0, layers=4), "tiny-target"), forward="lean")  # PLAIN_LIBRARY's
    with rows.disabled():
        gathers.use_pool(4, 256, compiled="on", cache_dir=aot_cache)
    assert 3 * 202 * gathers.pool.bytes_per_token() > gathers.pool.runner.key_read_limit
    plain_eager = replace(loaded(tiny_llama(0, layers=4), "tiny-target"), forward="lean")
    plain_eager.use_pool(4, 256)
    assert _mixed_batch(gathers, plain_eager, [200, 3, 5]) == (0, 1)


def test_a_prefill_wider_than_the_library_runs_eagerly(compiled, eager):
    a, b = compiled.session(), eager.session()
    prompt = _tokens(100, 5)
    before = compiled.pool.runner.eager
    torch.testing.assert_close(a.extend(prompt, 2)[0], b.extend(prompt, 2)[0], **TOL)
    assert compiled.pool.runner.eager == before + 1
    torch.testing.assert_close(a.extend([9], 1)[0], b.extend([9], 1)[0], **TOL)


def test_greedy_speculation_over_the_compiled_target_equals_the_target_alone(compiled, eager, tiny_draft):
    prompt = _tokens(12, 7)
    flat = CostCurve(0.0, list(range(1, 18)), [0.01] * 17, smoothing=0.0)
    alone = SpeculativeEngine(eager).generate(prompt, SamplingParams(max_new_tokens=40), SpecParams("none"))
    fast = SpeculativeEngine(compiled, HfDrafter(tiny_draft, compiled), costs=flat).generate(
        prompt, SamplingParams(max_new_tokens=40), SpecParams("constant"))
    assert fast.token_ids == alone.token_ids
    assert fast.stats.verifications > 0


def test_an_early_exit_drafter_over_a_compiled_target_drafts_from_its_own_eager_pool(compiled, eager):
    """The drafter's pool of the target's first layers stays eager (it was handed a CUDA graph
    runner for any runner the target's pool had, and failed)."""
    prompt = _tokens(12, 8)
    alone = SpeculativeEngine(eager).generate(prompt, SamplingParams(max_new_tokens=24), SpecParams("none"))
    drafter = EarlyExitDrafter(compiled, 1)
    fast = SpeculativeEngine(compiled, drafter).generate(prompt, SamplingParams(max_new_tokens=24),
                                                         SpecParams("constant"))
    assert fast.token_ids == alone.token_ids
    assert drafter._kv_pool is not None and drafter._kv_pool.runner is None


def test_the_library_is_compiled_once_then_loaded(tiny_target, aot_cache, compiled):
    again = replace(tiny_target, forward="lean")
    again.use_pool(2, 128, compiled="on", cache_dir=aot_cache)  # another pool geometry: the same library
    assert again.pool.runner.compile_seconds == 0.0
    assert again.pool.runner.path == compiled.pool.runner.path


def test_a_pool_with_longer_slots_runs_the_same_library_past_the_first_pools_length(tiny_target, aot_cache,
                                                                                     compiled):
    """The library was compiled for 256-position slots; a 600-position pool loads it and decodes
    at positions 300 and beyond. Its rotary tables were constants of the library, their length
    compiled in: the first position past it aborted the process."""
    longer = replace(tiny_target, forward="lean")
    longer.use_pool(2, 600, compiled="on", cache_dir=aot_cache)
    runner = longer.pool.runner
    assert runner.path == compiled.pool.runner.path
    a, b = longer.session(), replace(tiny_target, forward="lean").session()
    prompt = _tokens(300, 11)
    torch.testing.assert_close(a.extend(prompt, 1)[0], b.extend(prompt, 1)[0], **TOL)
    before = runner.runs
    for ids in ([5], [6, 7, 8], [9]):
        torch.testing.assert_close(a.extend(ids, len(ids))[0], b.extend(ids, len(ids))[0], **TOL)
    assert runner.runs == before + 3


def test_cpu_compile_is_refused_where_it_cannot_run(tiny_target):
    model = replace(tiny_target, forward="lean")
    with pytest.raises(InvalidRequest, match="cpu_compile"):
        model.use_pool(2, 64, compiled="sometimes")


def test_rows_are_the_pool_rows_a_library_takes(compiled):
    s = compiled.session()
    s.extend(_tokens(4, 1), 1)
    hidden, width = compiled.pool.runner.run([PoolRow(s.slot, s.length, [3, 4], 2)], 2, s.length + 2)
    assert hidden.shape[:2] == (1, 2) and width == 2


def _calls_rows_product(path, op: bytes = b"aoti_torch_cpu_rows_linear") -> bool:
    """Whether the library's sources (its wrapper, the proxy executor's nodes) name `op`."""
    with zipfile.ZipFile(path) as package:
        return any(op in package.read(name) for name in package.namelist() if name.endswith((".cpp", ".json")))


def test_the_library_calls_the_few_row_product_where_it_builds(tiny_target, aot_cache, compiled):
    if not rows.loaded():
        pytest.skip(f"the few-row product cannot be built here: {rows.load(aot_cache)}")
    # The operators' C functions, called directly (rows.c_shims), not through the proxy executor.
    assert _calls_rows_product(compiled.pool.runner.path)
    assert _calls_rows_product(compiled.pool.runner.path, b"aoti_torch_cpu_rows_attention")  # the pool read in place
    assert not _calls_rows_product(compiled.pool.runner.path, b"specd::rows_")
    # The same weights as tiny_target, built as PLAIN_LIBRARY builds them: a library's key holds
    # the model's config, which the session's tiny_target may have had written into by then
    # (save_pretrained sets its dtype and architectures).
    plain = replace(loaded(tiny_llama(0, layers=4), "tiny-target"), forward="lean")
    with rows.disabled():  # torch's products: another library, the same forward
        plain.use_pool(2, 128, compiled="on", cache_dir=aot_cache)
    assert plain.pool.runner.path != compiled.pool.runner.path
    for op in (b"aoti_torch_cpu_rows_", b"specd::rows_"):
        assert not _calls_rows_product(plain.pool.runner.path, op)
    a, b = compiled.session(), plain.session()
    ids = _tokens(12, 5)
    torch.testing.assert_close(a.extend(ids, 4)[0], b.extend(ids, 4)[0], **TOL)


def test_a_compiled_target_keeps_its_own_cost_curve(compiled, eager):
    """Windows cost differently compiled and eager: a cached curve of one is not the other's."""
    drafter = NgramDrafter()
    assert curve_key(compiled, drafter) != curve_key(eager, drafter)
