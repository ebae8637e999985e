"""Loading draft and target models: the embedded default, any local transformers
causal-LM directory, and checks that a draft/target pair shares a tokenizer."""

from __future__ import annotations

import functools
import logging
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specd.errors import InvalidRequest, ModelError
from specd.runtime.aot import check_cpu_compile, use_compiled
from specd.runtime.embedded import EMBEDDED_NAME, default_cache_dir, embedded_dir
from specd.runtime.kernels import GEMV_MIN_WEIGHTS, check_kernels, use_kernels
from specd.runtime.arch import unsupported
from specd.runtime.lean import LeanModel, check_forward, choose_forward, supports
from specd.runtime.pool import KVPool, PoolSession
from specd.runtime.session import KVSession, hf_forward

log = logging.getLogger(__name__)

EMBEDDED_ALIASES = ("embedded", EMBEDDED_NAME)


@dataclass
class LoadedModel:
    """A causal LM ready for KV sessions, with what the engine needs to know about it."""

    name: str
    model: torch.nn.Module
    tokenizer: object | None  # a transformers tokenizer; None for id-only test models
    device: torch.device
    max_context: int
    eos_token_ids: frozenset[int]
    forward: str = "auto"  # auto | lean | hf: how KV sessions run the model (specd/runtime/lean.py)
    _lean: LeanModel | None = field(default=None, init=False, repr=False)
    pool: KVPool | None = field(default=None, init=False, repr=False)  # static KV slots, once enabled

    def __post_init__(self) -> None:
        choose_forward(self.model, self.forward, self.device)  # refuses what cannot run

    def forward_kind(self) -> str:
        """lean or hf: what a session opened now runs (the model's dtype and device decide auto)."""
        return choose_forward(self.model, self.forward, self.device)

    @functools.cached_property
    def emitted_vocab(self) -> int:
        """The ids the target may emit: those its tokenizer knows. Embedding tables are padded past
        the tokenizer (Qwen2.5-7B: 152,064 logits for 151,665 tokens), and a padding row's id
        decodes to nothing and may be out of range for a smaller draft's table."""
        n = len(self.tokenizer) if self.tokenizer is not None else self.vocab_size
        return min(n, self.vocab_size)

    def emitted_only(self) -> dict:
        """transformers' generate() arguments that keep it to the emitted ids, as specd's own
        decoding is (the corpus and bench's peer baselines); none where no row is padding."""
        if self.emitted_vocab >= self.vocab_size:
            return {}
        from transformers import LogitsProcessorList
        return {"logits_processor": LogitsProcessorList([_WithinVocab(self.emitted_vocab)])}

    @functools.cached_property
    def vocab_size(self) -> int:  # asked for every verified window: transformers' lookup cost microseconds
        return self.model.get_output_embeddings().weight.shape[0]

    def use_pool(self, slots: int, max_len: int | None = None, graphs: bool = False,
                 compiled: str = "off", cache_dir: Path | None = None,
                 memory_fraction: float | None = None) -> KVPool:
        """From now on open sessions in a preallocated KV pool of `slots` sessions of at most
        `max_len` positions (default the model's context), with forwards captured in CUDA
        graphs when `graphs` (a CUDA model only; `compiled` on: each layer through
        torch.compile, specd.runtime.graphs), or compiled ahead of time for the CPU when
        `compiled` is on (auto: where the model is large enough to gain, specd.runtime.aot).
        memory_fraction: the share of free device memory (of available RAM on the CPU) the pool
        may take; fewer slots where `slots` would not fit (as vLLM's gpu_memory_utilization).
        Needs a model the lean forward supports (specd.runtime.arch)."""
        reason = unsupported(self.model)
        if reason is not None:
            raise InvalidRequest("kv_slots", f"a KV pool cannot run this model: {reason}")
        if graphs and self.device.type != "cuda":
            raise InvalidRequest("cuda_graphs", "CUDA graphs need a CUDA device")
        check_cpu_compile(compiled)
        if compiled == "on" and not graphs and not cpu_compilable(self.model, self.device):
            raise InvalidRequest("cpu_compile", "compiled forwards need a float32 model on the CPU")
        if self._lean is None:
            self._lean = LeanModel(self.model)
        length = min(max_len or self.max_context, self.max_context)
        if memory_fraction is not None:
            slots = slots_that_fit(self.model.config, self._lean.dtype, self.device, slots, length, memory_fraction)
        self.pool = KVPool(self._lean, slots, length)
        self.max_context = self.pool.max_len  # what a session can hold now: prompts and windows are checked on it
        if graphs:
            from specd.runtime.graphs import GraphRunner

            GraphRunner(self.pool, compiled=compiled == "on")
        elif compiled == "on" or (compiled == "auto" and compile_pays(self.model, self.device)):
            use_compiled(self.pool, cache_dir or default_cache_dir(), required=compiled == "on")
        return self.pool

    def session(self) -> KVSession | PoolSession:
        if self.pool is not None:
            return self.pool.session()
        if self.forward_kind() == "lean":
            if self._lean is None:
                self._lean = LeanModel(self.model)
            return KVSession(self._lean.forward, self.device, self._lean.new_cache())
        return KVSession(hf_forward(self.model), self.device)

    def encode_prompt(self, prompt: str | list[dict], chat: bool, tools: list[dict] | None = None) -> list[int]:
        """Token ids of a prompt; chat=True applies the tokenizer's chat template (with tools)."""
        if self.tokenizer is None:
            raise ModelError(f"model {self.name} has no tokenizer")
        return encode_prompt(self.tokenizer, prompt, chat, tools)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else ""


