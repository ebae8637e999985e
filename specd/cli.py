"""The `specd` command: generate (in-process engine), train-head (SpecDec++ head) and
train-drafter; other packages add theirs (services: serve, up, keys; specd_bench: the benchmarks).

Every deliberate error is one line on stderr and exit status 2; no tracebacks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from specd import __version__
from specd.errors import InvalidRequest, SpecdError

# How long torch's OpenMP threads (libgomp) spin after a parallel region before they sleep: read
# when torch loads, so set before any command imports it. libgomp's default spun about 5 ms of a
# core after every forward, taken from the processes a served token's round trip runs through;
# at this count a forward is as fast (docs/engine.md, "Threads that do not spin between forwards").
# The environment wins.
SPIN_COUNT = "10000"
os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)

class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage + message
        self.exit(2, f"{self.prog}: error: {message}\n")


def _policy_param(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return name.strip(), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=NUMBER, got {text!r}") from None


def _load_model(args, spec: str):
    """load_model with the command's device, dtype, cache, kernels and forward (train-drafter has
    no kernel or forward flags: auto; training falls back to PyTorch's kernels by itself)."""
    from specd.runtime import load_model

    return load_model(spec, args.device, args.dtype, args.cache_dir, getattr(args, "linear_kernels", "auto"),
                      getattr(args, "forward", "auto"), getattr(args, "cuda_graphs", "auto"),
                      cpu_compile=getattr(args, "cpu_compile", "auto"))


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target-model", default="embedded",
                   help="'embedded' (SmolLM2-135M-Instruct) or a local transformers directory")
    p.add_argument("--drafter", help="hf | early-exit | ngram | retrieval | feature | hybrid (early-exit's "
                                     "chain with retrieval's proposal beside it in a draft tree) (default: "
                                     "retrieval where specd ships a datastore for the target, the embedded "
                                     "one, else ngram; train-head's: early-exit; bench takes a comma list)")
    p.add_argument("--draft-model", help="local transformers directory for --drafter hf")
    p.add_argument("--draft-layers", type=int, default=4, help="layers of the target used by early-exit")
    p.add_argument("--draft-adapter", help="trained early-exit adapter or feature head (safetensors; "
                                           "early-exit's default: the one bundled for the embedded target "
                                           "at 4 layers; 'none': untrained)")
    p.add_argument("--datastore", help="retrieval's datastore of target answers (safetensors, made by "
                                       "`specd train-drafter --kind datastore`; default: the one bundled "
                                       "for the embedded target)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (auto: CUDA if present)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 "
                                                   "(auto: float32, the lossless choice; bfloat16 "
                                                   "output may drift from the target alone by rounding)")
    p.add_argument("--linear-kernels", default="auto", choices=["auto", "rows", "onednn", "torch"],
                   help="auto: for a float32 model on the CPU, specd's few-row product (rows, built with "
                        "the machine's C++ compiler on first use) or else oneDNN with weights packed at "
                        "load time (faster there: docs/engine.md); torch: PyTorch's default kernels")
    p.add_argument("--forward", default="auto", choices=["auto", "lean", "hf"],
                   help="how KV sessions run the model. auto: specd's lean forward for a float32 "
                        "model of a family it serves, on the CPU (transformers' logits, faster a step: "
                        "docs/engine.md); hf: transformers' forward")
    p.add_argument("--cuda-graphs", default="auto", choices=["auto", "on", "off", "compiled"],
                   help="auto: on a CUDA device, run the target from a preallocated KV pool with each "
                        "forward shape captured in a CUDA graph on first use (docs/engine.md); off: "
                        "eager forwards over growing caches; compiled: graphs of layers compiled by "
                        "torch.compile (fewer kernels, a longer start-up)")
    p.add_argument("--cpu-compile", default="auto", choices=["auto", "on", "off"],
                   help="auto: for a float32 model of 16M+ weights on the CPU, run the target from a "
                        "preallocated KV pool whose forwards are compiled ahead of time (AOTInductor; "
                        "the first run compiles for a minute or two, later runs load it from the cache "
                        "directory: docs/engine.md); off: eager forwards")
    p.add_argument("--cache-dir", type=Path, help="where dequantized weights and compiled forwards are kept "
                                                  "(default $SPECD_CACHE_DIR or ~/.cache/specd)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specd", description="Speculative decoding with adaptive draft stopping.")
    parser.add_argument("--version", action="version", version=f"specd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_generate(sub)
    _add_train_head(sub)
    _add_train_drafter(sub)
    _add_plugin_commands(sub)
    return parser


COMMANDS_GROUP = "specd.commands"


def _add_plugin_commands(sub) -> None:
    """Commands that other packages add to `specd`: each entry point of the group
    COMMANDS_GROUP is a function taking the subparsers. The services package adds its verbs
    (serve, up, keys, bench-load, ...) this way (pyproject.toml), so the core imports none of
    it; one that cannot be imported (e.g. grpc missing) is left out with a note."""
    from importlib.metadata import entry_points

    for ep in sorted(entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        try:
            add = ep.load()
        except ImportError as e:
            print(f"specd: the {ep.name} commands are unavailable: {e}", file=sys.stderr)
            continue
        add(sub)


def _add_generate(sub) -> None:
    g = sub.add_parser("generate", help="generate text in-process with speculative decoding")
    g.add_argument("prompt", help="the prompt (a user message when --chat)")
    _add_model_args(g)
    g.add_argument("--policy", default="cost-aware",
                   help="none | constant | heuristic | max-confidence | svip | adaedl | adasd | "
                        "specdec++ | cost-aware | oracle (default: cost-aware; none = target alone)")
    g.add_argument("--policy-param", type=_policy_param, action="append", default=[], metavar="NAME=VALUE",
                   help="override a policy hyperparameter, e.g. --policy-param h=0.4 (repeatable)")
    g.add_argument("--max-draft-tokens", type=int, help="hard cap on tokens drafted per round")
    g.add_argument("--relaxed", action="store_true", help="AdaSD relaxed verification (LOSSY, adasd only)")
    g.add_argument("--branches", type=int,
                   help="side branches verified beside the drafted chain as a draft tree (ngram, retrieval, "
                        "hybrid; default 0: chains only, docs/engine.md says why; "
                        "hybrid's default 2: its lookup branches)")
    g.add_argument("--specdecpp-head", type=Path, help="trained SpecDec++ head (default: the bundled "
                                                       "head for the embedded early-exit-4 pair)")
    g.add_argument("--task-tag", default="default", help="key of the shared adaptive policy state")
    g.add_argument("--overlap", action="store_true",
                   help="PEARL: draft the next window on a thread of its own while the target verifies")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--seed", type=int, help="sampling: the same seed gives the same text as the target alone "
                                            "with it, whatever was drafted")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="apply the model's chat template (default: on)")
    g.add_argument("--json", action="store_true", help='print {"text", "token_ids", "stats"}')
    g.set_defaults(func=cmd_generate)


