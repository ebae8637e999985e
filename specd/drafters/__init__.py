"""Drafters (docs/engine.md): hf, early-exit, ngram, retrieval, feature and hybrid, and the registry that
builds them."""

from __future__ import annotations

from pathlib import Path

from specd.drafters.base import Drafter, DraftSession, DraftToken
from specd.drafters.datastore import Datastore, bundled_datastore_path
from specd.drafters.early_exit import NO_ADAPTER, EarlyExitDrafter, bundled_adapter_path
from specd.drafters.feature import FeatureDrafter
from specd.drafters.hf import HfDrafter
from specd.drafters.hybrid import HybridDrafter
from specd.drafters.ngram import NgramDrafter, RetrievalDrafter
from specd.errors import InvalidRequest
from specd.runtime.loading import LoadedModel

DRAFTERS = ("hf", "early-exit", "ngram", "retrieval", "feature", "hybrid")
MODEL_FREE = ("ngram", "retrieval")  # no distribution, no hidden states: nothing to teacher-force


def default_drafter(target_name: str) -> str:
    """The drafter used when none is named: retrieval where specd ships a datastore for the
    target (the embedded one; docs/benchmarks.md), else ngram."""
    return "retrieval" if bundled_datastore_path(target_name) is not None else "ngram"


def build_drafter(kind: str, target: LoadedModel, draft_model: LoadedModel | None = None,
                  draft_layers: int = 4, adapter_path: str | Path | None = None,
                  datastore: str | Path | None = None, target_name: str | None = None) -> Drafter:
    """datastore: retrieval's (default: the one bundled for the target); target_name: whose
    bundled datastore to use when no target model is loaded (the draft service)."""
    if kind == "hf":
        if draft_model is None:
            raise InvalidRequest("draft_model", "the hf drafter needs a draft model directory")
        return HfDrafter(draft_model, target)
    if kind == "early-exit":
        return _early_exit(target, draft_layers, adapter_path)
    if kind == "ngram":
        return NgramDrafter()
    if kind == "retrieval":
        return _retrieval(target, datastore, target_name)
    if kind == "hybrid":  # early-exit's chain, retrieval's proposal beside it in a draft tree
        return HybridDrafter(_early_exit(target, draft_layers, adapter_path),
                             _retrieval(target, datastore, None))
    if kind == "feature":  # adapter_path: the trained head (specd train-drafter --kind feature)
        return FeatureDrafter(target, None if str(adapter_path) == NO_ADAPTER else adapter_path)
    raise InvalidRequest("drafter", f"unknown drafter {kind!r}; choose one of {', '.join(DRAFTERS)}")


def _early_exit(target: LoadedModel, draft_layers: int, adapter_path: str | Path | None) -> EarlyExitDrafter:
    # No adapter named: the one specd ships for this target and depth, if any; "none": untrained.
    if adapter_path is None:
        adapter_path = bundled_adapter_path(target.name, draft_layers)
    elif str(adapter_path) == NO_ADAPTER:
        adapter_path = None
    return EarlyExitDrafter(target, draft_layers, adapter_path)


def _retrieval(target: LoadedModel | None, datastore: str | Path | None,
               target_name: str | None) -> RetrievalDrafter:
    """datastore: specd train-drafter --kind datastore; default: the one bundled for the target."""
    name = target.name if target is not None else target_name
    if datastore is None:
        datastore = bundled_datastore_path(name) if name else None
        if datastore is None:
            raise InvalidRequest("datastore", f"no datastore is bundled for target {name!r}; build one "
                                              "with `specd train-drafter --kind datastore` and name it")
    vocab = target.model.config.vocab_size if target is not None else None
    return RetrievalDrafter(Datastore.load(datastore, vocab))


__all__ = ["DRAFTERS", "MODEL_FREE", "Datastore", "DraftSession", "DraftToken", "Drafter", "EarlyExitDrafter",
           "FeatureDrafter", "HfDrafter", "HybridDrafter", "NgramDrafter", "RetrievalDrafter", "build_drafter",
           "default_drafter"]
