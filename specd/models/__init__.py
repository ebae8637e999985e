"""Models: loading (embedded GGUF, local transformers directories, tiny test models) and
KV-cached sessions with rollback."""

from specd.models.loading import LoadedModel, load_model, check_pair
from specd.models.session import KVSession

__all__ = ["KVSession", "LoadedModel", "check_pair", "load_model"]
