"""The one pace clock every driver times its rounds with."""

from specd.speculation.pace import PaceClock


class Recorder:
    def __init__(self):
        self.seen = []

    def observe_pace(self, tokens, seconds, drafted):
        self.seen.append((tokens, round(seconds, 6), drafted))


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_commit_to_commit_and_the_first_commit_untimed():
    policy, clock = Recorder(), Clock()
    pace = PaceClock(policy, clock)
    clock.now = 1.0
    pace.commit(3, True)  # waited for the prefill too
    clock.now = 1.5
    pace.commit(2, False)
    clock.now = 1.75
    pace.commit(4, True, timed=False)  # not observed, but the next round is timed from it
    clock.now = 2.0
    pace.commit(1, True)
    assert policy.seen == [(2, 0.5, False), (1, 0.25, True)]


def test_a_marked_start_leaves_the_callers_time_between_rounds_out():
    policy, clock = Recorder(), Clock()
    pace = PaceClock(policy, clock)
    pace.start()
    clock.now = 1.0
    pace.commit(1, True)
    clock.now = 3.0  # the caller held the generator for 2 s
    pace.start()
    clock.now = 3.25
    pace.commit(2, True)
    assert policy.seen == [(2, 0.25, True)]


def test_no_policy_keeps_no_observations():
    pace = PaceClock(None)
    pace.commit(1, True)
    pace.commit(1, True)  # nothing to tell, nothing raised


def test_the_target_alone_reads_no_clock():
    def clock():
        raise AssertionError("read the clock with no policy to tell")

    pace = PaceClock(None, clock)
    pace.start()
    pace.commit(1, True)
