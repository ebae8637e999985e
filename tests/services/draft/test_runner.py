"""The draft runner's window bookkeeping with commits arriving while a forward pass is in
flight (as under PEARL, where the coordinator verifies a window's first tokens while the
rest is drafted): windows stay aligned with the sequence and are judged, so drafting never
waits for a verdict that cannot come."""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor, Future

import pytest

from services.draft.runner import DraftRunner
from specd.drafters.base import DraftSession, DraftToken
from specd.policies import Decision, PolicyParams, StoppingPolicy, build_policy
from specd.speculation.proposer import Ack, Commit, Token, WindowEnd
from specd.types import RoundOutcome, SamplingParams

PROMPT = [1, 2, 3]


def draft_of(position: int) -> int:
    return 100 + position  # the fake drafter's guess for a position


class FakeSession(DraftSession):
    def next(self, seq, params, generator, want_hidden):
        return DraftToken(draft_of(len(seq)), None, 1.0, 1.0, 0.0)

    def rollback(self, length: int) -> None:
        pass


class ManualExecutor(Executor):
    """Runs a submitted forward only when the test says so."""

    def __init__(self):
        self.pending: list[tuple[Future, object, tuple]] = []

    def submit(self, fn, *args, **kwargs):
        future: Future = Future()
        self.pending.append((future, fn, args))
        return future

    def step(self) -> None:
        future, fn, args = self.pending.pop(0)
        future.set_result(fn(*args))


def constant_runner(k: int, executor: ManualExecutor, events: list) -> DraftRunner:
    """Drafting windows of k with lookahead 2 (PEARL), after PROMPT."""
    return DraftRunner(FakeSession(), build_policy("constant", {"k": k}, {}), SamplingParams(), PROMPT,
                       max_length=64, lookahead=2, send_q=False, executor=executor, publish=events.append)


def started(policy: StoppingPolicy, lookahead: int = 2, max_length: int = 64, **kw) -> tuple:
    """(runner, its published events, its executor, its drafting task) after PROMPT."""
    events: list = []
    executor = ManualExecutor()
    runner = DraftRunner(FakeSession(), policy, SamplingParams(), PROMPT, max_length=max_length, lookahead=lookahead,
                         send_q=False, executor=executor, publish=events.append, **kw)
    return runner, events, executor, asyncio.create_task(runner.run())


def aligned(runner: DraftRunner) -> bool:
    """Each window's i-th token sits at position start + i of the runner's sequence."""
    return all(runner.seq[w.start + i] == t for w in runner.windows for i, t in enumerate(w.tokens))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_commit_overtaking_the_open_window_ends_it():
    async def run():
        events: list = []
        executor = ManualExecutor()
        runner = constant_runner(5, executor, events)
        task = asyncio.create_task(runner.run())
        await settle()
        executor.step()  # drafts position 3
        await settle()
        assert [e.position for e in events if isinstance(e, Token)] == [3]
        assert len(executor.pending) == 1  # position 4 is being drafted

        # The coordinator verified [draft 3] alone (pre-verify): accepted, then its own token
        # at 4, which the drafter has not reached yet.
        runner.commit(Commit(1, (draft_of(3), 999), num_verified=1, num_strict=1))
        assert events[-1] == Ack(1, 0)  # nothing rolled back
        assert runner.seq == [*PROMPT, draft_of(3), 999]
        assert aligned(runner)
        executor.step()  # the proposal for position 4 is moot now
        await settle()
        executor.step()  # drafts position 5: the first token of a new window
        await settle()
        assert aligned(runner)
        assert [w.start for w in runner.windows] == [5]
        assert [e.position for e in events if isinstance(e, Token)] == [3, 5]

        # Draft the rest of that window and the next (lookahead 2), then verify them all.
        while len(executor.pending) and len(runner.seq) < 5 + 10:
            executor.step()
            await settle()
        ends = [e for e in events if isinstance(e, WindowEnd)]
        assert [(e.start, e.end) for e in ends] == [(5, 10), (10, 15)]
        assert not executor.pending  # lookahead reached: waiting for a verdict
        runner.commit(Commit(2, tuple(draft_of(p) for p in range(5, 10)) + (draft_of(10),), num_verified=5,
                             num_strict=5))
        runner.commit(Commit(3, tuple(draft_of(p) for p in range(11, 15)) + (7,), num_verified=4, num_strict=4))
        # Every window was judged and forgotten: drafting goes on after the committed tokens.
        assert runner.windows == []
        await settle()
        assert executor.pending, "the runner waits for a verdict that will never come"
        assert [w.start for w in runner.windows] == [16]
        task.cancel()
        return runner

    runner = asyncio.run(run())
    assert runner.committed == 16


