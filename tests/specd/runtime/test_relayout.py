"""The embedded SmolLM2-135M re-expressed exactly as a Qwen2 checkpoint (zero q/k/v biases, no
sliding window) and as a Mistral one (no window): both run on the runtime's own forward and
decode what the Llama original decodes, token for token."""

from __future__ import annotations

import pytest

from specd.engine import SpeculativeEngine
from specd.runtime import load_model
from specd.runtime.arch import unsupported
from specd.runtime.embedded import embedded_dir
from specd.types import SamplingParams, SpecParams
from tests.relayout import relayout

pytestmark = pytest.mark.embedded
N = 48
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
]


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """{"qwen2": model, "mistral": model}: the embedded checkpoint written in each layout, loaded."""
    root = tmp_path_factory.mktemp("relayout")
    src = embedded_dir()
    return {family: load_model(str(relayout(src, root / family, family)), device="cpu", dtype="float32")
            for family in ("qwen2", "mistral")}


@pytest.fixture(scope="module")
def layouts(embedded, copies):
    return {"llama": embedded, **copies}


def test_the_copies_have_their_own_family_and_run_on_the_runtime(copies):
    for family, model in copies.items():
        assert model.model.config.model_type == family
        assert unsupported(model.model) is None, family
        assert model.forward_kind() == "lean", family
    qwen = copies["qwen2"].model
    assert qwen.model.layers[0].self_attn.q_proj.bias is not None  # the biases exist, all zeros
    assert not any(layer.self_attn.k_proj.bias.any() for layer in qwen.model.layers)
    assert copies["mistral"].model.config.sliding_window is None


def test_one_forward_gives_the_llama_logits(layouts):
    ids = list(range(100, 120))
    logits = {}
    for family, model in layouts.items():
        session = model.session()
        logits[family] = session.extend(ids, len(ids))[0]
    for family in ("qwen2", "mistral"):
        assert logits[family].shape == logits["llama"].shape == (20, 49152)
        err = (logits[family] - logits["llama"]).abs().max().item()
        assert err <= 1e-4, f"{family}: max |logit difference| {err}"


@pytest.mark.parametrize("question", QUESTIONS)
def test_greedy_decoding_is_the_same_in_every_layout(layouts, question):
    outs = {}
    for family, model in layouts.items():
        prompt = model.encode_prompt(question, chat=True)
        out = SpeculativeEngine(model).generate(prompt, SamplingParams(max_new_tokens=N), SpecParams("none"))
        outs[family] = out.token_ids
    assert len(outs["llama"]) > 0
    assert outs["qwen2"] == outs["llama"] and outs["mistral"] == outs["llama"], {
        f: layouts["llama"].decode(t) for f, t in outs.items()}
