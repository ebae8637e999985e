"""`specd up`'s plan of processes: with --dvi the draft learns online and a trainer runs."""

from __future__ import annotations

import pytest

from services.cli import _ephemeral_low, _plan
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


def test_the_default_drafter_is_retrieval_where_a_datastore_ships(tmp_path):
    def draft_flags(*argv):
        flags = {name: flags for name, flags, _ in _plan(_args(*argv))}["draft"]
        return flags[flags.index("--drafter") + 1], "--threads" in flags

    assert draft_flags() == ("retrieval", False)  # the embedded target: no model drafts, no core split
    assert draft_flags("--target-model", str(tmp_path)) == ("ngram", False)  # nothing bundled for it
    assert draft_flags("--drafter", "early-exit") == ("early-exit", True)


def test_a_lookup_drafter_drafts_on_the_target_too():
    def target_drafter(*argv):
        flags = {name: flags for name, flags, _ in _plan(_args(*argv))}["target"]
        return flags[flags.index("--drafter") + 1] if "--drafter" in flags else None

    assert target_drafter() == "retrieval"
    assert target_drafter("--drafter", "ngram") == "ngram"
    assert target_drafter("--drafter", "early-exit") is None  # a model drafts on the draft service
    assert target_drafter("--branches", "2") is None  # draft trees grow on the draft service


def test_every_grpc_link_is_loopback_plaintext_chosen_explicitly():
    """The gRPC services and the gateway (their client) get --insecure true; the trainer has no gRPC."""
    plan = {name: flags for name, flags, _ in _plan(_args("--drafter", "early-exit", "--dvi",
                                                          "--redis-url", "redis://r:6379/0"))}
    for name in ("target", "draft", "coordinator", "gateway"):
        assert plan[name][plan[name].index("--insecure") + 1] == "true", name
    assert "--insecure" not in plan["trainer"]
    addresses = [flags[i + 1] for flags in plan.values() for i, f in enumerate(flags) if f.endswith("-address")]
    assert addresses and all(a.startswith("127.0.0.1:") for a in addresses)
    listed = _plan(_args("--coordinators", "2"))[-1][1]
    assert all(a.startswith("127.0.0.1:") for a in  # a list of coordinators is loopback too
               listed[listed.index("--coordinator-address") + 1].removeprefix("ipv4:").split(","))


def test_several_coordinators_each_get_ports_and_the_gateway_lists_them_all():
    plan = _plan(_args("--coordinators", "3"))
    assert [name for name, _, _ in plan] == ["target", "draft", "coordinator", "coordinator-2", "coordinator-3",
                                             "gateway"]
    coords = [(flags, port) for name, flags, port in plan if name.startswith("coordinator")]
    ports = [port for _, port in coords] + [flags[flags.index("--metrics-port") + 1] for flags, _ in coords]
    assert len(set(ports)) == 6
    gateway = plan[-1][1]
    assert gateway[gateway.index("--coordinator-address") + 1] == \
        "ipv4:" + ",".join(f"127.0.0.1:{port}" for _, port in coords)
    one = _plan(_args())[-1][1]
    assert one[one.index("--coordinator-address") + 1].startswith("127.0.0.1:")  # one: a plain host:port
    with pytest.raises(SpecdError, match="--coordinators"):
        _plan(_args("--coordinators", "0"))


@pytest.mark.parametrize("argv", [["--dvi", "--redis-url", "redis://r"], ["--drafter", "early-exit", "--dvi"]])
def test_dvi_needs_early_exit_and_redis(argv):
    with pytest.raises(SpecdError, match="--dvi needs"):
        _plan(_args(*argv))


SHUTDOWN = r"""
import os, signal, subprocess, sys, threading, time
from services.cli import _interrupt, _stop
child = subprocess.Popen([sys.executable, "-c",
    "import signal, sys, time\n"
    "signal.signal(signal.SIGINT, lambda *a: (time.sleep(1.0), sys.exit(0)))\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)"], stdout=subprocess.PIPE, start_new_session=True)
child.stdout.readline()
print(child.pid, flush=True)
signal.signal(signal.SIGINT, _interrupt)  # as cmd_up installs it
threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()  # a second Ctrl-C mid-shutdown
_stop({"svc": child})
print("stopped", child.returncode, flush=True)
"""


def test_a_second_interrupt_does_not_cut_the_shutdown_short(tmp_path):
    """Before the fix the second SIGINT raised KeyboardInterrupt inside _stop and left the
    service (in a session of its own) running."""
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", SHUTDOWN], capture_output=True, text=True, timeout=60,
                          cwd=os.getcwd(), check=False)
    lines = proc.stdout.split()
    pid = int(lines[0])
    try:
        assert proc.returncode == 0, proc.stderr
        assert lines[1:] == ["stopped", "0"]
    finally:
        try:
            os.kill(pid, 9)
            leaked = True
        except ProcessLookupError:
            leaked = False
    assert not leaked


def test_the_gateway_of_up_is_open_on_loopback():
    """`specd serve gateway` requires an API key by default; `specd up` serves on loopback only,
    without keys, and says so."""
    flags = {name: flags for name, flags, _ in _plan(_args())}["gateway"]
    assert flags[flags.index("--auth") + 1] == "open"


def test_the_hybrid_drafter_and_draft_trees_reach_the_draft_service():
    from services.common.settings import DraftSettings

    flags = {name: flags for name, flags, _ in _plan(_args("--drafter", "hybrid", "--branches", "3"))}["draft"]
    assert flags[flags.index("--drafter") + 1] == "hybrid" and "--threads" in flags  # a model drafter
    assert flags[flags.index("--branches") + 1] == "3"
    assert DraftSettings(drafter="hybrid", branches=3).branches == 3  # the service takes both
    assert "--branches" not in {name: flags for name, flags, _ in _plan(_args())}["draft"]


def test_planned_ports_are_free_and_below_the_ephemeral_range():
    """A port from the kernel's ephemeral range can be taken, while the services before it start,
    as the source port of an outgoing connection; the plan picks every port below it."""
    lo = _ephemeral_low()
    plan = _plan(_args())
    ports = [port for _, _, port in plan] + [int(f[f.index("--metrics-port") + 1]) for _, f, _ in plan
                                             if "--metrics-port" in f]
    assert len(set(ports)) == len(ports) == 7
    assert all(port < lo for port in ports)
