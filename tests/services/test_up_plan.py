"""`specd up`'s plan of processes: with --dvi the draft learns online and a trainer runs."""

from __future__ import annotations

import pytest

from services.cli import _plan
from specd.cli import build_parser
from specd.errors import SpecdError


def _args(*argv):
    return build_parser().parse_args(["up", *argv])


def test_dvi_adds_a_trainer_and_the_draft_logs_to_the_same_redis():
    plan = {name: flags for name, flags, _ in _plan(_args("--drafter", "early-exit", "--dvi",
                                                          "--redis-url", "redis://r:6379/0"))}
    assert list(plan) == ["target", "draft", "trainer", "coordinator", "gateway"]
    draft = plan["draft"]
    assert draft[draft.index("--dvi") + 1] == "true" and draft[draft.index("--redis-url") + 1] == "redis://r:6379/0"
    assert plan["trainer"][plan["trainer"].index("--redis-url") + 1] == "redis://r:6379/0"
    assert "trainer" not in {name for name, _, _ in _plan(_args())}


@pytest.mark.parametrize("argv", [["--dvi", "--redis-url", "redis://r"], ["--drafter", "early-exit", "--dvi"]])
def test_dvi_needs_early_exit_and_redis(argv):
    with pytest.raises(SpecdError, match="--dvi needs"):
        _plan(_args(*argv))