def test_an_empty_open_window_moves_past_the_commit():
    """The commit lands while the window's first forward is in flight."""
    async def run():
        events: list = []
        executor = ManualExecutor()
        runner = constant_runner(3, executor, events)
        task = asyncio.create_task(runner.run())
        await settle()
        assert len(executor.pending) == 1 and runner.windows[0].start == 3 and not runner.windows[0].tokens
        runner.commit(Commit(1, (42,), num_verified=0, num_strict=0))  # a plain decoding step: 42 at 3
        executor.step()  # moot
        await settle()
        executor.step()  # position 4
        await settle()
        assert aligned(runner)
        assert [w.start for w in runner.windows] == [4]
        task.cancel()

    asyncio.run(run())


def test_a_rejection_inside_the_open_window_rolls_it_back():
    """The coordinator verified the open window's first two drafts and rejected the second:
    the window is judged and dropped, and drafting resumes after the recovered token."""
    async def run():
        events: list = []
        executor = ManualExecutor()
        runner = constant_runner(5, executor, events)
        task = asyncio.create_task(runner.run())
        for _ in range(3):  # drafts 3, 4, 5 of one window; 6 is in flight
            await settle()
            executor.step()
        await settle()
        assert runner.seq == [*PROMPT, draft_of(3), draft_of(4), draft_of(5)] and not runner.windows[0].ended
        runner.commit(Commit(1, (draft_of(3), 77), num_verified=2, num_strict=1))  # 4 rejected, 77 instead
        assert events[-1] == Ack(1, 1)  # rolled back: a new epoch
        assert runner.seq == [*PROMPT, draft_of(3), 77] and runner.windows == []
        executor.step()  # moot
        await settle()
        executor.step()  # position 5, a new window
        await settle()
        assert aligned(runner) and [w.start for w in runner.windows] == [5]
        assert [(e.epoch, e.position) for e in events if isinstance(e, Token)][-1] == (1, 5)
        task.cancel()

    asyncio.run(run())


class DropFirst(StoppingPolicy):
    """Drops every window's first token and records what it is told."""

    name = "drop-first"

    def __init__(self):
        super().__init__(PolicyParams())
        self.outcomes: list[RoundOutcome] = []

    def decide(self, step):
        return Decision.DROP

    def observe(self, outcome):
        self.outcomes.append(outcome)


def test_a_dropped_token_is_judged_by_the_token_committed_in_its_place():
    """A policy that declines to speculate still learns whether its guess was right: the
    target's plain step at that position says so (the cost-aware policy recalibrates on it)."""
    async def run():
        events: list = []
        executor = ManualExecutor()
        policy = DropFirst()
        runner = DraftRunner(FakeSession(), policy, SamplingParams(), PROMPT, max_length=64, lookahead=1,
                             send_q=False, executor=executor, publish=events.append)
        task = asyncio.create_task(runner.run())
        await settle()
        executor.step()  # proposes draft_of(3); dropped
        await settle()
        assert [(e.start, e.end) for e in events if isinstance(e, WindowEnd)] == [(3, 3)]
        assert not executor.pending  # an empty window: nothing to draft from until the commit
        runner.commit(Commit(1, (draft_of(3),), num_verified=0, num_strict=0))  # the target agreed
        await settle()
        executor.step()  # proposes draft_of(4); dropped
        await settle()
        runner.commit(Commit(2, (5,), num_verified=0, num_strict=0))  # the target did not
        task.cancel()
        return policy

    policy = asyncio.run(run())
    assert [(o.num_drafted, o.dropped.token, o.dropped_accepted) for o in policy.outcomes] == [
        (0, draft_of(3), True), (0, draft_of(4), False)]


class NeverDraft(DropFirst):
    name = "never-draft"

    def should_draft(self):
        return False


