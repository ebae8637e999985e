"""The benchmark loop: load the models, run every configuration on every prompt, interleaved
per prompt (baseline, config A, config B, ... for one prompt, then the next; all of it
`repeats` times) so that slow drift of the machine cancels out of the speedup ratios. Each run
also records how much of the CPUs other processes took meanwhile (specd_bench.contention), so
that a burst of foreign work is flagged instead of skewing the ratios unseen.

A configuration that cannot run a prompt (it raises: a peer, specd's own, or the baseline `ar`)
gets a failed record for it, saying why (the exception's type and message), and the run goes on
with the other configurations and prompts: its row is over the prompts it ran and counts the ones
it could not, and its ratios are over the prompts where both it and `ar` ran (specd_bench.metrics).
The same holds for the oracle's per-prompt bounds. Only Exception is caught: KeyboardInterrupt
and SystemExit still end the run. Where specd's own code fails on something other than a
SpecdError (one it raises on purpose, e.g. a prompt past the target's context), the traceback is
written to stderr too: that is likely a bug.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from dataclasses import dataclass, field

from tqdm import tqdm

from specd_bench import oracle as orc
from specd_bench.configs import BASELINE, ORACLE_SKIP, BenchSettings, Config, build_configs
from specd_bench.contention import CpuShare
from specd_bench.datasets import BenchPrompt, bench_prompts, load_questions, messages
from specd_bench.llama_cpp import LLAMA_PEERS
from specd_bench.metrics import failed, failed_record, peer_record, run_record
from specd_bench.peers import PeerRunner, early_exit_assistant, skip_reason
from specd.costs import CostCurve
from specd.drafters import build_drafter
from specd.engine import SpeculativeEngine
from specd.errors import InvalidRequest, SpecdError
from specd.policies import NO_SPECULATION, OraclePolicy, policy_class
from specd.state import MemoryStateStore
from specd.types import SamplingParams, SpecParams


@dataclass
class Models:
    target: object
    draft_model: object | None
    drafters: dict  # kind -> Drafter
    heads: dict = field(default_factory=dict)  # kind -> specdec++ head module


def load_models(s: BenchSettings) -> Models:
    from specd.runtime import load_model

    target = load_model(s.target_model, s.device, s.dtype, s.cache_dir, s.linear_kernels, s.forward, s.cuda_graphs,
                        cpu_compile=s.cpu_compile)
    draft_model = (load_model(s.draft_model, s.device, s.dtype, s.cache_dir, s.linear_kernels, s.forward,
                              s.cuda_graphs)
                   if s.draft_model else None)
    drafters = {d: build_drafter(d, target, draft_model, s.draft_layers, s.draft_adapter, s.datastore)
                for d in s.drafters}
    if draft_model is None and "early-exit" in drafters:
        draft_model = early_exit_assistant(drafters["early-exit"])  # the peers' assistant
    return Models(target, draft_model, drafters, _heads(drafters, target))


def _heads(drafters: dict, target) -> dict:
    """The bundled SpecDec++ head of each drafter that has one (kind -> head)."""
    from specd.policies import AcceptanceHead, bundled_head_path

    paths = {kind: bundled_head_path(d.name) for kind, d in drafters.items()}
    return {kind: AcceptanceHead.load(p).to(target.device) for kind, p in paths.items() if p is not None}


class BenchRun:
    """One benchmark: prompts x configurations x repeats, plus the oracle's measurements."""

    def __init__(self, s: BenchSettings, models: Models):
        self.s, self.m = s, models
        self.sampling = SamplingParams(s.temperature, 0, 1.0, s.seed, s.max_new_tokens)
        self.sampling.validate(max_new_tokens_limit=models.target.max_context)
        self.prompts = bench_prompts(load_questions(s.dataset, s.limit, s.offset), s.turn)
        peer_skips = {p: skip_reason(p, models.draft_model, models.target) for p in s.baselines if p != BASELINE}
        self.configs = build_configs(s, {d: d in models.heads for d in s.drafters}, peer_skips)
        self.engines = {None: SpeculativeEngine(models.target)}
        for kind, drafter in models.drafters.items():
            # A drafter that fails fails the run: the target alone is not the configuration's speed.
            self.engines[kind] = SpeculativeEngine(models.target, drafter, specdecpp_head=models.heads.get(kind),
                                                   fallback=False)
        self.peers = PeerRunner(models.target, models.draft_model, s.cache_dir)
        self.prompt_ids: dict[str, list[int]] = {}
        self.prompt_failures: dict[str, str] = {}  # prompt key -> why it could not be built (no run on it)
        self.records: dict[str, list[dict]] = {c.label: [] for c in self.configs if not c.skip}
        self.baseline_ids: dict[tuple[int, str], list[int] | None] = {}  # (repeat, prompt key) -> tokens; None: failed
        # The curve the policies decided on (cost-aware, draft trees), per drafter: as measured at
        # start-up and as the rounds left it (t_draft and the level follow what they observed).
        self.policy_curves: dict[str, dict[str, dict]] = {}

    # -- prompts ----------------------------------------------------------------------------
    def encode_prompts(self) -> None:
        """Token ids of every prompt; a second turn first needs the target's own first answer.
        A second turn whose first answer cannot be generated has no prompt: every configuration
        gets a failed record for it, saying why (run_all)."""
        target, answers = self.m.target, {}
        for p in self.prompts:
            if p.turn == 2 and p.qid not in answers:
                first = target.encode_prompt(messages(BenchPrompt(p.qid, 1, p.question), None), True)
                try:
                    answers[p.qid] = self.engines[None].generate(first, self.sampling, SpecParams("none")).text
                except Exception as e:  # noqa: BLE001  (recorded, see run_guarded)
                    answers[p.qid] = e
            if p.turn == 2 and isinstance(answers[p.qid], Exception):
                reason = "the first turn's answer: " + failed_record(answers[p.qid])["failed"]
                self.prompt_failures[p.key] = reason
                tqdm.write(f"warning: no prompt for {p.key}: {reason}; every configuration fails it", file=sys.stderr)
                continue
            self.prompt_ids[p.key] = target.encode_prompt(messages(p, answers.get(p.qid)), True)

    # -- runs -------------------------------------------------------------------------------
    def run_one(self, c: Config, prompt: list[int], reference: list[int] | None) -> tuple[dict, list[int]]:
        if c.kind == "peer":
            ids, wall = self.peers.generate(c.label, prompt, self.sampling)
            return peer_record(ids, wall, reference if self.s.greedy else None), ids
        if c.policy == "oracle" and reference is None:
            raise InvalidRequest("oracle", f"no `{BASELINE}` output on this prompt to follow")
        spec = SpecParams(c.policy, None, dict(c.policy_params), task_tag="bench", branches=c.branches)
        ref = reference if c.policy == "oracle" else None
        engine = self.engines[c.drafter]
        if self.s.cold_start:  # as a fresh process: nothing learned on earlier runs
            engine.state_store = MemoryStateStore()
            start = self.policy_curves.get(c.drafter, {}).get("start")
            if start is not None:
                engine.costs = CostCurve.from_dict(start)
        out = engine.generate(prompt, self.sampling, spec, ref, overlap=c.overlap)
        # Greedy and seeded (coupled) output must be the target alone's, token for token.
        check = reference if (self.s.reproducible and c.label != BASELINE) else None
        return run_record(out.stats, out.token_ids, check), out.token_ids

    def run_guarded(self, c: Config, prompt: list[int], reference: list[int] | None,
                    key: str) -> tuple[dict, list[int] | None]:
        """A configuration's run, or, where it raises, a failed record saying why (the
        exception's type and message) and no tokens: a configuration that cannot run one prompt
        loses that run only. The one place any run is caught (module docstring)."""
        try:
            return self.run_one(c, prompt, reference)
        except Exception as e:  # noqa: BLE001  (whatever a peer's library or a model raises)
            return _failed(f"{c.label} failed on {key}", e, c.kind == "engine"), None

    def warm_up(self) -> None:
        """One short untimed run per engine (fresh state stores), so no config pays first-call
        costs, on the first prompt the target can run. A failure here recurs in the timed runs
        and is recorded there."""
        short = SamplingParams(self.s.temperature, 0, 1.0, self.s.seed, min(8, self.s.max_new_tokens))
        for prompt in (self.prompt_ids[p.key] for p in self.prompts if p.key in self.prompt_ids):
            try:
                SpeculativeEngine(self.m.target).generate(prompt, short, SpecParams("none"))
            except Exception:  # noqa: BLE001, S112  (this prompt cannot run: the next one warms up)
                continue
            for drafter in self.m.drafters.values():
                with contextlib.suppress(Exception):
                    SpeculativeEngine(self.m.target, drafter).generate(prompt, short, SpecParams("constant"))
            for c in self.configs:  # llama.cpp loads its model and spins up its threads
                if c.kind == "peer" and not c.skip and c.label in LLAMA_PEERS:
                    with contextlib.suppress(Exception):
                        self.peers.generate(c.label, prompt, short)
            break
        for c in self.configs:  # the start-up cost-curve measurement, before any timed run
            # (draft trees size themselves on the curve, whatever the policy)
            trees = c.branches if c.branches is not None else c.drafter and self.m.drafters[c.drafter].branches
            if not c.skip and c.policy != NO_SPECULATION and (policy_class(c.policy).needs_costs or trees):
                self.policy_curves.setdefault(c.drafter, {"start": self.engines[c.drafter].costs.to_dict()})

    def run_all(self, progress: bool = True) -> None:
        active = [c for c in self.configs if not c.skip]
        total = self.s.repeats * len(self.prompts) * len(active)
        with tqdm(total=total, desc="bench", file=sys.stderr, disable=not progress) as bar:
            for rep in range(self.s.repeats):
                for p in self.prompts:
                    ids = self.prompt_ids.get(p.key)
                    reference = None
                    for c in active:  # the baseline is first
                        bar.set_postfix_str(f"{p.key} {c.label}")
                        with CpuShare() as share:  # a run that raises gets a failed record (run_guarded)
                            record, tokens = (self.run_guarded(c, ids, reference, p.key) if ids is not None
                                              else ({"failed": self.prompt_failures[p.key]}, None))
                        if c.label == BASELINE:
                            reference = tokens
                            self.baseline_ids[(rep, p.key)] = tokens
                        self.records[c.label].append({"prompt": p.key, "repeat": rep, **record, **share.record()})
                        bar.update()
        for kind, curves in self.policy_curves.items():
            curves["end"] = self.engines[kind].costs.to_dict()

    # -- oracle -----------------------------------------------------------------------------
    def oracle(self) -> dict:
        """Cost curve and, for greedy and seeded runs, the oracle bound of every model drafter,
        over the prompts `ar` ran (its output is what the oracle drafts); a prompt whose bound
        raises is listed in its drafter's `failed_prompts`, and a measurement that raises leaves
        the oracle {"failed": why}: the run's results are kept either way."""
        if not self.s.reproducible:
            return {"skipped": ORACLE_SKIP}
        ran = [p for p in self.prompts if self.baseline_ids.get((0, p.key)) is not None]
        if not ran:
            return {"skipped": f"`{BASELINE}` ran no prompt: the oracle has no output to draft"}
        try:
            return self._oracle(ran)
        except Exception as e:  # noqa: BLE001  (see run_guarded)
            return _failed("the oracle bound failed", e, True)

    def _oracle(self, ran: list[BenchPrompt]) -> dict:
        first = ran[0].key
        prefix = self.prompt_ids[first] + self.baseline_ids[(0, first)]
        ks, ts, _ = orc.measure_t_target(self.m.target, prefix)
        window = OraclePolicy.Params().max_draft_tokens
        result = {"window": window, "t_target": {"k": ks, "t_target_s": ts}, "drafters": {}}
        prefill = {p.key: orc.measure_prefill(self.m.target, self.prompt_ids[p.key]) for p in ran}
        for kind, drafter in self.m.drafters.items():
            curve = orc.CostCurve(orc.measure_t_draft(drafter, prefix), ks, ts)
            entry = {"cost_curve": curve.to_dict()}
            if drafter.has_distribution:
                entry["per_prompt"], failures = [], []
                for p in ran:
                    try:
                        entry["per_prompt"].append(self._bound(drafter, p, curve, window, prefill[p.key]))
                    except Exception as e:  # noqa: BLE001  (see run_guarded)
                        failures.append({"prompt": p.key, **_failed(f"the {kind} oracle bound failed on {p.key}", e,
                                                                    True)})
                if failures:
                    entry["failed_prompts"] = failures
                if drafter.branches:
                    entry["note"] = ("chain and side branches: each round keeps the longer of the model's "
                                     f"run and the best of {drafter.branches} side branches; "
                                     "side nodes cost nothing")
            else:
                entry["note"] = f"measured by running the oracle policy through the engine (config {kind}/oracle)"
            result["drafters"][kind] = entry
        return result

    def _bound(self, drafter, p: BenchPrompt, curve: orc.CostCurve, window: int, t_prefill: float) -> dict:
        output = self.baseline_ids[(0, p.key)]
        coupled = None if self.s.greedy else self.sampling
        agree = orc.teacher_forced_agreement(drafter, self.prompt_ids[p.key], output, self.m.target.vocab_size,
                                             coupled)
        if drafter.branches:  # a tree drafter (hybrid): what its side branches keep counts too
            reach = orc.branch_reach(drafter, self.prompt_ids[p.key], output, agree, window, coupled)
            rounds, drafted = orc.tree_rounds(agree, reach, window)
        else:
            rounds, drafted = orc.oracle_rounds(agree, window), None
        result = {"prompt": p.key, "disagreements": agree.count(False), **orc.bound(rounds, curve, t_prefill, drafted)}
        # the same rounds at what `ar` paid per token on this prompt (a one-token answer has no step)
        step = orc.ar_step([r for r in self.records[BASELINE] if r["prompt"] == p.key and not failed(r)], t_prefill)
        at_ar = result if step is None else orc.bound(rounds, orc.at_step_cost(curve, step), t_prefill, drafted)
        return result | {"ar_step_s": step, "time_at_ar_step_s": at_ar["time_s"]}


def _failed(what: str, error: Exception, ours: bool) -> dict:
    """The failed record of `error`, said on stderr as it happens (with the traceback where
    specd's own code raised something other than a SpecdError: likely a bug)."""
    record = failed_record(error)
    if ours and not isinstance(error, SpecdError):
        tqdm.write("".join(traceback.format_exception(error)).rstrip(), file=sys.stderr)
    tqdm.write(f"warning: {what}: {record['failed']}; the run goes on without it", file=sys.stderr)
    return record


def run_bench(s: BenchSettings, models: Models | None = None, progress: bool = True) -> dict:
    """Validate, load, run and measure; returns the results document (see report.results_doc)."""
    from specd_bench.report import results_doc

    s.validate()
    load_questions(s.dataset, s.limit, s.offset)  # a bad dataset fails before the models load
    run = BenchRun(s, models or load_models(s))
    run.encode_prompts()
    run.warm_up()
    run.run_all(progress)
    return results_doc(run, run.oracle())