def encode_prompt(tokenizer, prompt: str | list[dict], chat: bool, tools: list[dict] | None = None) -> list[int]:
    """Token ids of a prompt (a string, or chat messages); chat=True applies the chat template,
    which renders tools where given (specd.tools: a template that takes none is refused)."""
    if isinstance(prompt, str) and not prompt.strip():
        raise InvalidRequest("prompt", "must not be empty")
    fmt = None
    if tools:
        from specd.tools import check_template

        fmt = check_template(tokenizer)
    if chat and getattr(tokenizer, "chat_template", None):
        from jinja2 import TemplateError

        from specd.tools import history_for

        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else history_for(prompt, fmt)
        try:
            return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools or None,
                                                      tokenize=True, return_dict=False))
        except TemplateError as e:  # the template's own refusal (e.g. roles out of order)
            raise InvalidRequest("messages", f"the model's chat template refused them: {e}") from None
    if not isinstance(prompt, str):
        raise InvalidRequest("prompt", "this model has no chat template for messages")
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])


SHARD = "shard"  # one process, the model's layers spread over every visible GPU (device_map="auto")


def resolve_device(device: str) -> torch.device:
    """The device inputs go to. "shard" places the layers over all visible GPUs (inputs on
    the first), or on the CPU when there is none."""
    if device in ("auto", SHARD):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise InvalidRequest("device", f"unknown device {device!r} (auto, cpu, cuda, cuda:N, shard)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequest("device", "CUDA was asked for but no GPU is available")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto: float32, on CUDA too. Greedy speculative output is token-identical to the target
    alone only where a window's forward rounds like one-token forwards: measured on an H100
    (embedded pair, 8 MT-bench prompts x 128 tokens) float32 gave 8/8 identical outputs and
    bfloat16 0/8, diverging after 19-71 tokens, because bf16 GEMMs over k+1 rows round
    differently from one row. bfloat16/float16 stay available (half the memory, faster on
    big targets) and are documented as lossless only up to that rounding."""
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype == "auto":
        return torch.float32
    if dtype not in table:
        raise InvalidRequest("dtype", f"unknown dtype {dtype!r} (auto, {', '.join(table)})")
    return table[dtype]


GRAPH_MODES = ("auto", "on", "off", "compiled")
GRAPH_SLOTS = 8  # sessions of the pool load_model opens for CUDA graphs (a service sizes its own)
GRAPH_MEMORY_SHARE = 0.25  # of the free device memory, at most, for that pool
MIN_POOL_LEN = 512


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of keys and values one position of a session holds over every layer."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def free_memory(device: torch.device) -> int:
    """Bytes free on the device now: the GPU's, or the RAM the kernel says is available."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def slots_that_fit(config, dtype: torch.dtype, device: torch.device, slots: int, length: int,
                   fraction: float) -> int:
    """At most `slots` KV slots of `length` positions (and the trash slot and column) in `fraction`
    of the device's free memory; InvalidRequest when not one fits."""
    per_slot = kv_bytes_per_token(config, dtype) * (length + 1)
    budget = int(fraction * free_memory(device))
    fits = budget // per_slot - 1  # the trash slot
    if fits < 1:
        raise InvalidRequest("kv_memory_fraction", f"not one KV slot of {length} positions "
                                                   f"({per_slot / 2**30:.2f} GiB) fits in {fraction:g} of the "
                                                   f"free memory ({budget / 2**30:.2f} GiB): lower kv_max_len")
    if fits < slots:
        log.warning("KV pool: %d slots of %d positions fit in %g of the free memory, not %d", fits, length,
                    fraction, slots)
    return min(slots, fits)