def _add_train_head(sub) -> None:
    t = sub.add_parser("train-head", help="train the SpecDec++ acceptance head from target generations")
    _add_model_args(t)
    t.set_defaults(drafter="early-exit")
    t.add_argument("--prompts", type=Path, required=True, help="JSONL with a 'turns' list per line")
    t.add_argument("--limit", type=int, default=40, help="prompts to use")
    t.add_argument("--max-new-tokens", type=int, default=64)
    t.add_argument("--temperature", type=float, default=0.0)
    t.add_argument("--epochs", type=int, default=30)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--out", type=Path, required=True, help="where to write the head (safetensors)")
    t.set_defaults(func=cmd_train_head)


def _add_train_drafter(sub) -> None:
    t = sub.add_parser("train-drafter", help="train a drafter on the target's own answers (corpus made here)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    t.add_argument("--kind", default="early-exit", choices=["early-exit", "feature", "datastore"],
                   help="early-exit: an adapter on the target's first layers; feature: an EAGLE-style "
                        "head on the target's last hidden states; datastore: the corpus itself, indexed "
                        "for the retrieval drafter (no training)")
    t.add_argument("--out", type=Path, required=True,
                   help="where to write the adapter, head or datastore (safetensors)")
    t.add_argument("--target-model", default="embedded",
                   help="'embedded' (SmolLM2-135M-Instruct) or a local transformers directory")
    t.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (a GPU is far faster)")
    t.add_argument("--dtype", default="auto", help="auto (float32) | float32 | bfloat16 | float16")
    t.add_argument("--cache-dir", type=Path, help="where dequantized weights are kept; "
                                                  "None: $SPECD_CACHE_DIR or ~/.cache/specd")
    t.add_argument("--work-dir", type=Path, help="corpus shards and checkpoints; a rerun resumes from them; "
                                                 "None: CACHE_DIR/train/TARGET")
    c = t.add_argument_group("corpus (the target answers prompts)")
    c.add_argument("--positions", type=int, default=1_000_000, help="answer tokens to collect")
    c.add_argument("--prompts", type=Path, action="append", default=[],
                   help="extra JSONL prompt file with 'turns' (repeatable; templates and self-instruct "
                        "prompts are always used)")
    c.add_argument("--self-instruct", type=int, default=1000, help="questions the target writes itself")
    c.add_argument("--temperatures", default="0,1", help="comma list the answers cycle through")
    c.add_argument("--gen-batch-size", type=int, default=32, help="prompts answered per batch")
    c.add_argument("--max-new-tokens", type=int, default=256)
    a = t.add_argument_group("drafter and training")
    a.add_argument("--layers", type=int, default=4, help="early-exit: target layers the drafter keeps")
    a.add_argument("--adapter", default="mlp", choices=["mlp", "layer"],
                   help="early-exit: mlp (residual MLP) or layer (one extra decoder layer, Kangaroo)")
    a.add_argument("--rank", type=int, default=256, help="early-exit: the residual MLP's width")
    a.add_argument("--unroll", type=int, default=1,
                   help="feature: train the first N drafted tokens, depth 2..N on the head's own outputs "
                        "(EAGLE-3's training-time test); 1 = the first token only, on the target's features")
    a.add_argument("--draft-vocab", type=int, default=0,
                   help="draft over the N most frequent answer tokens only (FR-Spec); 0 = whole vocabulary")
    a.add_argument("--epochs", type=int, default=2)
    a.add_argument("--lr", type=float, default=1e-3)
    a.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per training batch")
    a.add_argument("--eval-prompts", type=Path, action="append", default=[],
                   help="held-out JSONL prompt file: answered greedily once, agreement reported (repeatable)")
    a.add_argument("--eval-max-new-tokens", type=int, default=128)
    a.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=cmd_train_drafter)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _quiet_libraries()
    try:
        return args.func(args)
    except SpecdError as e:
        print(f"specd: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _quiet_libraries() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded at run time
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _load(args):
    from specd.drafters import build_drafter, default_drafter

    target = _load_model(args, args.target_model)
    args.drafter = args.drafter or default_drafter(target.name)
    draft_model = None
    if args.drafter == "hf":
        if not args.draft_model:
            raise InvalidRequest("draft_model", "--drafter hf needs --draft-model DIR")
        draft_model = _load_model(args, args.draft_model)
    drafter = build_drafter(args.drafter, target, draft_model, args.draft_layers, args.draft_adapter,
                            args.datastore)
    return target, drafter


def _specdecpp_head(args, target, drafter):
    """--specdecpp-head, else the head bundled for this drafter, on the target's device."""
    from specd.policies import AcceptanceHead, bundled_head_path

    path = args.specdecpp_head or bundled_head_path(drafter.name)
    return AcceptanceHead.load(path).to(target.device) if path is not None else None


def cmd_generate(args) -> int:
    from specd.engine import SpeculativeEngine
    from specd.types import SamplingParams, SpecParams

    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed, args.max_new_tokens,
                              tuple(args.stop))
    sampling.validate()
    spec = SpecParams(args.policy, args.max_draft_tokens, dict(args.policy_param), args.task_tag,
                      args.relaxed, args.branches)
    if not args.prompt.strip():
        raise InvalidRequest("prompt", "must not be empty")
    target, drafter = _load(args) if args.policy != "none" else (_load_target(args), None)
    head = _specdecpp_head(args, target, drafter) if args.policy == "specdec++" else None
    engine = SpeculativeEngine(target, drafter, specdecpp_head=head, costs_cache_dir=_cache_dir(args))
    prompt = target.encode_prompt(args.prompt, args.chat)
    reference = None
    if args.policy == "oracle":  # analysis only: the oracle needs the target-only answer first
        reference = SpeculativeEngine(target).generate(prompt, sampling, SpecParams("none")).token_ids
    out = engine.generate(prompt, sampling, spec, reference, overlap=args.overlap)
    stats = out.stats.to_dict()
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "stats": stats}))
    else:
        print(out.text)
        print(f"\n[{stats['new_tokens']} tokens in {stats['wall_time_s']:.2f} s = {stats['tokens_per_s']} tok/s | "
              f"policy {stats['policy']}, drafter {stats['drafter']} | drafted {stats['drafted']}, "
              f"accepted {stats['accepted']} ({stats['acceptance_rate']:.0%}), "
              f"{stats['verifications']} verifications, {stats['mean_accepted_tokens']:.2f} tokens/verification"
              f"{_tree_note(stats)}{' | PEARL' if stats.get('overlap') else ''}"
              f"{' | LOSSY' if stats['lossy'] else ''}]", file=sys.stderr)
    return 0