def test_a_policy_that_skips_drafting_gets_plain_steps():
    async def run():
        events: list = []
        executor = ManualExecutor()
        runner = DraftRunner(FakeSession(), NeverDraft(), SamplingParams(), PROMPT, max_length=64, lookahead=2,
                             send_q=False, executor=executor, publish=events.append)
        task = asyncio.create_task(runner.run())
        await settle()
        assert not executor.pending  # nothing drafted
        runner.commit(Commit(1, (42,), num_verified=0, num_strict=0))
        await settle()
        task.cancel()
        return events

    events = asyncio.run(run())
    assert [(e.start, e.end, e.reason) for e in events if isinstance(e, WindowEnd)] == [
        (3, 3, "policy"), (4, 4, "policy")]  # an empty window per round: verify a plain step
    assert not [e for e in events if isinstance(e, Token)]


def test_cost_aware_prices_the_next_window_in_the_forward_the_commit_reports():
    """A commit carries the load of the target forward that verified it; cost-aware then stops
    drafting where the batch is compute-bound (a drafted token costs more than another session's
    step) and drafts again once the batch is small."""
    from specd.costs import CostCurve
    from specd.policies import PolicyResources

    ks = list(range(1, 18))
    costs = CostCurve(0.0005, ks, [0.020 + 0.0002 * (n - 1) for n in ks], load_smoothing=1.0,
                      batch_seconds=[0.020 + 0.006 * (b - 1) for b in range(1, 33)],
                      batch_token_seconds=[0.012] * 32)
    policy = build_policy("cost-aware", {}, {}, PolicyResources(costs=costs))

    async def run():
        events: list = []
        executor = ManualExecutor()
        runner = DraftRunner(FakeSession(), policy, SamplingParams(), PROMPT, max_length=64, lookahead=1,
                             send_q=False, executor=executor, publish=events.append)
        task = asyncio.create_task(runner.run())
        drafted = []
        for commit_id, others in enumerate([(31, 31), (0, 0)], 1):
            await settle()
            while executor.pending:  # draft the open window to its end
                executor.step()
                await settle()
            ends = [e for e in events if isinstance(e, WindowEnd)]
            drafted.append(ends[-1].end - ends[-1].start)
            runner.commit(Commit(commit_id, tuple(runner.seq[ends[-1].start:ends[-1].end]) + (9,),
                                 num_verified=drafted[-1], num_strict=drafted[-1], other_sessions=others[0],
                                 other_tokens=others[1]))
        await settle()
        while executor.pending:
            executor.step()
            await settle()
        ends = [e for e in events if isinstance(e, WindowEnd)]
        drafted.append(ends[-1].end - ends[-1].start)
        task.cancel()
        return drafted

    alone, crowded, small_again = asyncio.run(run())
    assert alone >= 4  # the first window: no load reported yet
    assert crowded == 0  # after a forward with 31 others of one token each
    assert small_again >= 4


async def last_window(runner, events, executor) -> tuple[int, ...]:
    """Let the runner draft until it waits; the drafts of the last window it ended."""
    while executor.pending:
        executor.step()
        await settle()
    end = [e for e in events if isinstance(e, WindowEnd)][-1]
    return tuple(runner.seq[end.start:end.end])


class EveryOtherRound(StoppingPolicy):
    """Drafts one token on odd rounds, declines on even ones; records the measured pace."""

    name = "every-other"

    def __init__(self):
        super().__init__(PolicyParams())
        self.rounds = 0
        self.paces: list[tuple[int, float, bool]] = []

    def should_draft(self):
        self.rounds += 1
        return self.rounds % 2 == 1

    def decide(self, step):
        return Decision.STOP

    def observe_pace(self, tokens, seconds, drafted):
        self.paces.append((tokens, seconds, drafted))


def test_the_pace_times_each_round_and_says_whether_the_drafter_ran():
    """cost-aware's measured pace: each commit after the first is timed from the previous one and
    marked by whether its window was drafted or declined (a plain round)."""
    policy = EveryOtherRound()

    async def run():
        runner, events, executor, task = started(policy, lookahead=1)
        for commit_id in range(1, 6):
            await settle()
            drafted = await last_window(runner, events, executor)
            runner.commit(Commit(commit_id, drafted + (7,), num_verified=len(drafted), num_strict=len(drafted)))
        task.cancel()

    asyncio.run(run())
    # the first commit (which also waited for the prefill) is not timed; rounds 2..5 alternate
    assert [(t, d) for t, _, d in policy.paces] == [(1, False), (2, True), (1, False), (2, True)]
    assert all(s > 0 for _, s, _ in policy.paces)


