"""Tiny seeded random Llama models (and a character-level tokenizer) for tests.

Weights are drawn with a large initializer range so that next-token distributions are
peaked: near-ties between logits would make greedy equality depend on float round-off
rather than on the algorithm.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch

from specd.models.kernels import use_kernels
from specd.models.loading import LoadedModel

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
                       model.config.max_position_embeddings, frozenset([eos] if eos is not None else []), forward)


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


def save_tiny(path: str | Path, seed: int = 0, model: torch.nn.Module | None = None, **config) -> Path:
    """Write a tiny model + tokenizer directory loadable by specd.models.load_model."""
    path = Path(path)
    model = model if model is not None else tiny_llama(seed, **config)
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path
