"""The KV pool: one preallocated cache for many sessions, written in place by batched forwards.
Every pooled forward must give each session what its own forward would (logits and the cache
it leaves behind), whatever the batch's padding, and slots must come back at once."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from specd.costs import CostCurve
from specd.errors import InvalidRequest, Overloaded
from specd.runtime.graphs import (
    BATCH_BUCKETS,
    PREFILL_WIDTHS,
    WIDTH_BUCKETS,
    SPAN_BUCKETS,
    GraphRunner,
    all_keys,
    bucket_of,
    buckets_up_to,
    pick_bucket,
)
from specd.runtime.pool import pooled_extend
from specd.tree import DraftTree
from specd.types import SamplingParams, SpecParams

TOL = {"atol": 1e-4, "rtol": 1e-4}


def _tokens(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (n,), generator=gen).tolist()


@pytest.fixture(params=["exact", "fused", "compiled"])
def pooled(tiny_target, request):
    """The tiny target with its sessions in a 4-slot pool (the fixture's own model untouched),
    with the CPU's exact forward, the GPU's fused one and the fused one with each layer through
    torch.compile (as the GPU's graphs capture it), run here on the CPU."""
    model = replace(tiny_target, forward="lean")
    model.use_pool(4, 256)
    model.pool.fused = request.param != "exact"
    if request.param == "compiled":
        model.pool.compile_layers()
    return model


@pytest.fixture
def lean(tiny_target):
    return replace(tiny_target, forward="lean")


PREFIXES = [_tokens(5, 1), _tokens(17, 2), _tokens(40, 3)]
NEW = [_tokens(1, 4), _tokens(4, 5), _tokens(7, 6)]
NUM_LOGITS = [1, 3, 7]


def _prefilled(model, prefixes):
    sessions = [model.session() for _ in prefixes]
    for s, p in zip(sessions, prefixes):
        s.extend(p, 1)
    return sessions


def test_one_pooled_session_computes_the_lean_forward(pooled, lean):
    """A lone session reads exactly its own keys: no padding, so the exact path does the same
    arithmetic bit for bit; the fused one the same math, rounded in another order."""
    exact = not pooled.pool.fused
    a, b = pooled.session(), lean.session()

    def same(x, y):
        if exact:
            assert torch.equal(x, y)
        else:
            torch.testing.assert_close(x, y, **TOL)
            assert torch.equal(x.argmax(-1), y.argmax(-1))

    for ids, k in ((PREFIXES[1], 3), ([9], 1), (NEW[2], 7)):
        same(a.extend(ids, k)[0], b.extend(ids, k)[0])
    a.rollback(10)
    b.rollback(10)
    same(a.extend(NEW[1], 4)[0], b.extend(NEW[1], 4)[0])


def test_batched_pooled_forward_equals_individual_extends(pooled, lean):
    got = pooled_extend(_prefilled(pooled, PREFIXES), NEW, NUM_LOGITS, [True, False, True])
    ref = _prefilled(lean, PREFIXES)
    for (logits, hidden), r, ids, k, wanted in zip(got, ref, NEW, NUM_LOGITS, [True, False, True]):
        want_logits, want_hidden = r.extend(ids, k, True)
        assert logits.shape == (k, pooled.vocab_size) and logits.dtype == torch.float32
        torch.testing.assert_close(logits, want_logits, **TOL)
        assert (hidden is None) != wanted
        if wanted:
            torch.testing.assert_close(hidden, want_hidden, **TOL)
        assert torch.equal(logits.argmax(-1), want_logits.argmax(-1))


def test_sessions_keep_decoding_after_batched_forwards_and_rollbacks(pooled, lean):
    """Rejected drafts are forgotten by length alone: the stale keys past it are never read."""
    sessions, refs = _prefilled(pooled, PREFIXES), _prefilled(lean, PREFIXES)
    pooled_extend(sessions, NEW, NUM_LOGITS)
    for r, ids in zip(refs, NEW):
        r.extend(ids, 1)
    for s, r, keep in zip(sessions, refs, (5, 18, 44)):  # roll back into the window or before it
        s.rollback(keep)
        r.rollback(keep)
        assert s.length == r.length == keep
    nxt = [[11, 12], [13], [14, 15, 16]]
    got = pooled_extend(sessions, nxt, [2, 1, 3])
    for (logits, _), r, ids in zip(got, refs, nxt):
        torch.testing.assert_close(logits, r.extend(ids, len(ids))[0], **TOL)


def test_padded_forward_equals_the_unpadded_one(pooled):
    """What a CUDA graph bucket does on the CPU: extra rows (the trash slot), extra query
    columns (the trash column) and a longer key span change no real row's output, and leave
    every real slot as the unpadded forward would."""
    pool = pooled.pool
    a = _prefilled(pooled, PREFIXES[:2])
    rows = [s.row(ids, len(ids)) for s, ids in zip(a, NEW[1:])]
    exact = pool.hidden(pool.inputs(rows, 2, 7, pool.span(rows)))
    padded = pool.hidden(pool.inputs(rows, 8, 17, 256))
    for b, r in enumerate(rows):
        torch.testing.assert_close(padded[b, :len(r.ids)], exact[b, :len(r.ids)], **TOL)
    for s, ids in zip(a, NEW[1:]):  # the forward ran outside pool.forward: advance by hand
        pool.lengths[s.slot] += len(ids)
    follow = pooled_extend(a, [[21], [22]], [1, 1])
    lean = replace(pooled)  # the same weights, sessions with growing caches
    for (logits, _), prefix, ids, nxt in zip(follow, PREFIXES[:2], NEW[1:], (21, 22)):
        r = lean.session()
        r.extend(prefix + ids, 1)
        torch.testing.assert_close(logits, r.extend([nxt], 1)[0], **TOL)


def test_a_tree_forward_and_keep_path_match_the_growing_cache(pooled, lean):
    tree = DraftTree.from_chain([5, 6])
    tree.add([7, 8], 2)  # a side branch beside the chain
    a, b = pooled.session(), lean.session()
    a.extend(PREFIXES[1][:-1])
    b.extend(PREFIXES[1][:-1])
    torch.testing.assert_close(a.extend_tree(PREFIXES[1][-1:], tree, torch.float32),
                               b.extend_tree(PREFIXES[1][-1:], tree, torch.float32), **TOL)
    base = len(PREFIXES[1])
    a.keep_path(base, [2, 3])
    b.keep_path(base, [2, 3])
    assert a.length == b.length == base + 2
    torch.testing.assert_close(a.extend([9, 10], 2)[0], b.extend([9, 10], 2)[0], **TOL)


def test_a_full_pool_refuses_at_once_and_closing_frees_the_slot(pooled):
    pool = pooled.pool
    sessions = [pooled.session() for _ in range(4)]
    assert pool.in_use() == 4
    with pytest.raises(Overloaded):
        pooled.session()
    sessions[2].close()
    sessions[2].close()  # idempotent
    again = pooled.session()
    assert again.slot == sessions[2].slot and again.length == 0
    for s in sessions[:2] + sessions[3:] + [again]:
        s.close()
    assert pool.in_use() == 0 and pooled.session().nbytes() == 0


def test_a_session_cannot_grow_past_its_slot(pooled):
    assert pooled.max_context == 256  # prompts and windows are checked against the slot
    s = pooled.session()
    s.extend(_tokens(250, 7), 1)
    with pytest.raises(InvalidRequest, match="tokens"):
        s.extend(_tokens(7, 8), 1)
    assert s.length == 250  # the refused forward changed nothing


def test_buckets_take_the_smallest_that_holds_a_forward():
    batches = buckets_up_to(BATCH_BUCKETS, 12)
    assert batches == (1, 2, 4, 8, 12)
    tables = (batches, (1, 2, 4, 8, 17), (256, 512))
    assert pick_bucket(tables, (3, 5, 300)) == (4, 8, 512)
    assert pick_bucket(tables, (12, 17, 256)) == (12, 17, 256)
    assert pick_bucket(tables, (13, 1, 10)) is None  # wider than the largest: run eagerly
    assert pick_bucket(tables, (1, 18, 10)) is None


def test_a_prompts_prefill_alone_takes_a_prefill_width_and_a_batch_never_does():
    # slots of fewer than 512 positions: the widest prefill bucket is left out
    runner = SimpleNamespace(batches=(1, 2, 4), widths=WIDTH_BUCKETS, spans=(256, 512, 1024),
                             prefill_widths=PREFILL_WIDTHS[:4])
    assert GraphRunner.bucket(runner, 1, 40, 40) == (1, 64, 256)
    assert GraphRunner.bucket(runner, 1, 200, 300) == (1, 256, 512)
    assert GraphRunner.bucket(runner, 1, 5, 300) == (1, 6, 512)  # a window keeps its own widths
    assert GraphRunner.bucket(runner, 2, 40, 40) is None  # several rows: eager, as before
    assert GraphRunner.bucket(runner, 1, 300, 300) is None  # wider than the widest: eager


def test_start_up_keys_hold_every_forward_a_bucket_takes():
    """What the target captures at start-up (all_keys) holds the bucket of every forward a
    running server can give the graphs: any rows up to the largest batch, any window width, a
    prompt's prefill in one row, any span up to the pool's length; nothing else is captured."""
    batches, spans = buckets_up_to(BATCH_BUCKETS, 12), buckets_up_to(SPAN_BUCKETS, 3000)
    widths, prefill = WIDTH_BUCKETS, PREFILL_WIDTHS
    keys = all_keys(batches, widths, prefill, spans)
    assert len(keys) == len(set(keys)) == len(batches) * len(widths) * len(spans) + sum(
        s >= w for w in prefill for s in spans)
    taken = set()
    for batch in range(1, 13):
        for width in range(1, (prefill[-1] if batch == 1 else widths[-1]) + 1):
            for span in {width, width + 1, 255, 256, 257, 1000, 2048, 2049, 3000}:
                if span < width or span > spans[-1]:
                    continue
                key = bucket_of(batches, widths, prefill, spans, batch, width, span)
                assert key in keys, (batch, width, span, key)
                taken.add(key)
    assert taken == set(keys)  # and every key captured is one some forward takes
    defaults = (buckets_up_to(BATCH_BUCKETS, 16), WIDTH_BUCKETS, tuple(w for w in PREFILL_WIDTHS if w <= 4608),
                buckets_up_to(SPAN_BUCKETS, 4608))
    assert len(all_keys(*defaults)) == 269  # 16 slots x 4,608 positions, as docs/deploy.md says


def test_a_prompt_padded_to_a_prefill_width_prefills_as_unpadded(pooled, lean):
    """What a prefill bucket does on the CPU: a 40-token prompt in a [1, 64] forward over 256
    key columns; its hidden states, and the session's next step after it, as without padding."""
    pool, prompt = pooled.pool, _tokens(40, 7)
    a, b = pooled.session(), pooled.session()
    exact = pool.hidden(pool.inputs([a.row(prompt, 1)], 1, 40, 40))
    padded = pool.hidden(pool.inputs([b.row(prompt, 1)], 1, 64, 256))
    torch.testing.assert_close(padded[0, :40], exact[0, :40], **TOL)
    pool.lengths[b.slot] += len(prompt)  # the forward ran outside pool.forward: advance by hand
    r = lean.session()
    r.extend(prompt, 1)
    torch.testing.assert_close(b.extend([9], 1)[0], r.extend([9], 1)[0], **TOL)


def test_a_cpu_pool_costs_the_memory_its_sessions_write(lean, tiny_target):
    """Slots are allocated lazily by the kernel: opening a large pool costs (almost) nothing,
    a session costs about the positions it wrote, not its slot's whole length, and closing it
    gives those pages back."""
    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    lean.session().extend(_tokens(40, 9), 1)  # the lean forward's own set-up, before measuring
    opened = resident()
    pool = lean.use_pool(64, 4096)
    whole = 2 * pool.k.numel() * pool.k.element_size()
    assert resident() - opened < whole / 20
    warm = lean.session()  # the first forward's own allocations, before measuring
    warm.extend(_tokens(40, 9), 1)
    warm.close()
    before = resident()
    s = lean.session()
    s.extend(_tokens(40, 9), 1)
    assert resident() - before < whole / 20  # one slot of 64, 40 of its 4,096 positions
    s.close()
    # Long sessions' pages go back to the kernel when they close: memory follows open sessions.
    full = [lean.session() for _ in range(16)]
    for session in full:
        session.extend(_tokens(pool.max_len - 8, 10), 1)
    grown = resident()
    written = 16 * (pool.max_len - 8) * pool.bytes_per_token()
    assert grown - before > written / 2
    for session in full:
        session.close()
    assert grown - resident() > written / 2
    again = lean.session()  # the slot reads as zeros and works as before
    r = replace(tiny_target, forward="lean").session()  # growing caches
    torch.testing.assert_close(again.extend(_tokens(30, 11), 2)[0], r.extend(_tokens(30, 11), 2)[0], **TOL)
    again.close()


@pytest.mark.parametrize("drafter, spec", [
    ("ngram", SpecParams("constant", max_draft_tokens=4, branches=3)),  # draft trees: masked pool forwards
    ("early-exit", SpecParams("constant", max_draft_tokens=3)),  # the drafter opens a pool of its own layers
])
@pytest.mark.parametrize("sampling", [SamplingParams(max_new_tokens=40),
                                      SamplingParams(temperature=1.0, seed=3, max_new_tokens=40)])
def test_the_engine_over_a_pool_decodes_as_over_growing_caches(lean, drafter, spec, sampling):
    from specd.drafters import build_drafter
    from specd.engine import SpeculativeEngine

    prompt = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 11, 5, 6, 7]
    pooled = replace(lean)
    pooled.use_pool(2, 256)
    # One frozen cost curve for both, flat, so side nodes pay wherever the drafter has them:
    # measured per engine, the two curves differed, and so did the trees grown on them (a fresh
    # clone's make test: 25 drafts and a tree round against 23 and none, the same tokens).
    curve = CostCurve(0.0, list(range(1, 17)), [0.01] * 16, smoothing=0.0)
    runs = []
    for target in (lean, pooled):
        engine = SpeculativeEngine(target, build_drafter(drafter, target, draft_layers=2), costs=curve)
        g = engine.generate(prompt, sampling, spec)
        runs.append((g.token_ids, g.stats.drafted, g.stats.accepted, g.stats.tree_rounds))
    assert runs[0] == runs[1]
    assert pooled.pool.in_use() == 0


def test_the_automatic_pool_fits_a_share_of_free_memory(tiny_target):
    from specd.runtime.loading import MIN_POOL_LEN, pool_length

    config = tiny_target.model.config  # 4 layers, 2 KV heads of 16: 1 KiB a position in float32
    per_token = 2 * 4 * 2 * 16 * 4
    assert pool_length(config, torch.float32, 8, 512, 1 << 40) == 512  # the context, when it fits
    assert pool_length(config, torch.float32, 8, 1 << 20, 4 * 8 * 1000 * per_token) == 999
    assert pool_length(config, torch.bfloat16, 8, 1 << 20, 4 * 8 * 1000 * per_token) == 1999
    assert pool_length(config, torch.float32, 8, 1 << 20, 4 * 8 * (MIN_POOL_LEN - 10) * per_token) == 0


def test_rows_of_unequal_length_run_packed_on_the_exact_path(pooled):
    """A window among decode steps: the projections see only real tokens (x.packed), and the
    logits are those of the padded layout."""
    pool = pooled.pool
    rows = [s.row(ids, len(ids)) for s, ids in zip(_prefilled(pooled, PREFIXES), NEW)]
    x = pool.inputs(rows, len(rows), 7, pool.span(rows))
    assert (x.packed is not None) != pool.fused
    if x.packed is not None:
        assert x.packed.tolist() == [0, 7, 8, 9, 10, 14, 15, 16, 17, 18, 19, 20]
        padded = pool.hidden(replace(x, packed=None))
        packed = pool.hidden(x)
        for b, r in enumerate(rows):
            torch.testing.assert_close(packed[b, :len(r.ids)], padded[b, :len(r.ids)], **TOL)


def test_rows_of_very_different_contexts_attend_in_groups(pooled, lean):
    """One long context among short ones: the short rows attend together over their own span,
    the long one alone over its slot; each row's logits are its own forward's."""
    prefixes, new = [_tokens(5, 1), _tokens(7, 2), _tokens(60, 3)], [[9], [10, 11], [12, 13, 14]]
    sessions = _prefilled(pooled, prefixes)
    rows = [s.row(ids, len(ids)) for s, ids in zip(sessions, new)]
    x = pooled.pool.inputs(rows, 3, 3, pooled.pool.span(rows))
    if not pooled.pool.fused:
        assert [(m.tolist(), span, lone) for m, span, lone in x.groups] == [
            ([0, 1], 9, None), ([2], 63, sessions[2].slot)]
    got = pooled_extend(sessions, new, [len(ids) for ids in new])
    for (logits, _), r, ids in zip(got, _prefilled(lean, prefixes), new):
        want = r.extend(ids, len(ids))[0]
        torch.testing.assert_close(logits, want, **TOL)
        assert torch.equal(logits.argmax(-1), want.argmax(-1))