def test_load_caps_shorten_windows_as_the_target_forward_fills():
    """load_draft_caps (vLLM's cut-off by batch size, for any policy): constant K = 8 drafts 8
    alone, at most 2 while 4 or more sessions share the target's forward, none from 8 on (a plain
    round), and 8 again once the load falls."""
    async def run():
        runner, events, executor, task = started(build_policy("constant", {"k": 8}, {}), lookahead=1, max_length=256,
                                                 load_caps=((4, 2), (8, 0)))
        windows = []
        for commit_id, others in enumerate([3, 9, 0, 0], 1):  # the load each window then sees
            await settle()
            while executor.pending:
                executor.step()
                await settle()
            end = [e for e in events if isinstance(e, WindowEnd)][-1]
            windows.append((end.end - end.start, end.reason))
            drafted = tuple(runner.seq[end.start:end.end])
            runner.commit(Commit(commit_id, drafted + (7,), num_verified=len(drafted), num_strict=len(drafted),
                                 other_sessions=others))
        task.cancel()
        return windows

    assert asyncio.run(run()) == [(8, "policy"), (2, "cap"), (0, "policy"), (8, "policy")]


class PlainStretches(StoppingPolicy):
    """Declines four rounds at a time, then drafts one token; records the pace."""

    name = "plain-stretches"

    def __init__(self):
        super().__init__(PolicyParams())
        self.asked = 0
        self.paces: list[bool] = []

    def should_draft(self):
        self.asked += 1
        return self.asked % 2 == 0  # asked once per stretch: declines, then drafts

    def plain_rounds(self):
        return 4

    def decide(self, step):
        return Decision.STOP

    def observe_pace(self, tokens, seconds, drafted):
        self.paces.append(drafted)


def test_a_stretch_of_plain_rounds_is_announced_once_and_drafts_nothing_until_it_ends():
    """A policy that knows it will not draft for four rounds says so in one empty WindowEnd
    (repeat 4): the coordinator then verifies four plain steps without waiting on the
    draft, the runner drafts nothing until they are committed, and each is timed as plain."""
    policy = PlainStretches()

    async def run():
        runner, events, executor, task = started(policy)
        await settle()
        for commit_id in range(1, 5):  # the four plain rounds, committed one by one
            assert not executor.pending  # nothing drafted inside the stretch
            runner.commit(Commit(commit_id, (7,), num_verified=0, num_strict=0))
            await settle()
        assert executor.pending  # the stretch is over: the next window drafts
        task.cancel()
        return events

    events = asyncio.run(run())
    ends = [e for e in events if isinstance(e, WindowEnd)]
    assert [(e.start, e.end, e.repeat) for e in ends] == [(3, 3, 4)]
    assert policy.asked == 2 and policy.paces == [False, False, False]  # the first commit is not timed


class DraftsThenDeclines(StoppingPolicy):
    """Drafts a window of three, then declines the next round for `rounds` plain rounds."""

    name = "drafts-then-declines"

    def __init__(self, rounds: int):
        super().__init__(PolicyParams())
        self.rounds, self.asked = rounds, 0

    def should_draft(self):
        self.asked += 1
        return self.asked != 2

    def plain_rounds(self):
        return self.rounds

    def decide(self, step):
        return Decision.STOP if step.index == 3 else Decision.CONTINUE


@pytest.mark.parametrize("rounds", [1, 4])
def test_a_stretch_promised_on_drafts_a_rollback_discards_goes_with_them(rounds):
    """PEARL: the next round is declined on top of a window not yet verified. A rejection in
    that window discards the position the stretch was promised at, so the runner drafts again
    from the new sequence. It used to wait for the stretch's end, which no commit would reach
    (with one round the coordinator waits for drafts: the request stalled, then fell back)."""
    async def run():
        runner, events, executor, task = started(DraftsThenDeclines(rounds))
        for _ in range(3):
            await settle()
            executor.step()  # drafts positions 3, 4, 5
        await settle()
        ends = [(e.start, e.end, e.repeat) for e in events if isinstance(e, WindowEnd)]
        assert ends == [(3, 6, 0), (6, 6, rounds)] and not executor.pending
        runner.commit(Commit(1, (103, 999), num_verified=2, num_strict=1))  # 104 rejected
        await settle()
        assert runner.seq == PROMPT + [103, 999] and runner.plain_until == 0
        assert executor.pending  # drafting from position 5
        task.cancel()

    asyncio.run(run())


