"""A Llama checkpoint re-expressed exactly in another family's layout (a test fixture).

relayout(src, dst, "qwen2") writes the same weights as a Qwen2 checkpoint: Qwen2Config built
from the Llama config's fields, q/k/v projections with biases that are all zeros, no sliding
window. relayout(src, dst, "mistral") writes a Mistral checkpoint with sliding_window=None.
Either computes the Llama original's function, so its outputs must equal the original's.

    python -m tests.relayout SRC DST qwen2|mistral
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

FAMILIES = ("qwen2", "mistral")
# Tokenizer and generation files copied as they are (the weights and config.json are rewritten).
COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
          "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json")
# Llama config fields both target configs take under the same name and meaning.
SHARED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "hidden_act", "max_position_embeddings", "initializer_range",
          "rms_norm_eps", "use_cache", "tie_word_embeddings", "attention_dropout", "pad_token_id",
          "bos_token_id", "eos_token_id")


def _config(llama, family: str):
    from transformers import MistralConfig, Qwen2Config

    if getattr(llama, "attention_bias", False) or getattr(llama, "mlp_bias", False):
        raise ValueError("the source has attention or MLP biases: not a plain Llama layout")
    if getattr(llama, "pretraining_tp", 1) != 1:
        raise ValueError(f"pretraining_tp {llama.pretraining_tp}")
    fields = {k: getattr(llama, k) for k in SHARED if hasattr(llama, k)}
    rope = getattr(llama, "rope_parameters", None)
    if rope is not None:
        fields["rope_parameters"] = dict(rope)
    head_dim = getattr(llama, "head_dim", None) or llama.hidden_size // llama.num_attention_heads
    if family == "qwen2":
        if head_dim != llama.hidden_size // llama.num_attention_heads:
            raise ValueError(f"head_dim {head_dim} != hidden_size / heads: Qwen2 cannot express it")
        cfg = Qwen2Config(**fields, use_sliding_window=False, sliding_window=None,
                          max_window_layers=llama.num_hidden_layers)
    elif family == "mistral":
        cfg = MistralConfig(**fields, head_dim=head_dim, sliding_window=None)
    else:
        raise ValueError(f"unknown family {family!r} ({', '.join(FAMILIES)})")
    cfg.dtype = getattr(llama, "dtype", None) or "float32"
    return cfg


def relayout(src_dir, dst_dir, family: str) -> Path:
    """Write the Llama checkpoint in src_dir as a `family` checkpoint in dst_dir; returns dst_dir."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM

    src, dst = Path(src_dir), Path(dst_dir)
    llama_cfg = AutoConfig.from_pretrained(src, local_files_only=True)
    if llama_cfg.model_type != "llama":
        raise ValueError(f"{src}: model type {llama_cfg.model_type!r}, not llama")
    cfg = _config(llama_cfg, family)
    source = LlamaForCausalLM.from_pretrained(src, dtype=torch.float32, local_files_only=True)
    state = source.state_dict()
    dtype = source.get_input_embeddings().weight.dtype
    del source
    if family == "qwen2":
        for i in range(cfg.num_hidden_layers):
            prefix = f"model.layers.{i}.self_attn."
            for proj in ("q_proj", "k_proj", "v_proj"):
                rows = state[prefix + proj + ".weight"].shape[0]
                state[prefix + proj + ".bias"] = torch.zeros(rows, dtype=dtype)
    cls = Qwen2ForCausalLM if family == "qwen2" else MistralForCausalLM
    model = cls._from_config(cfg, dtype=dtype) if hasattr(cls, "_from_config") else cls(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # A tied lm_head is absent from a tied checkpoint's state dict only when tying drops it.
    missing = [k for k in missing if not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    dst.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dst, safe_serialization=True)
    for name in COPIED:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    return dst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.relayout", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="a transformers Llama checkpoint directory")
    parser.add_argument("dst", help="where to write the re-expressed checkpoint")
    parser.add_argument("family", choices=FAMILIES)
    args = parser.parse_args(argv)
    out = relayout(args.src, args.dst, args.family)
    config = json.loads((out / "config.json").read_text())
    print(json.dumps({"family": args.family, "dir": str(out), "model_type": config["model_type"],
                      "architectures": config.get("architectures"),
                      "files": sorted(p.name for p in out.iterdir())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
