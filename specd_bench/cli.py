"""The benchmark commands of `specd` (bench, bench-merge, bench-dvi, bench-services,
bench-load), added from outside the core like the services' (pyproject.toml's
`specd.commands` entry points)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specd.cli import _add_model_args, _comma_list, _load, _policy_param
from specd.errors import InvalidRequest

# --dataset of every bench command (specd_bench.datasets reads it; importing that here would load torch)
DATASET_HELP = ("JSONL with a 'turns' list per line, as MT-bench's question.jsonl; 'built-in' or left out: "
                "the 40 prompts bundled in specd/data/prompts.jsonl")


def add_commands(sub) -> None:
    from specd_bench.load import add_command as add_load_command
    from specd_bench.services import add_command as add_services_command

    _add_bench(sub)
    _add_bench_merge(sub)
    _add_bench_dvi(sub)
    add_services_command(sub)
    add_load_command(sub)


def _add_bench(sub) -> None:
    b = sub.add_parser("bench", help="benchmark policies, drafters and peers (results.json, report.md, PNGs)")
    _add_model_args(b)
    b.add_argument("--dataset", type=Path, help=DATASET_HELP)
    b.add_argument("--turn", choices=["1", "2", "all"], default="1",
                   help="2 replays the target's first answer as a conversation")
    b.add_argument("--limit", type=int, help="questions to use (default: all)")
    b.add_argument("--offset", type=int, default=0,
                   help="questions to skip first (--offset 40 --limit 40: the second half of an 80-question set)")
    b.add_argument("--policies", help="comma list (default: every policy except oracle)")
    b.add_argument("--max-new-tokens", type=int, default=256)
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--seed", type=int, help="sampled runs: seeded (coupled) draws, checked identical to ar; "
                                            "unseeded runs use rejection sampling")
    b.add_argument("--repeats", type=int, default=1)
    b.add_argument("--baselines", default="ar,hf-prompt-lookup",
                   help="comma list of ar, hf-ar, hf-assisted, hf-heuristic, hf-prompt-lookup, llama-cpp, "
                        "llama-cpp-lookup (ar always runs; hf-ar: transformers' generate() alone, what "
                        "specd's runtime is worth before speculation; llama-cpp: llama.cpp alone on the "
                        "same GGUF at specd's precision, -lookup with its prompt lookup; needs the "
                        "'llama' extra, else skipped)")
    b.add_argument("--sweep-k", action="store_true", help="also run constant K = 1..8 (expensive)")
    b.add_argument("--trees", action="store_true",
                   help="also run every lookup-drafter configuration with draft trees (DRAFTER/POLICY/tree, "
                        "3 side branches)")
    b.add_argument("--overlap", action="store_true",
                   help="also run every configuration with PEARL in process (DRAFTER/POLICY/pearl: the next "
                        "window drafted on a thread of its own while this one is verified)")
    b.add_argument("--cold-start", action="store_true",
                   help="start every run from empty policy state and the start-up cost curve, as a fresh "
                        "`specd generate` does (default: state carries over from prompt to prompt, as in "
                        "a server)")
    b.add_argument("--out", type=Path, default=Path("bench-out"))
    b.add_argument("--json", action="store_true", help="print results.json to stdout too")
    b.set_defaults(func=cmd_bench)


def _add_bench_merge(sub) -> None:
    m = sub.add_parser("bench-merge", help="join `specd bench` runs over disjoint parts of one prompt set "
                                           "(--offset/--limit) into one results.json, report.md and PNGs")
    m.add_argument("parts", nargs="+", type=Path, help="the parts' --out directories (or results.json files)")
    m.add_argument("--out", type=Path, required=True)
    m.set_defaults(func=cmd_bench_merge)


def _add_bench_dvi(sub) -> None:
    b = sub.add_parser("bench-dvi", help="online learning (DVI): acceptance against updates over a prompt stream",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_model_args(b)
    b.set_defaults(drafter="early-exit")
    b.add_argument("--dataset", type=Path, help=DATASET_HELP)
    b.add_argument("--limit", type=int, help="prompts in the stream (default: all)")
    b.add_argument("--policy", default="constant", help="stopping policy of the speculative runs")
    b.add_argument("--max-draft-tokens", type=int, help="cap on tokens per window (default: the policy's)")
    b.add_argument("--policy-param", type=_policy_param, action="append", default=[], metavar="NAME=NUMBER")
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--updates-per-record", type=float, default=0.5,
                   help="trainer updates per logged draft position")
    b.add_argument("--rank", type=int, default=16, help="LoRA rank")
    b.add_argument("--lr", type=float, default=2e-3)
    b.add_argument("--batch-size", type=int, default=64, help="records per update")
    b.add_argument("--kl-steps", type=int, default=200, help="updates of pure distillation before the RL terms")
    b.add_argument("--out", type=Path, default=Path("bench-dvi-out"))
    b.set_defaults(func=cmd_bench_dvi)


def cmd_bench_dvi(args) -> int:
    from specd_bench.datasets import bench_prompts, dataset_label, load_questions, messages
    from specd_bench.dvi import run_dvi_bench, write_dvi_outputs
    from specd_bench.report import machine_info
    from specd.dvi import TrainerConfig
    from specd.types import SamplingParams, SpecParams

    if not args.updates_per_record >= 0:
        raise InvalidRequest("updates_per_record", f"must be at least 0, got {args.updates_per_record}")
    sampling = SamplingParams(args.temperature, seed=args.seed, max_new_tokens=args.max_new_tokens)
    sampling.validate()
    spec = SpecParams(args.policy, args.max_draft_tokens, dict(args.policy_param))
    config = TrainerConfig(rank=args.rank, lr=args.lr, batch_size=args.batch_size, kl_steps=args.kl_steps,
                           seed=args.seed)
    config.validate()
    questions = load_questions(args.dataset, args.limit)
    target, drafter = _load(args)
    prompts = [target.encode_prompt(messages(p, None), True) for p in bench_prompts(questions, "1")]
    doc = run_dvi_bench(target, drafter, prompts, sampling, spec, config, args.updates_per_record)
    doc |= {"command": " ".join(["specd", *sys.argv[1:]]), "drafter": drafter.name, "target": target.name,
            "dataset": dataset_label(args.dataset), "config": vars(config), "machine": machine_info(target),
            "sampling": {"temperature": args.temperature, "max_new_tokens": args.max_new_tokens, "seed": args.seed},
            "policy": args.policy}
    for path in write_dvi_outputs(doc, args.out):
        print(path)
    print(json.dumps(doc["summary"], indent=2))
    return 0


def cmd_bench(args) -> int:
    from specd_bench import BenchSettings, run_bench
    from specd_bench.report import write_outputs

    from specd.drafters import default_drafter
    from specd.runtime.loading import model_name

    baselines = _comma_list(args.baselines)
    drafters = _comma_list(args.drafter) or (default_drafter(model_name(args.target_model)),)
    settings = BenchSettings(
        args.dataset, args.turn, args.limit, _comma_list(args.policies), drafters,
        args.draft_model, args.draft_layers, args.target_model, args.max_new_tokens, args.temperature,
        args.seed, args.repeats, ("ar", *(b for b in baselines if b != "ar")), args.sweep_k, args.out,
        args.device, args.dtype, args.cache_dir, args.draft_adapter, args.linear_kernels, args.datastore,
        args.trees, args.forward, args.offset, args.cuda_graphs, args.cold_start, args.cpu_compile, args.overlap)
    doc = run_bench(settings)
    paths = write_outputs(doc, args.out)
    if args.json:
        print(json.dumps(doc, indent=1))
    print(f"wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    disturbed = doc["contention"].get("disturbed")
    if disturbed:
        print(f"warning: other processes shared the CPUs during {len(disturbed)} prompt runs "
              f"({', '.join(d['prompt'] for d in disturbed)}); report.md repeats the speedups without them",
              file=sys.stderr)
    failing = {label: a for label, a in doc["aggregates"].items() if a["failed_runs"]}
    if failing:
        print("warning: some configurations failed on some prompts ("
              + ", ".join(f"{label}: {len(a['failed_prompts'])} of {len(doc['prompts'])}" for label, a in failing.items())
              + "); report.md says why, and leaves them out of those prompts' speedups", file=sys.stderr)
    return 0


def cmd_bench_merge(args) -> int:
    from specd_bench.merge import load_part, merge_docs
    from specd_bench.report import write_outputs

    doc = merge_docs([load_part(p) for p in args.parts])
    paths = write_outputs(doc, args.out)
    print(f"wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    return 0
