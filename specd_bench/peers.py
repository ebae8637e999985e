"""Peer baselines from transformers (and llama.cpp, specd_bench.llama_cpp), timed like our runs
(time.perf_counter around the call).

- hf-ar: generate() alone, transformers' own target-only decoding (what the runtime is worth
  before any speculation: specd's `ar` runs the same model through specd's forward);
- hf-prompt-lookup: generate(prompt_lookup_num_tokens=10) (Saxena 2023);
- hf-assisted: generate(assistant_model=draft) with transformers' defaults (a constant window of
  20 drafts, confidence threshold 0.4);
- hf-heuristic: the same with num_assistant_tokens_schedule="heuristic" (K += 2 after a fully
  accepted window, else K -= 1) and the dynamic confidence threshold
  (assistant_confidence_threshold, re-fitted from an ROC curve; transformers only adapts it
  when scikit-learn is installed, which results.json records).
Assisted peers use the separate draft model (--drafter hf --draft-model) or, for the
early-exit drafter, a transformers model that is that drafter: the target's own first k layers
(and the adapter's extra layer), norm, adapter and head over the drafter's vocabulary;
otherwise they are skipped with a reason.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Sequence

import torch

from specd_bench import llama_cpp
from specd.runtime.loading import LoadedModel
from specd.types import SamplingParams

PEERS = ("hf-ar", "hf-prompt-lookup", "hf-assisted", "hf-heuristic", *llama_cpp.LLAMA_PEERS)
BASELINES = ("ar", *PEERS)

# The assistant's generation-config fields each assisted peer starts from; transformers mutates
# them during generate, so each peer keeps its own copy across calls (heuristic K persists, as
# transformers intends, without leaking into the other peer).
_ASSISTANT_FIELDS = {
    "hf-assisted": {"num_assistant_tokens": 20, "num_assistant_tokens_schedule": "constant",
                    "assistant_confidence_threshold": 0.4},
    "hf-heuristic": {"num_assistant_tokens": 20, "num_assistant_tokens_schedule": "heuristic",
                     "assistant_confidence_threshold": 0.4},
}


def sklearn_available() -> bool:
    return importlib.util.find_spec("sklearn") is not None


def skip_reason(peer: str, draft_model: LoadedModel | None, target: LoadedModel | None = None) -> str | None:
    """Why a peer cannot run with these models, or None."""
    if peer in _ASSISTANT_FIELDS and draft_model is None:
        return "needs a separate draft model (--drafter hf --draft-model DIR) or the early-exit drafter"
    if peer in llama_cpp.LLAMA_PEERS:
        return llama_cpp.skip_reason(target)
    return None


def early_exit_assistant(drafter) -> LoadedModel:
    """The early-exit drafter as a transformers model sharing its modules, for assisted
    generation: the same layers (the `layer` adapter's extra one included, so the assistant's
    cache has a slot for it), and a head that applies the adapter and the drafter's vocabulary
    (-inf outside a reduced one), so its logits are the drafter's."""
    import copy

    from transformers import AutoModelForCausalLM

    target = drafter.target
    config = copy.deepcopy(target.model.config)
    config.num_hidden_layers = len(drafter.decoder.layers)
    with torch.device("meta"):
        shallow = AutoModelForCausalLM.from_config(config)
    shallow.model = drafter.decoder
    shallow.lm_head = _DraftHead(drafter)
    shallow.generation_config = copy.deepcopy(target.model.generation_config)
    shallow.eval()
    return LoadedModel(drafter.name, shallow, target.tokenizer, target.device, target.max_context,
                       target.eos_token_ids)


class _DraftHead(torch.nn.Module):
    """The early-exit drafter's adapter and head as the assistant's lm_head."""

    def __init__(self, drafter):
        super().__init__()
        self.drafter = drafter  # a plain object, not a submodule: the weights stay the drafter's

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.drafter.head_logits(h)[0]


class PeerRunner:
    """Runs one peer's generate() per prompt; holds the assisted peers' persistent settings."""

    def __init__(self, target: LoadedModel, draft_model: LoadedModel | None, cache_dir=None):
        self.target, self.draft_model = target, draft_model
        self.assistant_state = {k: dict(v) for k, v in _ASSISTANT_FIELDS.items()}
        self.llama = llama_cpp.LlamaCppPeers(target, cache_dir)  # loads a model on first use only

    def generate(self, peer: str, prompt: Sequence[int], sampling: SamplingParams) -> tuple[list[int], float]:
        """(new token ids, wall seconds)."""
        if peer in llama_cpp.LLAMA_PEERS:
            ids, wall = self.llama.generate(peer, prompt, sampling)
            return self._strip(ids), wall
        model = self.target.model
        kwargs = self._sampling_kwargs(sampling) | self.target.emitted_only()  # as specd's target
        if peer == "hf-prompt-lookup":
            kwargs["prompt_lookup_num_tokens"] = 10
        elif peer in _ASSISTANT_FIELDS:
            kwargs["assistant_model"] = self._assistant(peer)
        input_ids = torch.tensor([list(prompt)], dtype=torch.long, device=self.target.device)
        if not sampling.greedy:
            torch.manual_seed(sampling.seed if sampling.seed is not None else 0)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
        wall = time.perf_counter() - t0
        if peer in _ASSISTANT_FIELDS:
            self._save_assistant(peer)
        return self._strip(out[0, len(prompt):].tolist()), wall

    def _sampling_kwargs(self, sampling: SamplingParams) -> dict:
        eos = sorted(self.target.eos_token_ids)
        pad = self.target.model.generation_config.pad_token_id
        kwargs = {"max_new_tokens": sampling.max_new_tokens, "eos_token_id": eos or None,
                  "pad_token_id": pad if pad is not None else (eos[0] if eos else 0)}
        if sampling.greedy:
            return {**kwargs, "do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        return {**kwargs, "do_sample": True, "temperature": sampling.temperature,
                "top_p": sampling.top_p, "top_k": sampling.top_k or None}

    def _assistant(self, peer: str) -> torch.nn.Module:
        assistant = self.draft_model.model
        for name, value in self.assistant_state[peer].items():
            setattr(assistant.generation_config, name, value)
        return assistant

    def _save_assistant(self, peer: str) -> None:
        config = self.draft_model.model.generation_config
        self.assistant_state[peer] = {name: getattr(config, name) for name in self.assistant_state[peer]}

    def _strip(self, ids: list[int]) -> list[int]:
        """Cut after the first EOS (generate pads finished rows), keeping the EOS like our engine."""
        for i, tok in enumerate(ids):
            if tok in self.target.eos_token_ids:
                return ids[:i + 1]
        return ids
