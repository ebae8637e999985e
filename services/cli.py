"""`specd serve draft|target|coordinator|gateway|trainer` and `specd up`.

Flags of `serve` are generated from each service's settings class (services.common.settings),
so a flag, its SPECD_* environment variable and its validation can never disagree; a flag
given on the command line wins over the environment.

`specd up` starts all four services on free loopback ports with the embedded defaults,
waits until every health check passes, prints the gateway URL and an example curl, answers
one sample request, and shuts everything down on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pydantic import ValidationError

from services.common.settings import (
    CoordinatorSettings,
    DraftSettings,
    GatewaySettings,
    TargetSettings,
    TrainerSettings,
)
from services.common.state import has_password
from specd.errors import SpecdError

SERVICES = {"draft": DraftSettings, "target": TargetSettings, "coordinator": CoordinatorSettings,
            "gateway": GatewaySettings, "trainer": TrainerSettings}


def add_commands(sub) -> None:
    serve = sub.add_parser("serve", help="run one service: draft, target, coordinator, gateway or trainer (DVI)")
    which = serve.add_subparsers(dest="service", required=True, parser_class=type(serve))
    for name, settings in SERVICES.items():
        p = which.add_parser(name, help=(settings.__doc__ or f"the {name} service").splitlines()[0],
                             description=f"Settings also come from SPECD_{name.upper()}_* environment variables.")
        for field, info in settings.model_fields.items():
            p.add_argument(f"--{field.replace('_', '-')}", dest=field, default=None, metavar="VALUE",
                           help=f"{info.description or ''} (default: {info.default!r})")
        p.set_defaults(func=cmd_serve)
    up = sub.add_parser("up", help="start draft, target, coordinator and gateway on this machine")
    up.add_argument("--port", type=int, default=8000, help="gateway port (default 8000; 0 = any free port)")
    up.add_argument("--drafter", help="retrieval | ngram | early-exit | hybrid | hf (default: retrieval where "
                                      "specd ships a datastore for the target, the embedded one, else ngram)")
    up.add_argument("--branches", type=int, help="side branches verified beside each drafted chain as a draft "
                                                 "tree (ngram, retrieval, hybrid; default: the drafter's, "
                                                 "hybrid 2, the others 0)")
    up.add_argument("--draft-model", help="transformers directory for --drafter hf")
    up.add_argument("--target-model", default="embedded", help="'embedded' or a transformers directory")
    up.add_argument("--policy", default="cost-aware", help="default stopping policy of requests")
    up.add_argument("--no-overlap", action="store_true", help="turn PEARL overlap off")
    up.add_argument("--coordinators", type=int, default=1, help="coordinator processes; the gateway's requests "
                                                                "take turns among them (default 1)")
    up.add_argument("--redis-url", help="Redis for shared policy state (default: in-process memory)")
    up.add_argument("--dvi", action="store_true", help="online learning (DVI): the early-exit draft logs its "
                                                      "verified drafts to Redis and a trainer process improves "
                                                      "it while serving (needs --redis-url)")
    up.add_argument("--no-sample", action="store_true", help="do not send the sample request")
    up.add_argument("--exit-after-sample", action="store_true", help="stop once the sample is answered")
    up.add_argument("--log-dir", type=Path, help="service logs (default: a temporary directory)")
    up.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for health checks")
    up.set_defaults(func=cmd_up)
    from services.gateway.keys_cli import add_command as add_keys_command

    add_keys_command(sub)


# Settings that hold a secret, and the environment variable that carries each instead of argv.
SECRET_SETTINGS = {"auth_token": "SPECD_AUTH_TOKEN", "api_keys": "SPECD_GATEWAY_API_KEYS",
                   "redis_url": "SPECD_REDIS_URL"}


def secret_from_argv(field: str, value: str) -> str:
    """A secret setting's command-line value: `@PATH` reads it from a file; a secret written out
    is refused, since every user of the machine can read a process's argv (ps, /proc). A Redis
    URL is a secret only when it holds a password."""
    flag = "--" + field.replace("_", "-")
    if value.startswith("@"):
        try:
            return Path(value[1:]).read_text().strip()
        except OSError as e:
            raise SpecdError(f"{flag}: cannot read {value[1:]}: {e.strerror}") from None
    if field == "redis_url" and not has_password(value):
        return value
    raise SpecdError(f"{flag}: a secret on the command line is visible to every user of this machine; "
                     f"set {SECRET_SETTINGS[field]} or pass {flag} @FILE")


def _settings(name: str, args: argparse.Namespace):
    cls = SERVICES[name]
    given = {f: getattr(args, f) for f in cls.model_fields if getattr(args, f, None) is not None}
    given.update({f: secret_from_argv(f, v) for f, v in given.items() if f in SECRET_SETTINGS})
    try:
        return cls(**given)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"]) or "settings"
        raise SpecdError(f"{name} setting {field}: {err['msg']}") from None


def _check_security(settings) -> None:
    """gRPC security settings that cannot work fail at once, before a model loads (SecurityError)."""
    from services.common.security import GrpcSecurity
    from services.common.settings import GrpcServiceSettings, SecurityFields

    if isinstance(settings, SecurityFields):
        security = GrpcSecurity.from_settings(settings)
        if isinstance(settings, GrpcServiceSettings):
            security.check_listen(settings.host, quiet=True)


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    settings = _settings(args.service, args)
    _check_security(settings)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.service == "draft":
        from services.draft.main import serve
    elif args.service == "target":
        from services.target.main import serve
    elif args.service == "coordinator":
        from services.coordinator.main import serve
    elif args.service == "trainer":
        from services.trainer.main import serve
    else:
        from services.gateway.main import serve
    try:
        asyncio.run(serve(settings))
    except KeyboardInterrupt:
        pass
    return 0


# -- specd up ---------------------------------------------------------------------------------
LOWEST_PORT = 10000  # where free_port starts looking
_given: set[int] = set()  # ports free_port handed out in this process: never twice


def _ephemeral_low() -> int:
    """The lowest port the kernel takes outgoing connections' source ports from (Linux's
    default where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range. A port from that range (bind to
    port 0) was free when planned but could be handed out, while the services before it started,
    as the source port of an outgoing connection (their own gRPC links, a client's), and the
    service planned on it then failed to bind (seen once in bench-load; a gRPC server, which
    shares a port, answered for another instead in a test). Never the same port twice in one
    process."""
    lo = _ephemeral_low()
    for _ in range(100):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", random.randrange(LOWEST_PORT, lo) if lo > LOWEST_PORT + 100 else 0))
            except OSError:
                continue
            port = s.getsockname()[1]
        if port not in _given:
            _given.add(port)
            return port
    raise SpecdError("no free loopback port below the ephemeral range")


def _plan(args) -> list[tuple[str, list[str], int]]:
    """(name, flags, port) of each service, in start order; the gRPC services also get a free
    metrics port (the gateway serves /metrics on its own port). Every gRPC link is on loopback
    and plaintext, chosen explicitly with --insecure true."""
    if args.coordinators < 1:
        raise SpecdError("--coordinators: at least 1")
    draft, target = free_port(), free_port()
    coords = [free_port() for _ in range(args.coordinators)]
    gateway = args.port or free_port()
    cpus = os.cpu_count() or 2
    from specd.drafters import MODEL_FREE, default_drafter
    from specd.runtime.loading import model_name

    drafter = args.drafter or default_drafter(model_name(args.target_model))
    draft_flags = ["--drafter", drafter, "--target-model", args.target_model]
    if args.draft_model:
        draft_flags += ["--draft-model", args.draft_model]
    if args.branches is not None:
        draft_flags += ["--branches", str(args.branches)]
    if drafter not in MODEL_FREE:  # two models on one CPU: split the cores
        draft_flags += ["--threads", str(max(1, cpus // 4))]
    redis = ["--redis-url", args.redis_url] if args.redis_url else []
    trainer = []
    if args.dvi:
        if drafter != "early-exit" or not args.redis_url:
            raise SpecdError("--dvi needs --drafter early-exit and --redis-url (the replay stream lives in Redis)")
        draft_flags += ["--dvi", "true", *redis]
        trainer = [("trainer", ["--target-model", args.target_model, "--threads", str(max(1, cpus // 4)), *redis],
                    free_port())]
    plaintext = ["--insecure", "true"]
    # A lookup drafter drafts on the target itself, with no round trip per round, unless draft
    # trees are asked for: those only the draft service grows. docs/services.md, "Drafting on the target".
    target_drafts = ["--drafter", drafter] if drafter in MODEL_FREE and not args.branches else []
    return [
        ("target", ["--model", args.target_model, *target_drafts, "--metrics-port", str(free_port()), *plaintext],
         target),
        ("draft", [*draft_flags, "--metrics-port", str(free_port()), *plaintext], draft),
        *trainer,
        *[(f"coordinator-{i + 1}" if i else "coordinator",
           ["--target-address", f"127.0.0.1:{target}", "--draft-address", f"127.0.0.1:{draft}",
            "--overlap", str(not args.no_overlap), "--default-policy", args.policy, *redis,
            "--metrics-port", str(free_port()), *plaintext], port) for i, port in enumerate(coords)],
        # Several coordinators: one address list, whose calls take turns (services.common.server).
        ("gateway", ["--coordinator-address", coordinator_address(coords), "--default-policy", args.policy,
                     "--auth", "open", *plaintext], gateway),  # loopback only: no API key (_announce says so)
    ]


def coordinator_address(ports: list[int]) -> str:
    addresses = ",".join(f"127.0.0.1:{p}" for p in ports)
    return f"ipv4:{addresses}" if len(ports) > 1 else addresses


def role(name: str) -> str:
    """The service a planned process runs ("coordinator-2": a coordinator)."""
    return name.split("-")[0]


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def cmd_up(args: argparse.Namespace) -> int:
    # Ctrl-C and `kill` both stop every service, even when started with SIGINT ignored (`cmd &`).
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="specd-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    procs: dict[str, subprocess.Popen] = {}
    plan = _plan(args)
    try:
        start_stack(plan, procs, log_dir, args.startup_timeout)
        url = f"http://127.0.0.1:{plan[-1][2]}"
        _announce(url, plan)
        if not args.no_sample:
            _sample(url)
        if args.exit_after_sample:
            return 0
        print("\nspecd is up. Ctrl-C stops every service.", flush=True)
        while all(p.poll() is None for p in procs.values()):
            time.sleep(0.5)
        dead = [n for n, p in procs.items() if p.poll() is not None]
        raise SpecdError(f"{', '.join(dead)} stopped; see {log_dir}")
    except KeyboardInterrupt:
        print("\nshutting down", flush=True)
        return 0
    finally:
        _stop(procs)


def start_stack(plan: list[tuple[str, list[str], int]], procs: dict[str, subprocess.Popen], log_dir: Path,
                timeout_s: float) -> None:
    """Start each planned service as its own `specd serve` process, in order, each once the one
    before passes its health check; procs fills as they start (the caller stops them, _stop)."""
    for name, flags, port in plan:
        flags, env = _secrets_to_env(flags)
        log = open(log_dir / f"{name}.log", "w")  # noqa: SIM115 - lives as long as the child
        procs[name] = subprocess.Popen([sys.executable, "-m", "specd", "serve", role(name), "--port", str(port),
                                        *flags],
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        print(f"starting {name} on 127.0.0.1:{port} (log: {log_dir / f'{name}.log'})", flush=True)
        _wait_healthy(name, port, procs, log_dir, timeout_s)


def _secrets_to_env(flags: list[str]) -> tuple[list[str], dict[str, str]]:
    """flags without the secret settings' (a Redis URL may hold a password), and the environment
    that carries those to the child instead, out of its argv."""
    env, kept, i = dict(os.environ), [], 0
    by_flag = {"--" + f.replace("_", "-"): var for f, var in SECRET_SETTINGS.items()}
    while i < len(flags):
        if flags[i] in by_flag and i + 1 < len(flags):
            env[by_flag[flags[i]]] = flags[i + 1]
            i += 2
        else:
            kept.append(flags[i])
            i += 1
    return kept, env


def _wait_healthy(name: str, port: int, procs, log_dir: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if procs[name].poll() is not None:
            tail = (log_dir / f"{name}.log").read_text()[-2000:]
            raise SpecdError(f"{name} exited with status {procs[name].returncode}:\n{tail}")
        if _healthy(name, port):
            return
        time.sleep(0.3)
    raise SpecdError(f"{name} did not pass its health check within {timeout_s:.0f} s; see {log_dir}")


def _healthy(name: str, port: int) -> bool:
    if role(name) in ("gateway", "trainer"):  # HTTP: the gateway's health route, the trainer's /metrics
        import httpx

        path = "/health" if name == "gateway" else "/metrics"
        try:
            return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False
    from services.common.server import check_health

    return asyncio.run(check_health(f"127.0.0.1:{port}"))


def _announce(url: str, plan: list[tuple[str, list[str], int]]) -> None:
    body = json.dumps({"model": "specd", "messages": [{"role": "user", "content": "Say hello."}],
                       "max_tokens": 48, "speculative": {"policy": "heuristic"}})
    metrics = [f"{url}/metrics"] + [f"http://127.0.0.1:{flags[flags.index('--metrics-port') + 1]}/metrics"
                                     for _, flags, _ in plan if "--metrics-port" in flags]
    metrics += [f"http://127.0.0.1:{port}/metrics" for name, _, port in plan if name == "trainer"]
    print(f"\nspecd gateway: {url}/v1  (OpenAI-compatible; docs at {url}/docs)\n"
          "The API is open on loopback: no API key is needed (`specd serve gateway` requires one).\n"
          f"Prometheus metrics: {' '.join(metrics)}\n\nTry:\n"
          f"  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n    -d '{body}'\n",
          flush=True)


def _sample(url: str) -> None:
    import httpx

    question = "Explain speculative decoding in two sentences."
    reply = httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
        "model": "specd", "messages": [{"role": "user", "content": question}], "max_tokens": 96,
        "temperature": 0})
    reply.raise_for_status()
    doc = reply.json()
    s = doc.get("spec_stats", {})
    print(f"sample request: {question}\n\n{doc['choices'][0]['message']['content']}\n\n"
          f"[{doc['usage']['completion_tokens']} tokens, {s.get('tokens_per_s')} tok/s | policy {s.get('policy')}, "
          f"drafter {s.get('drafter')} | accepted {s.get('accepted')}/{s.get('drafted')} drafted, "
          f"{s.get('verifications')} verifications, overlap {s.get('overlap')}, fallback {s.get('fallback')}]",
          flush=True)


def _stop(procs: dict[str, subprocess.Popen]) -> None:
    # A second Ctrl-C (or a SIGINT and a SIGTERM from a supervisor) must not cut the shutdown
    # short: the services run in sessions of their own and would be left running.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for p in reversed(list(procs.values())):
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 10
    for p in procs.values():
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
