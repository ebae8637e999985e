"""llama.cpp as a peer in `specd bench` (`--baselines llama-cpp,llama-cpp-lookup`).

The embedded target is SmolLM2-135M shipped as a Q4_1 GGUF, which specd dequantizes to the
precision it runs. The peers run that same file, requantized by llama.cpp itself to that precision
(float32 by default: ALL_F32, so both engines multiply the same numbers), through
llama-cpp-python:

- llama-cpp: `Llama.generate`, llama.cpp's target-only decoding;
- llama-cpp-lookup: the same with its prompt-lookup decoding (`LlamaPromptLookupDecoding`, 10
  tokens a window, as hf-prompt-lookup).

Each run is timed like ours: `time.perf_counter` around the request, the prompt's prefill
included, from an empty KV cache (no prefix reused from an earlier prompt), with as many threads
as torch uses. llama-cpp-python is an optional extra (`pip install '.[llama]'`, which builds
llama.cpp from source); without it, the peers are skipped with a one-line reason.

The context: CONTEXT tokens, or more where a prompt and its new tokens need it (the peer is
loaded again, untimed, with a context that fits), never past the target's own: there a run stops
at the context's end, as specd's engine does. llama-cpp-python sizes the logits it keeps from
`logits_all` as passed, while prompt lookup evaluates with logits for every position whatever
was passed: so the lookup peer passes logits_all=True, or a prompt and answer past `n_batch`
(512) tokens die in `Llama.eval` ("could not broadcast input array from shape (N,) into shape
(0,)").
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from specd.runtime.embedded import EMBEDDED_NAME, default_cache_dir, gguf_path
from specd.runtime.loading import LoadedModel
from specd.types import SamplingParams

LLAMA_PEERS = ("llama-cpp", "llama-cpp-lookup")
LOOKUP_TOKENS = 10
CONTEXT = 4096  # llama.cpp's context for the peers at least (with lookup it keeps logits for every position)
CONTEXT_STEP = 1024  # a larger context is a multiple of this
# torch dtype -> (llama_ftype, file tag): what the requantized GGUF holds
FTYPES = {torch.float32: (0, "f32"), torch.float16: (1, "f16"), torch.bfloat16: (32, "bf16")}


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def skip_reason(target: LoadedModel) -> str | None:
    """Why the llama.cpp peers cannot run against this target, or None."""
    if not available():
        return "llama-cpp-python is not installed (pip install '.[llama]' builds llama.cpp from source)"
    if target.name != EMBEDDED_NAME:
        return "the llama.cpp peers run the embedded GGUF target only"
    if target.device.type != "cpu":
        return "the llama.cpp peers run on the CPU (this build of llama-cpp-python)"
    if target_dtype(target) not in FTYPES:
        return f"llama.cpp has no {target_dtype(target)} file type"
    return None


def target_dtype(target: LoadedModel) -> torch.dtype:
    return next(target.model.parameters()).dtype


def context_size(prompt_tokens: int, max_new_tokens: int, limit: int, loaded: int = 0) -> int:
    """The llama.cpp context a run needs: the one loaded or CONTEXT where the prompt and its new
    tokens fit, else their length rounded up to CONTEXT_STEP; never past the target's context
    `limit`. A prompt that leaves no room for a new token is refused (ValueError)."""
    if prompt_tokens >= limit:
        raise ValueError(f"the prompt is {prompt_tokens} tokens; the target's context is {limit} "
                         "and at least one token must be generated")
    size = max(loaded, min(CONTEXT, limit))
    need = prompt_tokens + max_new_tokens
    return size if need <= size else min(limit, -(-need // CONTEXT_STEP) * CONTEXT_STEP)


def requantized(dtype: torch.dtype, cache_dir: Path | None = None) -> Path:
    """The embedded GGUF requantized by llama.cpp to `dtype` (made once, cached beside specd's
    own dequantized copy)."""
    import llama_cpp

    ftype, tag = FTYPES[dtype]
    src = gguf_path()
    out = (cache_dir or default_cache_dir()) / f"{EMBEDDED_NAME}-{src.stat().st_size}-{tag}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True  # the source is Q4_1: dequantized, then stored as `tag`
    params.nthread = torch.get_num_threads()
    if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp could not requantize {src} to {tag}")
    tmp.replace(out)
    return out


class LlamaCppPeers:
    """The two llama.cpp peers over one requantized file, loaded on first use."""

    def __init__(self, target: LoadedModel, cache_dir: Path | None = None):
        self.target, self.cache_dir = target, cache_dir
        self.models: dict[str, object] = {}
        self.contexts: dict[str, int] = {}  # peer -> the context its model was loaded with

    def _model(self, peer: str, n_ctx: int):
        """The peer's model with a context of at least n_ctx (loaded again, larger, when short)."""
        if self.contexts.get(peer, 0) < n_ctx:
            from llama_cpp import Llama
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            old = self.models.pop(peer, None)
            if old is not None:
                old.close()
            draft = LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS) if peer == "llama-cpp-lookup" else None
            threads = torch.get_num_threads()
            # logits_all: the logits buffer for every position lookup evaluates (module docstring)
            self.models[peer] = Llama(str(requantized(target_dtype(self.target), self.cache_dir)),
                                      n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                      draft_model=draft, logits_all=draft is not None, verbose=False)
            self.contexts[peer] = n_ctx
        return self.models[peer]

    def generate(self, peer: str, prompt: Sequence[int], sampling: SamplingParams) -> tuple[list[int], float]:
        """(new token ids up to and including an EOS, wall seconds)."""
        n_ctx = context_size(len(prompt), sampling.max_new_tokens, self.target.max_context, self.contexts.get(peer, 0))
        llm = self._model(peer, n_ctx)
        # as specd's engine, stop at the context's end (only where the target's own is too short)
        max_new = min(sampling.max_new_tokens, min(self.contexts[peer], llm.n_ctx()) - len(prompt))
        eos, out = self.target.eos_token_ids, []
        if sampling.seed is not None:
            llm.set_seed(sampling.seed)
        llm.reset()  # an empty cache: nothing reused from the previous prompt
        t0 = time.perf_counter()
        # temp 0 is llama.cpp's greedy sampler; min_p and top_k off, as specd samples.
        for token in llm.generate(list(prompt), temp=sampling.temperature, top_k=sampling.top_k,
                                  top_p=sampling.top_p, min_p=0.0, repeat_penalty=1.0):
            out.append(int(token))
            if token in eos or len(out) >= max_new:
                break
        return out, time.perf_counter() - t0
