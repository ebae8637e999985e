"""hf: a separate, smaller transformers model drafts (the classic setup, e.g.
Qwen2.5-0.5B drafting for Qwen2.5-14B). It must share the target's tokenizer."""

from __future__ import annotations

from specd.drafters.base import Drafter, ModelDraftSession
from specd.runtime.loading import LoadedModel, check_pair


class HfDrafter(Drafter):
    kind = "hf"

    def __init__(self, draft: LoadedModel, target: LoadedModel):
        check_pair(draft, target)
        self.draft = draft
        self.vocab_size = target.vocab_size
        self.emitted = min(draft.emitted_vocab, target.emitted_vocab)  # one tokenizer (check_pair)

    @property
    def name(self) -> str:
        return self.draft.name

    def open(self, vocab_size: int | None = None) -> ModelDraftSession:
        return ModelDraftSession(self.draft.session(), vocab_size or self.vocab_size, self.emitted)