def pool_length(config, dtype: torch.dtype, slots: int, context: int, free_bytes: int) -> int:
    """Positions per slot for a pool of `slots` sessions in GRAPH_MEMORY_SHARE of free_bytes
    (at most the context); 0 when not even MIN_POOL_LEN fit (then sessions grow their own caches)."""
    per_token = kv_bytes_per_token(config, dtype)
    fits = int(GRAPH_MEMORY_SHARE * free_bytes) // (slots * per_token) - 1  # the trash column
    length = min(context, fits)
    return length if length >= MIN_POOL_LEN else 0


def load_model(spec: str, device: str = "auto", dtype: str = "auto", cache_dir: Path | None = None,
               linear_kernels: str = "auto", forward: str = "auto", cuda_graphs: str = "auto",
               tensor_parallel=None, cpu_compile: str = "off") -> LoadedModel:
    """spec: "embedded" (SmolLM2-135M-Instruct) or the path of a local transformers directory.
    device "shard" splits the layers over every visible GPU with accelerate's
    device_map="auto" (pipeline placement in one process: a model too big for one GPU).
    linear_kernels: auto | rows | onednn | torch (specd/runtime/kernels.py; auto runs specd's
    few-row product on a float32 CPU model where it builds, else oneDNN with packed weights).
    forward: auto | lean | hf (specd/runtime/lean.py; auto runs the lean forward on the
    CPU for every family it serves). cuda_graphs: auto | on | off | compiled (auto: on a CUDA device, for a model the lean
    forward supports, sessions open in a KV pool whose forwards are captured in CUDA graphs on
    first use, specd/runtime/graphs.py; compiled: graphs of layers compiled by torch.compile).
    tensor_parallel: this process's specd.runtime.tp.TensorParallel (its share of every layer,
    on its own GPU).
    cpu_compile: auto | on | off (auto: a float32 model the lean forward supports, on the CPU,
    of at least GEMV_MIN_WEIGHTS weights, opens sessions in a KV pool whose forwards are
    compiled ahead of time, specd/runtime/aot.py; the first load compiles, later ones load)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = resolve_device(device)
    if tensor_parallel is not None:
        if device == SHARD:
            raise InvalidRequest("tensor_parallel", "a tensor-parallel target places itself; not with --device shard")
        if dev.type == "cuda":
            dev = torch.device("cuda", tensor_parallel.local_rank)
    torch_dtype = resolve_dtype(dtype, dev)
    check_kernels(linear_kernels)  # before the load: a typo costs no time
    check_forward(forward)
    if cuda_graphs not in GRAPH_MODES:
        raise InvalidRequest("cuda_graphs", f"unknown mode {cuda_graphs!r} ({', '.join(GRAPH_MODES)})")
    check_cpu_compile(cpu_compile)
    name = model_name(spec)
    if spec in EMBEDDED_ALIASES:
        path = embedded_dir(cache_dir)
    else:
        path = Path(spec).expanduser()
        if not (path / "config.json").is_file():
            raise ModelError(f"model path {spec!r} is not a transformers model directory "
                             "(no config.json); nothing is downloaded at run time")
    try:
        if device == SHARD:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, local_files_only=True,
                                                         device_map="auto")
            dev = model.get_input_embeddings().weight.device
        else:  # a tensor-parallel rank shards on the host first: its GPU holds only its share
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, local_files_only=True)
            if tensor_parallel is None:
                model = model.to(dev)
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot load model from {path}: {e}") from e
    model.eval()
    if tensor_parallel is not None:
        from specd.runtime.tp import shard

        if not supports(model):
            raise InvalidRequest("tensor_parallel", f"tensor parallelism cannot run this model: {unsupported(model)}")
        shard(model, tensor_parallel)
        model = model.to(dev)
    use_kernels(model, linear_kernels, cache_dir)
    tokenizer = None
    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    loaded = LoadedModel(name, model, tokenizer, dev, _max_context(model.config), _eos_ids(model, tokenizer),
                         forward)
    if cuda_graphs in ("on", "compiled") or (cuda_graphs == "auto" and dev.type == "cuda" and device != SHARD
                                             and supports(model)):
        free = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else 1 << 40
        length = pool_length(model.config, torch_dtype, GRAPH_SLOTS, loaded.max_context, free)
        if length:
            # on a CPU: a clear error, graphs need CUDA
            loaded.use_pool(GRAPH_SLOTS, length, graphs=True, compiled="on" if cuda_graphs == "compiled" else "off")
        elif cuda_graphs != "auto":
            raise InvalidRequest("cuda_graphs", "too little free device memory for a KV pool")
    elif ((cpu_compile == "on" or (cpu_compile == "auto" and compile_pays(model, dev))) and tensor_parallel is None
          and device != SHARD and loaded.forward_kind() == "lean"):
        loaded.use_pool(GRAPH_SLOTS, loaded.max_context, compiled=cpu_compile, cache_dir=cache_dir)
    elif cpu_compile == "on":
        raise InvalidRequest("cpu_compile", "compiled forwards need the lean forward on one device, "
                                            "without tensor parallelism")
    return loaded


def cpu_compilable(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether a pool of this model can run compiled CPU forwards: float32 on the CPU."""
    weight = model.get_input_embeddings().weight
    return device.type == "cpu" and weight.dtype == torch.float32


