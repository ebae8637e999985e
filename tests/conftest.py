"""Shared fixtures: tiny seeded random models for fast tests, the real embedded model once
per session (dequantized weights cached under SPECD_CACHE_DIR or ~/.cache/specd)."""

from __future__ import annotations

import pytest
import torch

from specd.models.tiny import loaded, perturbed, save_tiny, tiny_llama

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_target():
    return loaded(tiny_llama(0, layers=4), "tiny-target")


@pytest.fixture(scope="session")
def tiny_draft(tiny_target):
    """A noisy copy of the target: agrees on many tokens, not all."""
    return loaded(perturbed(tiny_target.model, 0.01, seed=1), "tiny-draft")


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory, tiny_target, tiny_draft):
    """(target_dir, draft_dir): the tiny pair saved as transformers directories with a tokenizer."""
    root = tmp_path_factory.mktemp("tiny")
    return save_tiny(root / "target", model=tiny_target.model), save_tiny(root / "draft", model=tiny_draft.model)


@pytest.fixture(scope="session")
def embedded():
    from specd.models import load_model

    return load_model("embedded", device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def hf_greedy():
    """transformers' own greedy decoding: the reference every speculative run must match."""
    cache: dict = {}

    def run(model: torch.nn.Module, prompt: list[int], n: int, eos: int | None = None) -> list[int]:
        key = (id(model), tuple(prompt), n, eos)
        if key not in cache:
            cache[key] = _hf_greedy(model, prompt, n, eos)
        return cache[key]

    return run


def _hf_greedy(model: torch.nn.Module, prompt: list[int], n: int, eos: int | None = None) -> list[int]:
    kwargs = {"eos_token_id": eos} if eos is not None else {"min_new_tokens": n}
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                         pad_token_id=model.config.pad_token_id, **kwargs)
    return out[0, len(prompt):].tolist()


@pytest.fixture
def specd_cli(capsys):
    """Run the `specd` command in-process: argv -> (exit code, stdout, stderr)."""
    from specd.cli import main

    def run(argv: list[str]) -> tuple[int, str, str]:
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's own errors
            code = e.code
        out, err = capsys.readouterr()
        return code, out, err

    return run
