"""The target's core with no transport: a session is its requests in and its replies out
(services.target.core), and it decodes what the target alone decodes; a request it cannot
serve is an error in its turn, and a client that goes quiet is ended (Idle)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.target.core import OpenRequest, Reply, TargetConfig, TargetCore, WindowRequest
from services.target.drafting import Closed, LocalSpec
from specd.engine import SpeculativeEngine
from specd.errors import Idle, InvalidRequest
from specd.types import SamplingParams, SpecParams

PROMPT = [5, 9, 14, 20, 33, 40]
GREEDY = SamplingParams(max_new_tokens=24)


@pytest.fixture
def core(tiny_target):
    """A core per test: its batcher's worker lives on the event loop of the test's asyncio.run."""
    with ThreadPoolExecutor(1) as executor:
        yield TargetCore(tiny_target, TargetConfig(max_batch_size=2, idle_timeout_s=0.3), executor=executor)


async def _requests(*items, pause: float = 0.0):
    for item in items:
        yield item
    await asyncio.sleep(pause)


def _run(core: TargetCore, open_req: OpenRequest, *items, pause: float = 0.0) -> list:
    async def run():
        return [out async for out in core.session(open_req, _requests(*items, pause=pause))]
    return asyncio.run(run())


def _alone(target, n: int) -> list[int]:
    return SpeculativeEngine(target).generate(PROMPT, SamplingParams(max_new_tokens=n), SpecParams("none")).token_ids


def test_single_steps_and_a_multi_step_run_decode_the_target_alone(core, tiny_target):
    out = _run(core, OpenRequest(prompt=PROMPT, sampling=GREEDY), WindowRequest(verify_id=1),
               WindowRequest(verify_id=2), WindowRequest(verify_id=3, steps=6))
    replies, closed = out[:-1], out[-1]
    assert all(isinstance(r, Reply) for r in replies) and isinstance(closed, Closed)
    assert [r.verify_id for r in replies] == [1, 2] + [3] * 6
    assert [r.judged.verdict.next_token for r in replies] == _alone(tiny_target, 8)
    assert replies[0].prefill_seconds > 0 and all(r.prefill_seconds == 0 for r in replies[1:])
    assert core.active_sessions == 0


def test_a_window_of_the_target_alone_is_accepted_whole(core, tiny_target):
    ids = _alone(tiny_target, 5)
    (reply, _) = _run(core, OpenRequest(prompt=PROMPT, sampling=GREEDY), WindowRequest(verify_id=1, drafts=ids[:4]))
    assert reply.judged.verdict.num_accepted == 4 and reply.judged.verdict.next_token == ids[4]


def test_a_session_drafting_here_decodes_the_target_alone(tiny_target):
    from specd.drafters import build_drafter

    local = LocalSpec(spec=SpecParams("constant", None, {"k": 3}), max_length=len(PROMPT) + 16)
    with ThreadPoolExecutor(1) as executor:
        core = TargetCore(tiny_target, TargetConfig(max_batch_size=2), executor=executor,
                          drafter=build_drafter("ngram", None))
        out = _run(core, OpenRequest(prompt=PROMPT, sampling=GREEDY, speculate=local),
                   WindowRequest(verify_id=1, steps=16))
    tokens = [t for r in out[:-1] for t in r.judged.accepted + [r.judged.verdict.next_token]]
    assert tokens[:16] == _alone(tiny_target, 16)
    assert isinstance(out[-1], Closed) and out[-1].num_drafted == sum(r.judged.drafted for r in out[:-1])


def test_an_unreadable_message_is_raised_in_its_turn(core):
    async def run(got: list):
        async for out in core.session(OpenRequest(prompt=PROMPT, sampling=GREEDY),
                                      _requests(WindowRequest(verify_id=1), InvalidRequest("kind", "bad"))):
            got.append(out)

    got: list = []
    with pytest.raises(InvalidRequest, match="kind"):
        asyncio.run(run(got))
    assert [r.verify_id for r in got] == [1]  # the reply before it still came
    assert core.active_sessions == 0


def test_a_client_that_goes_quiet_is_ended(core, tiny_target):
    with pytest.raises(Idle, match="idle_timeout_s"):
        _run(core, OpenRequest(prompt=PROMPT, sampling=GREEDY), WindowRequest(verify_id=1), pause=5.0)
    assert core.active_sessions == 0
    assert tiny_target.pool is None or tiny_target.pool.in_use() == 0


def test_the_load_fit_is_exported_as_it_moves(core, tiny_target):
    """specd_target_load_fit{term}: what the forwards cost against the start-up surface, the
    numbers cost-aware prices a window with where the target drafts (1 before any forward)."""
    labels = {"model": tiny_target.name}
    read = lambda term: core.registry.get_sample_value("specd_target_load_fit", {**labels, "term": term})  # noqa: E731
    fit = core.costs.value("load_fit")
    assert fit is not None and (read("base"), read("token")) == (fit.a, fit.b) == (1.0, 1.0)
    _run(core, OpenRequest(prompt=PROMPT, sampling=GREEDY), WindowRequest(verify_id=1, steps=6))
    fit = core.costs.value("load_fit")
    assert fit.forwards >= 6 and (read("base"), read("token")) == (fit.a, fit.b) != (1.0, 1.0)
