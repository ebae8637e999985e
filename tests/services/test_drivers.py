"""One scenario suite, run against every driver of the speculative round: in process
(SpeculativeEngine), sequential and with PEARL; across the services with a draft service,
sequential and with PEARL; with the target drafting itself (no draft service); and with draft
trees. Each scenario's greedy and seeded tokens must equal the target decoding alone, in every
driver: an end of sequence inside a window, a length cut, a stop string across rounds,
rollbacks after rejected drafts, a draft (service, thread or in-process drafter) that dies
mid-request, and unseeded sampling."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from services.common.settings import TargetSettings
from services.coordinator.api import GenerateRequest
from services.coordinator.coordinator import Coordinator, CoordinatorConfig, FinishEvent
from services.common.state import AsyncMemoryStateStore
from services.target.main import start as start_target
from services.target.servicer import TargetServicer
from specd.drafters import build_drafter
from specd.engine import OverlapRun, SpeculativeEngine
from specd.types import SamplingParams, SpecParams
from tests.services.conftest import Service, draft_service
from tests.specd.drafters.faults import Faulty, dies_after

DRIVERS = ["engine", "engine-pearl", "services", "services-pearl", "drafting-on-target", "trees"]
WITH_DRAFT_SERVICE = {"services", "services-pearl", "trees"}
PROMPT = "the cat sat, the cat sat, the"  # repeats itself: lookups are right and wrong
OTHER = "Hello there, how are"
SEEDED = dict(temperature=1.0, seed=7)


@dataclasses.dataclass
class Drivers:
    """The target (with an end-of-sequence token its greedy answer to PROMPT meets after
    EOS_AT tokens), its services and the drafters each driver uses."""
    target: object
    draft: object
    eos: int
    plain: Service  # the target service
    drafting: Service  # the same target, drafting with its own n-gram lookups
    hf: Service  # a model draft service (a 1%-noise copy of the target: drafts are rejected too)
    ngram: Service  # a lookup draft service growing draft trees

    def ids(self, text: str) -> list[int]:
        return self.target.encode_prompt(text, chat=False)

    def alone(self, text: str, sampling: SamplingParams) -> tuple[list[int], str]:
        r = SpeculativeEngine(self.target).generate(self.ids(text), sampling, SpecParams("none"))
        return r.token_ids, r.finish_reason

    def run(self, driver: str, text: str, sampling: SamplingParams, spec: SpecParams = SpecParams("constant"),
            kill_draft_after: int | None = None) -> tuple[list[int], str, dict]:
        """(tokens, finish reason, spec stats) of the driver; kill_draft_after: stop the draft
        service once this many tokens have come (a fresh one, for this request alone)."""
        if driver in ("engine", "engine-pearl"):
            drafter = build_drafter("hf", self.draft, self.draft)
            if kill_draft_after is not None:
                drafter = Faulty(drafter, dies_after(kill_draft_after))
            engine = SpeculativeEngine(self.target, drafter)
            run = engine.start(self.ids(text), sampling, spec, overlap=driver == "engine-pearl")
            try:
                ids = [t for new in run for t in new]
            finally:
                run.close()
            assert isinstance(run, OverlapRun) == (driver == "engine-pearl")
            return ids, run.finish_reason, run.stats.to_dict()
        target = self.drafting if driver == "drafting-on-target" else self.plain
        draft = {"services": self.hf, "services-pearl": self.hf, "trees": self.ngram}.get(driver)
        if kill_draft_after is not None:
            draft = draft_service(self.plain.loop, *self._drafter(driver), **self._options(driver))
        request = GenerateRequest(prompt=text, sampling=sampling, spec=spec, overlap=driver == "services-pearl")
        try:
            return asyncio.run(_generate(target.address, draft.address if draft else None, request,
                                         draft if kill_draft_after is not None else None, kill_draft_after))
        finally:
            if kill_draft_after is not None and draft.server is not None:
                draft.stop()

    def _drafter(self, driver: str) -> tuple:
        return (build_drafter("ngram", None), None) if driver == "trees" else \
            (build_drafter("hf", self.draft, self.draft), self.draft)

    @staticmethod
    def _options(driver: str) -> dict:
        return {"branches": 2} if driver == "trees" else {}


async def _generate(target_addr: str, draft_addr: str | None, request: GenerateRequest, draft: Service | None,
                    kill_after: int | None) -> tuple[list[int], str, dict]:
    coord = Coordinator(CoordinatorConfig(target_addr, draft_addr), AsyncMemoryStateStore())
    await coord.connect()
    ids, finish = [], None
    try:
        async for ev in coord.generate(request):
            if isinstance(ev, FinishEvent):
                finish = ev
                continue
            ids += ev.token_ids
            if draft is not None and draft.server is not None and len(ids) >= kill_after:
                await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(draft.server.stop(0), draft.loop.loop))
                draft.server = None
    finally:
        await coord.close()
    return ids, finish.finish_reason, finish.spec_stats


EOS_AT = 12  # the greedy answer to PROMPT ends here, inside a window


@pytest.fixture(scope="module")
def drivers(service_loop, chat_pair):
    target, draft = chat_pair
    # An end-of-sequence token the greedy answer to PROMPT first meets at EOS_AT, and OTHER's
    # not in its first 48 tokens: PROMPT then ends inside a window, OTHER runs to its length.
    answer = SpeculativeEngine(target).generate(target.encode_prompt(PROMPT, chat=False),
                                                SamplingParams(max_new_tokens=48), SpecParams("none")).token_ids
    other = SpeculativeEngine(target).generate(target.encode_prompt(OTHER, chat=False),
                                               SamplingParams(max_new_tokens=48), SpecParams("none")).token_ids
    at = next(i for i in range(EOS_AT, 40) if answer[i] not in answer[:i] and answer[i] not in other)
    eos = answer[at]
    target = dataclasses.replace(target, eos_token_ids=frozenset({eos}))

    def serve(servicer) -> Service:
        server, port = service_loop.run(start_target(TargetSettings(port=0), servicer))
        return Service(f"127.0.0.1:{port}", servicer, server, service_loop)

    services = [serve(TargetServicer(target)), serve(TargetServicer(target, drafter=build_drafter("ngram", None))),
                draft_service(service_loop, build_drafter("hf", draft, draft), draft),
                draft_service(service_loop, build_drafter("ngram", None), None, branches=2)]
    yield Drivers(target, draft, eos, *services)
    for s in services:
        s.stop()


@pytest.mark.parametrize("driver", DRIVERS)
def test_an_end_of_sequence_inside_a_window_ends_the_text_there(drivers, driver):
    sampling = SamplingParams(max_new_tokens=48)
    want, reason = drivers.alone(PROMPT, sampling)
    assert reason == "stop" and want[-1] == drivers.eos and len(want) < 48
    ids, reason, _ = drivers.run(driver, PROMPT, sampling, SpecParams("constant", None, {"k": 5}))
    assert (ids, reason) == (want, "stop")


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_length_cut_inside_a_window_is_exact(drivers, driver):
    sampling = SamplingParams(max_new_tokens=29)  # not a multiple of the window
    want, reason = drivers.alone(OTHER, sampling)
    assert reason == "length" and len(want) == 29
    assert drivers.run(driver, OTHER, sampling, SpecParams("constant", None, {"k": 4}))[:2] == (want, "length")


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_stop_string_across_rounds_cuts_where_the_target_alone_does(drivers, driver):
    full, _ = drivers.alone(OTHER, SamplingParams(max_new_tokens=40))
    stop = drivers.target.decode(full[14:19])  # five characters: five tokens, across windows of three
    sampling = SamplingParams(max_new_tokens=40, stop=(stop,))
    want, reason = drivers.alone(OTHER, sampling)
    assert reason == "stop" and len(want) < 40
    assert drivers.run(driver, OTHER, sampling, SpecParams("constant", None, {"k": 3}))[:2] == (want, "stop")


@pytest.mark.parametrize("driver", DRIVERS)
def test_rejected_drafts_are_rolled_back(drivers, driver):
    """Long windows of a noisy draft (or of lookups): some drafts are rejected, and what the
    target keeps is its own."""
    sampling = SamplingParams(max_new_tokens=40)
    want, _ = drivers.alone(OTHER, sampling)
    ids, _, stats = drivers.run(driver, OTHER, sampling, SpecParams("constant", None, {"k": 8}))
    assert ids == want
    assert stats["accepted"] < stats["drafted"]  # a rejection happened, and was rolled back
    assert stats.get("tree_rounds", 0) > 0 if driver == "trees" else not stats.get("tree_rounds")
    assert bool(stats.get("drafted_on_target")) == (driver == "drafting-on-target")
    assert bool(stats.get("overlap")) == driver.endswith("-pearl")


@pytest.mark.parametrize("driver", DRIVERS)
def test_seeded_sampling_is_the_target_alones(drivers, driver):
    sampling = SamplingParams(max_new_tokens=32, **SEEDED)
    want, reason = drivers.alone(OTHER, sampling)
    spec = SpecParams("constant", None, {"k": 3})
    assert drivers.run(driver, OTHER, sampling, spec)[:2] == (want, reason)


@pytest.mark.parametrize("driver", DRIVERS)
def test_unseeded_sampling_runs_to_its_length_or_its_end(drivers, driver):
    sampling = SamplingParams(max_new_tokens=24, temperature=1.0)
    ids, reason, _ = drivers.run(driver, OTHER, sampling, SpecParams("constant", None, {"k": 3}))
    assert (reason == "length" and len(ids) == 24) or (reason == "stop" and ids[-1] == drivers.eos)
    assert all(0 <= t < drivers.target.emitted_vocab for t in ids)


@pytest.mark.parametrize("driver", sorted(WITH_DRAFT_SERVICE | {"engine", "engine-pearl"}))
def test_a_draft_that_dies_mid_request_loses_nothing(drivers, driver):
    sampling = SamplingParams(max_new_tokens=48)
    want, want_reason = drivers.alone(OTHER, sampling)
    ids, reason, stats = drivers.run(driver, OTHER, sampling, SpecParams("constant", None, {"k": 3}),
                                     kill_draft_after=4)
    assert (ids, reason) == (want, want_reason)
    assert stats["fallback"] and stats["fallback_kind"] == "failed"