def compile_pays(model: torch.nn.Module, device: torch.device) -> bool:
    """cpu_compile auto's rule: a float32 CPU model of at least GEMV_MIN_WEIGHTS weights (a
    test's tiny model gains microseconds and would pay a compilation)."""
    return (cpu_compilable(model, device) and supports(model)
            and sum(p.numel() for p in model.parameters()) >= GEMV_MIN_WEIGHTS)


def model_name(spec: str) -> str:
    """The name load_model gives the model `spec` names (keys bundled drafters), without loading it."""
    return EMBEDDED_NAME if spec in EMBEDDED_ALIASES else Path(spec).expanduser().resolve().name


def _max_context(config) -> int:
    """Positions a session may hold: the model's context, times a dynamic rotary scaling's
    factor (which exists to reach past it)."""
    context = int(getattr(config, "max_position_embeddings", 0) or 2048)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if "dynamic" in str(rope.get("rope_type", "")) and rope.get("factor"):
        context = int(context * float(rope["factor"]))
    return context


def _eos_ids(model, tokenizer) -> frozenset[int]:
    ids = getattr(model.generation_config, "eos_token_id", None)
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return frozenset()
    return frozenset([ids] if isinstance(ids, int) else ids)


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of the vocabulary (token -> id), equal for interchangeable tokenizers."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


class _WithinVocab:
    """A transformers logits processor: scores past the tokenizer's ids at -inf."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores[:, self.vocab:] = float("-inf")
        return scores


def check_pair(draft: LoadedModel, target: LoadedModel) -> None:
    """Refuse a draft/target pair that does not share one tokenizer."""
    if draft.tokenizer is not None and target.tokenizer is not None:
        if tokenizer_fingerprint(draft.tokenizer) != tokenizer_fingerprint(target.tokenizer):
            raise ModelError(f"draft {draft.name} and target {target.name} use different tokenizers; "
                             "speculative decoding needs a shared vocabulary")
    # Embedding tables are often padded past the tokenizer (e.g. Qwen2.5 0.5B vs 14B); ids the
    # tokenizer can produce must exist in both.
    n_tok = len(target.tokenizer) if target.tokenizer is not None else target.vocab_size
    if min(draft.vocab_size, target.vocab_size) < n_tok:
        raise ModelError(f"draft vocab {draft.vocab_size} and target vocab {target.vocab_size} "
                         f"do not both cover the tokenizer's {n_tok} tokens")
