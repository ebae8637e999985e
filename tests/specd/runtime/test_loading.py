"""Loading local model directories and refusing draft/target pairs that do not fit."""

from __future__ import annotations

import pytest
import torch

from specd.errors import InvalidRequest, ModelError
from specd.runtime import check_pair, load_model
from specd.runtime.loading import resolve_device, resolve_dtype
from specd.runtime.tiny import char_tokenizer, loaded, tiny_llama


def test_local_directory_round_trip(tiny_dirs, tiny_target):
    model = load_model(str(tiny_dirs[0]), device="cpu")
    assert model.name == "target" and model.vocab_size == tiny_target.vocab_size
    assert model.eos_token_ids == frozenset([2])
    ids = model.encode_prompt("hi", chat=True)
    assert model.decode(ids).endswith("assistant\n")


def test_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ModelError, match="no config.json"):
        load_model(str(tmp_path / "nope"), device="cpu")


def test_mismatched_tokenizers_are_refused():
    tok = char_tokenizer()
    other = char_tokenizer()
    other.add_tokens(["<extra>"])  # a different vocabulary
    target = loaded(tiny_llama(0), "t", tok)
    with pytest.raises(ModelError, match="different tokenizers"):
        check_pair(loaded(tiny_llama(1), "d", other), target)
    check_pair(loaded(tiny_llama(1), "d", char_tokenizer()), target)  # same vocabulary: fine


def test_draft_vocab_must_cover_the_tokenizer():
    target = loaded(tiny_llama(0, vocab_size=128), "t", char_tokenizer())
    small = loaded(tiny_llama(1, vocab_size=64), "d", char_tokenizer())  # 99 tokens do not fit in 64
    with pytest.raises(ModelError, match="cover"):
        check_pair(small, target)


def test_device_and_dtype_resolution():
    assert resolve_device("cpu").type == "cpu"
    assert str(resolve_dtype("auto", resolve_device("cpu"))) == "torch.float32"
    # Lossless by default on a GPU too: bf16 windows round unlike one-token steps.
    assert resolve_dtype("auto", torch.device("cuda")) == torch.float32
    with pytest.raises(InvalidRequest):
        resolve_device("quantum")
    with pytest.raises(InvalidRequest):
        resolve_dtype("int3", resolve_device("cpu"))


def test_shard_places_the_model_with_accelerate(tiny_dirs, tiny_target):
    """device "shard" loads through device_map="auto" (every visible GPU; the CPU here, where
    it must give exactly the plain load's logits)."""
    import torch

    plain = load_model(str(tiny_dirs[0]), device="cpu")
    sharded = load_model(str(tiny_dirs[0]), device="shard")
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert sharded.device.type == want
    ids = [5, 6, 7, 8]
    with torch.inference_mode():
        a = plain.model(torch.tensor([ids])).logits
        b = sharded.model(torch.tensor([ids], device=sharded.device)).logits.to(a.device, a.dtype)
    if want == "cpu":
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["on", "compiled"])
def test_cuda_graphs_asked_for_on_the_cpu_are_a_clear_error(tiny_dirs, mode):
    """--cuda-graphs on and compiled need a CUDA device: on the CPU each is refused by name, not
    run some other way."""
    with pytest.raises(InvalidRequest, match="cuda_graphs"):
        load_model(str(tiny_dirs[0]), device="cpu", cuda_graphs=mode)


def test_an_unknown_cuda_graphs_mode_is_refused_before_loading(tiny_dirs):
    with pytest.raises(InvalidRequest, match="cuda_graphs: unknown mode 'sometimes'"):
        load_model(str(tiny_dirs[0]), device="cpu", cuda_graphs="sometimes")