def _tree_note(stats: dict) -> str:
    if not stats["tree_rounds"]:
        return ""
    return f" | {stats['tree_rounds']} draft trees, {stats['branch_accepted']} took a side branch"


def _cache_dir(args) -> Path:
    from specd.runtime.embedded import default_cache_dir

    return args.cache_dir or default_cache_dir()


def _load_target(args):
    return _load_model(args, args.target_model)


def cmd_train_head(args) -> int:
    from specd.training.specdecpp import train_head_from_prompts

    target, drafter = _load(args)
    started = time.perf_counter()
    report = train_head_from_prompts(target, drafter, args.prompts, args.limit, args.max_new_tokens,
                                     args.temperature, args.epochs, args.out, args.seed)
    report["wall_time_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report, indent=2))
    return 0


def cmd_train_drafter(args) -> int:
    from specd.training.corpus import answer_prompts, build_corpus, file_prompts, read_shard, write_shard
    from specd.training.early_exit import train_early_exit
    from specd.training.feature import check_unroll, train_feature

    try:
        temperatures = [float(x) for x in _comma_list(args.temperatures) or ()]
    except ValueError:
        raise InvalidRequest("temperatures", f"expected a comma list of numbers, got {args.temperatures!r}") from None
    for name in ("positions", "gen_batch_size", "max_new_tokens", "epochs", "batch_tokens", "rank"):
        if getattr(args, name) < 1:
            raise InvalidRequest(name, f"must be at least 1, got {getattr(args, name)}")
    check_unroll(args.unroll)  # before the corpus, which takes minutes
    target = _load_model(args, args.target_model)
    work = args.work_dir or _cache_dir(args) / "train" / target.name
    started = time.perf_counter()
    corpus = build_corpus(target, work, args.positions, prompt_files=args.prompts, self_instruct=args.self_instruct,
                          temperatures=temperatures, batch_size=args.gen_batch_size,
                          max_new_tokens=args.max_new_tokens, seed=args.seed)
    if args.kind == "datastore":
        return _write_datastore(target, corpus, args.out, started)
    evals = {}
    for path in args.eval_prompts:  # answered once, kept beside the corpus
        saved = work / f"eval-{path.stem}-{args.eval_max_new_tokens}.safetensors"
        if not saved.is_file():
            write_shard(saved, answer_prompts(target, file_prompts([path]), 0.0, args.eval_max_new_tokens,
                                              args.gen_batch_size, args.seed), 0.0)
        evals[path.stem] = read_shard(saved)
    common = {"draft_vocab": args.draft_vocab or None, "epochs": args.epochs, "lr": args.lr,
              "batch_tokens": args.batch_tokens, "eval_seqs": evals, "seed": args.seed,
              "checkpoint": work / f"ckpt-{args.out.stem}.pt"}
    if args.kind == "feature":
        report = train_feature(target, list(corpus), args.out, unroll=args.unroll, **common)
    else:
        report = train_early_exit(target, list(corpus), args.out, layers=args.layers, adapter=args.adapter,
                                  rank=args.rank, **common)
    report["wall_time_s"] = round(time.perf_counter() - started, 1)
    report["out"] = str(args.out)
    print(json.dumps(report, indent=2))
    return 0


def _write_datastore(target, corpus, out: Path, started: float) -> int:
    """Every answered prompt of the corpus (prompt + answer: answers quote their prompts)."""
    from specd.drafters import Datastore

    store = Datastore.from_documents((a.ids for a in corpus), meta={"target": target.name})
    out.parent.mkdir(parents=True, exist_ok=True)
    store.save(out)
    report = {"kind": "datastore", "documents": store.documents, "tokens": store.tokens,
              "bytes": out.stat().st_size, "wall_time_s": round(time.perf_counter() - started, 1), "out": str(out)}
    print(json.dumps(report, indent=2))
    return 0


def _comma_list(text: str | None) -> tuple[str, ...] | None:
    return None if text is None else tuple(x.strip() for x in text.split(",") if x.strip())


if __name__ == "__main__":
    sys.exit(main())
