"""The inference runtime: loading (embedded GGUF, local transformers directories, tiny test
models), the forwards and the KV memory they use (README.md lists the forward paths)."""

from specd.runtime.loading import LoadedModel, load_model, check_pair
from specd.runtime.session import KVSession

__all__ = ["KVSession", "LoadedModel", "check_pair", "load_model"]
