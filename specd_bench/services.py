"""`specd bench-services`: the same configurations through the split services on loopback,
against the in-process engine in the same run (issue "service pair", Measure).

Target and draft run as real `specd serve` processes, each with one torch thread and, where
`taskset` exists, pinned to its own core (target on core 0, draft on core 1). The in-process
engine runs in this process with one thread pinned to core 0 as well, so that the baseline
gets exactly the target's compute. Per prompt, configurations run interleaved (A B C ...,
prompt after prompt) so that drift on a shared machine cancels:

- `ar`: the in-process engine with the target alone (the baseline of every speedup);
- `<policy>`: the in-process engine with the drafter (draft and target share core 0);
- `services/none`: the target alone through the coordinator and target service (the
  split's own overhead);
- `services/<policy>/sequential` and `services/<policy>/pearl`: the draft -> verify loop
  over both services without and with PEARL overlap.

Each service row also reports the coordinator's timeline: seconds it waited with a
verification in flight (`verify_wait_s`) and with only the draft to wait for
(`draft_wait_s`), which says where PEARL could and could not hide work.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specd_bench.cli import DATASET_HELP
from specd.errors import SpecdError


def add_command(sub) -> None:
    b = sub.add_parser("bench-services", help="benchmark the split services (and PEARL) against the "
                                              "in-process engine")
    b.add_argument("--dataset", type=Path, help=DATASET_HELP)
    b.add_argument("--limit", type=int, default=5)
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--drafter", default="ngram", help="ngram | retrieval | early-exit")
    b.add_argument("--policies", default="constant,cost-aware", help="comma list")
    b.add_argument("--target-model", default="embedded")
    b.add_argument("--no-pin", action="store_true", help="do not pin target and draft to their own cores")
    b.add_argument("--out", type=Path, default=Path("bench-services-out"))
    b.set_defaults(func=cmd_bench_services)


def _pin(core: int | None) -> list[str]:
    return ["taskset", "-c", str(core)] if core is not None and shutil.which("taskset") else []


def _start(name: str, flags: list[str], core: int | None, log_dir: Path) -> tuple[subprocess.Popen, str]:
    from services.cli import _healthy, free_port

    port = free_port()
    log = open(log_dir / f"{name}.log", "w")  # noqa: SIM115 - lives as long as the child
    proc = subprocess.Popen([*_pin(core), sys.executable, "-m", "specd", "serve", name, "--port", str(port),
                             "--threads", "1", *flags], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while not _healthy(name, port):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SpecdError(f"{name} did not start; see {log_dir / (name + '.log')}")
        time.sleep(0.3)
    return proc, f"127.0.0.1:{port}"


def cmd_bench_services(args) -> int:
    import torch

    from specd_bench.datasets import dataset_label, load_questions
    from specd.drafters import build_drafter
    from specd.engine import SpeculativeEngine
    from specd.runtime import load_model

    pin = not args.no_pin and (os.cpu_count() or 1) >= 2
    log_dir = Path(tempfile.mkdtemp(prefix="specd-bench-services-"))
    torch.set_num_threads(1)
    target = load_model(args.target_model, "cpu", "float32")
    drafter = build_drafter(args.drafter, target)  # retrieval: the bundled datastore, as the service's
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    prompts = [target.encode_prompt(q.turns[0], chat=True) for q in load_questions(args.dataset, args.limit)]
    procs = []
    try:
        tproc, taddr = _start("target", ["--model", args.target_model], 0 if pin else None, log_dir)
        procs.append(tproc)
        dproc, daddr = _start("draft", ["--drafter", args.drafter, "--target-model", args.target_model],
                              1 if pin else None, log_dir)
        procs.append(dproc)
        engine = SpeculativeEngine(target, drafter)
        _measure_costs(engine, policies, pin)
        rows = asyncio.run(_run(engine, taddr, daddr, prompts, policies, args.max_new_tokens, pin))
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
    doc = {"command": " ".join(["specd", *sys.argv[1:]]), "pinned": pin, "drafter": drafter.name, "target": target.name,
           "dataset": dataset_label(args.dataset), "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
           "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(doc, indent=1))
    (args.out / "report.md").write_text(_report(doc))
    print(_report(doc))
    return 0


def _measure_costs(engine, policies: list[str], pin: bool) -> None:
    """Measure the pair's cost curve before the timed runs where a policy prices windows on it
    (on the target's core, as the in-process runs): measured on first use, it would land in the
    first cost-aware run's wall time (about 5 s on the embedded pair)."""
    from specd.policies import policy_class

    if not any(policy_class(p).needs_costs for p in policies):
        return
    with _on_target_core(pin):
        engine.costs  # noqa: B018 - the property measures the curve


@contextlib.contextmanager
def _on_target_core(pin: bool):
    """Run this process on core 0 (the target service's) meanwhile, where pinning is on."""
    if pin:
        os.sched_setaffinity(0, {0})
    try:
        yield
    finally:
        if pin:
            os.sched_setaffinity(0, set(range(os.cpu_count())))


async def _run(engine, taddr: str, daddr: str, prompts: list[list[int]], policies: list[str],
               max_new_tokens: int, pin: bool) -> dict:
    from services.common.state import AsyncMemoryStateStore
    from services.coordinator.coordinator import Coordinator, CoordinatorConfig
    from specd.types import SamplingParams, SpecParams

    coord = Coordinator(CoordinatorConfig(taddr, daddr), AsyncMemoryStateStore())
    await coord.connect()
    configs = [("ar", None, None), *((p, p, None) for p in policies), ("services/none", "none", False),
               *((f"services/{p}/{mode}", p, mode == "pearl") for p in policies for mode in ("sequential", "pearl"))]
    rows: dict[str, dict] = {name: {"tokens": 0, "seconds": 0.0, "per_prompt": [], "draft_wait_s": 0.0,
                                    "verify_wait_s": 0.0, "identical": True} for name, _, _ in configs}
    sampling = SamplingParams(max_new_tokens=max_new_tokens)
    for i, prompt in enumerate(prompts):
        reference = None
        for name, policy, overlap in configs:
            if overlap is None:  # in-process, on the target's core
                with _on_target_core(pin):
                    t0 = time.perf_counter()
                    out = engine.generate(prompt, sampling, SpecParams(policy or "none"))
                    seconds, ids, stats = time.perf_counter() - t0, out.token_ids, {}
            else:
                seconds, ids, stats = await _through_services(coord, prompt, sampling, policy, overlap)
            reference = ids if reference is None else reference
            row = rows[name]
            row["tokens"] += len(ids)
            row["seconds"] += seconds
            row["per_prompt"].append(len(ids) / seconds)
            row["identical"] &= ids == reference
            row["draft_wait_s"] += stats.get("draft_wait_s", 0.0)
            row["verify_wait_s"] += stats.get("verify_wait_s", 0.0)
        print(f"prompt {i + 1}/{len(prompts)} done", file=sys.stderr, flush=True)
    await coord.close()
    base = rows["ar"]["per_prompt"]
    for row in rows.values():
        row["tokens_per_s"] = round(row["tokens"] / row["seconds"], 2)
        row["median_speedup"] = round(statistics.median(t / b for t, b in zip(row["per_prompt"], base)), 3)
        row["draft_wait_s"], row["verify_wait_s"] = round(row["draft_wait_s"], 2), round(row["verify_wait_s"], 2)
        row["per_prompt"] = [round(x, 2) for x in row["per_prompt"]]
    return rows


async def _through_services(coord, prompt, sampling, policy, overlap) -> tuple[float, list[int], dict]:
    from services.coordinator.api import FinishEvent, GenerateRequest
    from specd.types import SpecParams

    request = GenerateRequest(prompt_ids=tuple(prompt), sampling=sampling, spec=SpecParams(policy), overlap=overlap)
    ids, stats = [], {}
    t0 = time.perf_counter()
    async for ev in coord.generate(request):
        if isinstance(ev, FinishEvent):
            stats = ev.spec_stats
        else:
            ids += ev.token_ids
    return time.perf_counter() - t0, ids, stats


def _report(doc: dict) -> str:
    lines = [f"# bench-services: {doc['drafter']} drafting for {doc['target']}",
             f"{doc['prompts']} prompts of {doc.get('dataset', 'the dataset')} x {doc['max_new_tokens']} tokens, greedy; target and draft pinned to "
             f"their own cores: {doc['pinned']}. Speedup: median over prompts of tok/s over `ar` (in-process "
             "target alone, one thread on the target's core) in the same run.", "",
             "| configuration | tok/s | median speedup | identical to ar | waited on draft (s) | "
             "waited on verify (s) |", "|---|---|---|---|---|---|"]
    for name, r in doc["rows"].items():
        lines.append(f"| {name} | {r['tokens_per_s']} | {r['median_speedup']}x | {r['identical']} | "
                     f"{r['draft_wait_s']} | {r['verify_wait_s']} |")
    return "\n".join(lines) + "\n"
