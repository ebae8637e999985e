"""Tiny seeded random Llama models (and a character-level tokenizer) for tests.

Weights are drawn with a large initializer range so that next-token distributions are
peaked: near-ties between logits would make greedy equality depend on float round-off
rather than on the algorithm.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch

from specd.runtime.kernels import use_kernels
from specd.runtime.loading import LoadedModel, _max_context

SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
                 "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def tiny_config(vocab_size: int = 128, layers: int = 2, hidden: int = 64, max_context: int = 512,
                init_range: float = 0.3):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=max_context, initializer_range=init_range,
                       bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)


def tiny_llama(seed: int = 0, **config) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(**config)).eval()
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.generation_config.pad_token_id = model.config.pad_token_id
    return model


def perturbed(model: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    """A copy of model with Gaussian noise on every weight: a draft that mostly agrees."""
    import copy

    gen = torch.Generator().manual_seed(seed)
    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std())
    return out


def loaded(model: torch.nn.Module, name: str, tokenizer=None, forward: str = "auto") -> LoadedModel:
    """Wrap an in-memory model the way load_model would (its linear kernels and forward included)."""
    use_kernels(model)
    eos = model.generation_config.eos_token_id
    return LoadedModel(name, model, tokenizer, torch.device("cpu"),
                       _max_context(model.config), frozenset([eos] if eos is not None else []), forward)


def char_tokenizer():
    """A character-level tokenizer: specials, then printable ASCII (98 tokens)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(string.printable[:-5]) + ["\n"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", pad_token="<|im_end|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny(path: str | Path, seed: int = 0, model: torch.nn.Module | None = None, tokenizer=None,
              **config) -> Path:
    """Write a tiny model + tokenizer directory loadable by specd.runtime.load_model (tokenizer:
    the character-level one unless given; a given one sets the vocabulary's size)."""
    path = Path(path)
    if tokenizer is not None and model is None:
        config.setdefault("vocab_size", len(tokenizer))
    model = model if model is not None else tiny_llama(seed, **config)
    model.save_pretrained(path)
    (tokenizer if tokenizer is not None else char_tokenizer()).save_pretrained(path)
    return path


# Tiny random checkpoints of every family the runtime serves (specd.runtime.arch), built from
# transformers' own config classes: each with the traits that set the family apart, small
# windows and short original contexts so that a test reaches past them.
_SIZES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
_HALF = 8  # half of a 16-dimension head: the length of longrope's factor lists


def _family_config(family: str, vocab_size: int, layers: int):
    import transformers as t

    sizes = dict(_SIZES, vocab_size=vocab_size, num_hidden_layers=layers, initializer_range=0.3)
    ropes = {
        "linear": {"rope_type": "linear", "factor": 2.0},
        "dynamic": {"rope_type": "dynamic", "factor": 2.0},
        "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
        "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 32},
        "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 32,
                     "short_factor": [1.0 + 0.1 * i for i in range(_HALF)],
                     "long_factor": [2.0 + 0.5 * i for i in range(_HALF)]},
    }
    if family == "llama":
        return t.LlamaConfig(**sizes)
    if family == "llama-bias":
        return t.LlamaConfig(**sizes, attention_bias=True, mlp_bias=True)
    if family.startswith("llama-"):  # llama-<rope scaling>
        rope = dict(ropes[family.split("-", 1)[1]], rope_theta=10000.0)
        if rope["rope_type"] == "dynamic":
            sizes["max_position_embeddings"] = 48  # dynamic scales past the model's own context
        if rope.get("original_max_position_embeddings"):
            sizes["max_position_embeddings"] = 4 * rope["original_max_position_embeddings"]
        return t.LlamaConfig(**sizes, rope_parameters=rope, head_dim=16)
    if family == "mistral":
        return t.MistralConfig(**sizes, sliding_window=None)
    if family == "mistral-window":
        return t.MistralConfig(**sizes, sliding_window=24)
    if family == "qwen2":
        return t.Qwen2Config(**sizes)
    if family == "qwen2-window":
        return t.Qwen2Config(**sizes, use_sliding_window=True, sliding_window=24, max_window_layers=1)
    if family == "qwen3":
        return t.Qwen3Config(**sizes, head_dim=32)
    if family == "gemma2":
        return t.Gemma2Config(**dict(sizes, hidden_activation="gelu_pytorch_tanh"), head_dim=16,
                              query_pre_attn_scalar=24, sliding_window=24, attn_logit_softcapping=20.0,
                              final_logit_softcapping=15.0, attn_implementation="eager")
    if family == "gemma3":
        return t.Gemma3TextConfig(**dict(sizes, hidden_activation="gelu_pytorch_tanh"), head_dim=16,
                                  query_pre_attn_scalar=24, sliding_window=24, final_logit_softcapping=15.0,
                                  layer_types=["sliding_attention", "full_attention"] * (layers // 2)
                                  + ["sliding_attention"] * (layers % 2),
                                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                   "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                      "rope_theta": 1000000.0}})
    if family == "phi3":
        return t.Phi3Config(**sizes)
    if family == "phi3-longrope":  # Phi-3's long-context checkpoints; a partial rotary of 3/4 of the head
        rope = dict(ropes["longrope"], rope_theta=10000.0, partial_rotary_factor=1.0)
        return t.Phi3Config(**sizes, rope_parameters=rope, head_dim=16, original_max_position_embeddings=32)
    if family == "phi3-partial":
        return t.Phi3Config(**sizes, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                      "partial_rotary_factor": 0.5})
    raise ValueError(f"no tiny {family}")


FAMILIES = ("llama", "llama-linear", "llama-dynamic", "llama-yarn", "llama-llama3", "llama-longrope", "llama-bias",
            "mistral", "mistral-window", "qwen2", "qwen2-window", "qwen3", "gemma2", "gemma3", "phi3",
            "phi3-longrope", "phi3-partial")


def tiny_family(family: str, seed: int = 0, vocab_size: int = 128, layers: int = 2) -> torch.nn.Module:
    """A tiny seeded random causal LM of one of FAMILIES (its biases and norms random too, so
    that a forward which skipped one would differ)."""
    from transformers import AutoModelForCausalLM

    config = _family_config(family, vocab_size, layers)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:  # initialised to zeros or ones otherwise
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    return model
