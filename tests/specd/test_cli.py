"""`specd generate`: the --json shape and one-line errors (exit 2, no traceback) for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest



def test_generate_json_shape(tiny_dirs, specd_cli):
    target, draft = map(str, tiny_dirs)
    code, out, err = specd_cli(["generate", "hello", "--target-model", target, "--drafter", "hf", "--draft-model",
                          draft, "--policy", "adaedl", "--max-new-tokens", "12", "--json"])
    assert code == 0, err
    doc = json.loads(out)
    assert set(doc) == {"text", "token_ids", "stats"}
    assert len(doc["token_ids"]) <= 12 and isinstance(doc["text"], str)
    stats = doc["stats"]
    for key in ("drafted", "accepted", "verifications", "mean_accepted_tokens", "acceptance_rate",
                "draft_lengths", "wall_time_s", "tokens_per_s", "lossy"):
        assert key in stats
    assert stats["lossy"] is False and stats["policy"] == "adaedl"
    assert sum(stats["draft_lengths"]) == stats["drafted"]


def test_greedy_policies_agree_with_none(tiny_dirs, specd_cli):
    target, draft = map(str, tiny_dirs)
    outs = {}
    for policy in ("none", "svip", "heuristic"):
        code, out, err = specd_cli(["generate", "hi there", "--target-model", target, "--drafter", "hf",
                              "--draft-model", draft, "--policy", policy, "--max-new-tokens", "16",
                              "--json"])
        assert code == 0, err
        outs[policy] = json.loads(out)["token_ids"]
    assert outs["svip"] == outs["none"] == outs["heuristic"]


BAD = [
    (["--policy", "fastest"], "policy"),
    (["--drafter", "magic"], "drafter"),
    (["--max-new-tokens", "-3"], "max_new_tokens"),
    (["--max-new-tokens", "100000000"], "max_new_tokens"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "1.5"], "top_p"),
    (["--top-k", "-2"], "top_k"),
    (["--policy-param", "k=0"], "policy_params.k"),
    (["--policy-param", "bogus=1"], "policy_params.bogus"),
    (["--policy-param", "k"], "NAME=NUMBER"),
    (["--max-draft-tokens", "0"], "max_draft_tokens"),
    (["--draft-layers", "99", "--drafter", "early-exit"], "draft_layers"),
    (["--relaxed"], "relaxed"),
    (["--drafter", "hf"], "draft_model"),
    (["--forward", "turbo"], "forward"),
    (["--drafter", "hf", "--draft-model", "/nonexistent/model"], "/nonexistent/model"),
    (["--device", "tpu"], "device"),
    (["--max-new-tokens", "ten"], "max-new-tokens"),
]


@pytest.mark.parametrize("extra, mention", BAD)
def test_bad_input_is_one_line(tiny_dirs, specd_cli, extra, mention):
    argv = ["generate", "hello", "--target-model", str(tiny_dirs[0]), "--policy", "constant", *extra]
    if "--policy" in extra:
        argv[argv.index("constant") - 1:argv.index("constant") + 1] = []
    code, out, err = specd_cli(argv)
    assert code == 2
    assert mention in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_empty_prompt_missing_model_and_long_prompt(tiny_dirs, specd_cli):
    for argv, mention in [
        (["generate", "   ", "--target-model", str(tiny_dirs[0])], "prompt"),
        (["generate", "hi", "--target-model", "/no/such/dir"], "/no/such/dir"),
        (["generate", "x" * 600, "--target-model", str(tiny_dirs[0]), "--no-chat"], "context"),
    ]:
        code, out, err = specd_cli(argv)
        assert code == 2 and mention in err and len(err.strip().splitlines()) == 1


def test_console_script_reports_argparse_errors_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "specd", "generate", "hi", "--max-new-tokens", "ten"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "max-new-tokens" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_train_drafter_smoke(tiny_dirs, specd_cli, tmp_path):
    """Corpus, held-out answers and a trained adapter that `generate` then drafts with."""
    target_dir = str(tiny_dirs[0])
    held_out = tmp_path / "held.jsonl"
    held_out.write_text(json.dumps({"turns": ["a held-out question", "its second turn"]}) + "\n")
    out = tmp_path / "adapter.safetensors"
    common = ["--target-model", target_dir, "--device", "cpu", "--out", str(out), "--work-dir", str(tmp_path / "w"),
              "--positions", "120", "--self-instruct", "2", "--gen-batch-size", "8", "--max-new-tokens", "12",
              "--eval-prompts", str(held_out), "--eval-max-new-tokens", "8"]
    code, stdout, err = specd_cli(["train-drafter", *common, "--layers", "1", "--rank", "16",
                                   "--draft-vocab", "64", "--epochs", "1", "--batch-tokens", "512"])
    assert code == 0, err
    report = json.loads(stdout)
    assert report["train_positions"] > 0 and report["draft_vocab"] == 64
    assert set(report["after"]) == {"corpus-holdout", "held"} and report["after"]["held"]["positions"] > 0
    assert (tmp_path / "w" / "eval-held-8.safetensors").is_file() and any((tmp_path / "w").glob("shard-*"))
    code, stdout, err = specd_cli(["generate", "hi", "--target-model", target_dir, "--device", "cpu",
                                   "--drafter", "early-exit", "--draft-adapter", str(out), "--policy", "constant",
                                   "--max-new-tokens", "8", "--json"])
    assert code == 0, err
    assert json.loads(stdout)["stats"]["drafter"] == "early-exit"
    feature = tmp_path / "feature.safetensors"
    code, stdout, err = specd_cli(["train-drafter", *[str(feature) if a == str(out) else a for a in common], "--kind",
                                   "feature", "--epochs", "1", "--batch-tokens", "512", "--unroll", "2"])
    assert code == 0, err
    report = json.loads(stdout)
    assert report["kind"] == "feature" and report["unroll"] == 2 and feature.is_file()
    assert set(report["after"]["held"]["by_depth"]) == {"1", "2", "3"}  # always reported to depth 3
    code, stdout, err = specd_cli(["generate", "hi", "--target-model", target_dir, "--device", "cpu",
                                   "--drafter", "feature", "--draft-adapter", str(feature), "--policy", "cost-aware",
                                   "--max-new-tokens", "8", "--json"])
    assert code == 0, err
    assert json.loads(stdout)["stats"]["drafter"] == "feature"
    store = tmp_path / "datastore.safetensors"
    code, stdout, err = specd_cli(["train-drafter", *[str(store) if a == str(out) else a for a in common],
                                   "--kind", "datastore"])
    assert code == 0, err
    report = json.loads(stdout)
    assert report["kind"] == "datastore" and report["tokens"] > 120 and store.is_file()  # prompts + answers
    code, stdout, err = specd_cli(["generate", "hi", "--target-model", target_dir, "--device", "cpu",
                                   "--drafter", "retrieval", "--datastore", str(store), "--max-new-tokens", "8",
                                   "--json"])
    assert code == 0, err
    assert json.loads(stdout)["stats"]["drafter"] == "retrieval"
    code, _, err = specd_cli(["generate", "hi", "--target-model", target_dir, "--device", "cpu",
                              "--drafter", "retrieval"])
    assert code == 2 and "datastore" in err  # none bundled for this target, none named
    code, _, err = specd_cli(["train-drafter", *common, "--temperatures", "0,hot"])
    assert code == 2 and "temperatures" in err
    code, _, err = specd_cli(["train-drafter", *common, "--epochs", "0"])
    assert code == 2 and "epochs" in err
    code, _, err = specd_cli(["train-drafter", *common, "--kind", "feature", "--unroll", "0"])
    assert code == 2 and "unroll" in err


def test_bench_dvi_smoke(tiny_dirs, specd_cli, tmp_path):
    """Online learning over a 3-prompt stream: the outputs, their keys, and lossless output."""
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in ["hello", "a b c a b c", "what now"]))
    out = tmp_path / "dvi"
    code, _, err = specd_cli(["bench-dvi", "--target-model", str(tiny_dirs[0]), "--device", "cpu",
                                   "--draft-layers", "1", "--dataset", str(data), "--max-new-tokens", "12",
                                   "--updates-per-record", "1", "--batch-size", "4", "--kl-steps", "2",
                                   "--out", str(out)])
    assert code == 0, err
    doc = json.loads((out / "results.json").read_text())
    assert len(doc["rows"]) == 3 and doc["rows"][0]["updates"] == 0 and doc["dataset"] == str(data)
    assert doc["updates"] == doc["records"] > 0  # one update per logged record
    assert {"acceptance_rate", "agreement", "agreement_frozen", "identical"} <= doc["rows"][0].keys()
    assert all(r["identical"] for r in doc["rows"]) and doc["summary"]["identical"]
    assert (out / "report.md").is_file() and (out / "dvi-agreement.png").stat().st_size > 0
    code, _, err = specd_cli(["bench-dvi", "--target-model", str(tiny_dirs[0]), "--dataset", str(data),
                              "--drafter", "ngram", "--out", str(out)])
    assert code == 2 and "drafter" in err


def test_the_core_imports_no_service_and_no_grpc():
    """specd/ stands alone: every module imports with grpc and the services package blocked,
    and `specd generate --help` still works (the service verbs are left out with a note)."""
    import subprocess
    import sys

    code = """
import importlib, pkgutil, sys
sys.modules["grpc"] = None
sys.modules["services"] = None
import specd
for m in pkgutil.walk_packages(specd.__path__, "specd."):
    if m.name != "specd.__main__":  # that one runs the command
        importlib.import_module(m.name)
assert not any(name.startswith(("services", "grpc")) and sys.modules[name] is not None
               for name in sys.modules), "a service module was imported"
from specd.cli import main
try:
    main(["generate", "--help"])
except SystemExit as e:
    assert e.code == 0
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage: specd generate" in out.stdout
    assert "the services commands are unavailable" in out.stderr


def _child(code: str, env: dict[str, str]) -> str:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_the_command_shortens_openmps_spin_before_torch_loads():
    """libgomp reads GOMP_SPINCOUNT when torch loads it: the command sets it first (torch is not
    loaded by importing the command), and a value in the environment wins."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    code = "import os, sys, specd.cli; print('torch' in sys.modules, os.environ['GOMP_SPINCOUNT'])"
    assert _child(code, env) == "False 10000"
    assert _child(code, {**env, "GOMP_SPINCOUNT": "300"}) == "False 300"
