"""Drafters (DESIGN.md §2): hf, early-exit and ngram, and the registry that builds them."""

from __future__ import annotations

from pathlib import Path

from specd.drafters.base import Drafter, DraftSession, DraftToken
from specd.drafters.early_exit import NO_ADAPTER, EarlyExitDrafter, bundled_adapter_path
from specd.drafters.feature import FeatureDrafter
from specd.drafters.hf import HfDrafter
from specd.drafters.ngram import NgramDrafter
from specd.errors import InvalidRequest
from specd.models.loading import LoadedModel

DRAFTERS = ("hf", "early-exit", "ngram", "feature")


def build_drafter(kind: str, target: LoadedModel, draft_model: LoadedModel | None = None,
                  draft_layers: int = 4, adapter_path: str | Path | None = None) -> Drafter:
    if kind == "hf":
        if draft_model is None:
            raise InvalidRequest("draft_model", "the hf drafter needs a draft model directory")
        return HfDrafter(draft_model, target)
    if kind == "early-exit":
        # No adapter named: the one specd ships for this target and depth, if any; "none": untrained.
        if adapter_path is None:
            adapter_path = bundled_adapter_path(target.name, draft_layers)
        elif str(adapter_path) == NO_ADAPTER:
            adapter_path = None
        return EarlyExitDrafter(target, draft_layers, adapter_path)
    if kind == "ngram":
        return NgramDrafter()
    if kind == "feature":  # adapter_path: the trained head (specd train-drafter --kind feature)
        return FeatureDrafter(target, None if str(adapter_path) == NO_ADAPTER else adapter_path)
    raise InvalidRequest("drafter", f"unknown drafter {kind!r}; choose one of {', '.join(DRAFTERS)}")


__all__ = ["DRAFTERS", "DraftSession", "DraftToken", "Drafter", "EarlyExitDrafter", "FeatureDrafter", "HfDrafter",
           "NgramDrafter", "build_drafter"]