def test_a_stretch_is_timed_from_its_second_round():
    """The first round of a stretch paid the round trip to ask this service, which the stretch's
    other rounds skip (the target runs them back to back): only those time a plain stretch. A
    drafted round in between is timed as before."""
    policy = PlainStretches()

    async def run():
        runner, events, executor, task = started(policy, lookahead=1)
        commit_id = 0
        for _ in range(2):  # a stretch of four plain rounds, then a window of one draft
            await settle()
            for _ in range(4):
                commit_id += 1
                runner.commit(Commit(commit_id, (7,), num_verified=0, num_strict=0))
                await settle()
            drafted = await last_window(runner, events, executor)
            assert len(drafted) == 1
            commit_id += 1
            runner.commit(Commit(commit_id, drafted + (7,), num_verified=1, num_strict=1))
        task.cancel()

    asyncio.run(run())
    # stretch 1: its first commit is the session's first (never timed); stretch 2: its first is
    # not timed either, as a stretch's first round
    assert policy.paces == [False, False, False, True, False, False, False, True]


class BranchingSession(FakeSession):
    """Drafts draft_of(position); offers one side branch [7, 8, 9] after any sequence."""

    def branches(self, seq, chain, length, params=None):
        return [[7, 8, 9][:length]]


def test_a_window_grows_into_a_tree_and_a_side_path_is_committed():
    """The window end carries the side nodes; a commit along a side branch longer than the chain
    rolls the drafts back to where the path left the chain and continues after the path."""
    from specd.tree import TreePlanner

    async def run():
        events: list = []
        executor = ManualExecutor()
        runner = DraftRunner(BranchingSession(), build_policy("constant", {"k": 2}, {}), SamplingParams(), PROMPT,
                             max_length=64, lookahead=1, send_q=False, executor=executor, publish=events.append,
                             trees=TreePlanner(1, 3), t_target=lambda n: 1.0)  # a flat curve: every node pays
        task = asyncio.create_task(runner.run())
        for _ in range(2):
            await settle()
            executor.step()
        await settle()
        end = next(e for e in events if isinstance(e, WindowEnd))
        assert (end.start, end.end) == (3, 5)
        assert (end.side_tokens, end.side_parents) == ((7, 8, 9), (-1, 2, 3))  # a branch from the root
        assert runner.draft_seconds > 0  # the lookup counts as drafting
        # The target took the side branch's three nodes, then its own token 10.
        runner.commit(Commit(1, (7, 8, 9, 10), num_verified=2, num_strict=0, side_nodes=3))
        assert events[-1] == Ack(1, 1)  # the chain's drafts were rolled back
        assert runner.rollback_to == 3
        assert runner.seq == [*PROMPT, 7, 8, 9, 10] and runner.committed == 7
        assert runner.windows == []  # judged: its first draft was refused
        assert runner.trees.gain > 0.05  # three side tokens kept: a side node pays more than the prior
        await settle()
        executor.step()
        await settle()
        assert [e.position for e in events if isinstance(e, Token)][-1] == 7  # drafting goes on after the path
        task.cancel()

    asyncio.run(run())


class LookupSession(FakeSession):
    inline = True


def test_a_lookup_drafters_window_is_drafted_on_the_event_loop():
    """A lookup (n-gram, retrieval) costs less than a hop to the compute thread: the whole
    window is drafted on the event loop, the compute thread never asked; a model drafter's steps
    go to it one by one (the other tests)."""
    async def main():
        events: list = []
        executor = ManualExecutor()
        runner = DraftRunner(LookupSession(), build_policy("constant", {"k": 4}, {}), SamplingParams(), PROMPT,
                             max_length=64, lookahead=1, send_q=False, executor=executor, publish=events.append)
        task = asyncio.create_task(runner.run())
        await settle()
        task.cancel()
        return events, executor

    events, executor = asyncio.run(main())
    assert not executor.pending
    assert [e.token for e in events if isinstance(e, Token)] == [draft_of(p) for p in range(3, 7)]
    assert isinstance(events[-1], WindowEnd) and (events[-1].start, events[-1].end) == (3, 7)


def test_the_lookup_drafters_sessions_run_inline_and_a_model_drafters_do_not():
    from specd.drafters.base import ModelDraftSession
    from specd.drafters.ngram import NgramDrafter, RetrievalDrafter

    assert issubclass(RetrievalDrafter, NgramDrafter)  # retrieval's sessions are n-gram sessions
    assert NgramDrafter().open(100).inline
    assert not ModelDraftSession.inline
