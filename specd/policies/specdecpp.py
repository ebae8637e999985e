"""specdec++: a learned acceptance-prediction head decides when to stop (SpecDec++,
Huang et al. 2024).

A small residual MLP on the draft model's last hidden state predicts the probability
that the token drafted from it will be accepted, a_i = sigmoid(head(h_i)). Drafting stops
once the probability that at least one token of the window is rejected exceeds h:

    1 - prod_{j <= i} a_j > h          (never before `min_draft` tokens)

The head is trained offline (specd.training.specdecpp, `specd train-head`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from specd.errors import InvalidRequest, ModelError
from specd.policies.base import Decision, PolicyParams, PolicyResources, StoppingPolicy, bounded
from specd.types import DraftStep


# Heads shipped with specd, by the name of the drafter whose hidden states they were trained on.
_DATA = Path(__file__).resolve().parent.parent / "data"
BUNDLED_HEADS = {
    "smollm2-135m-instruct:early-exit-4": _DATA / "specdecpp-smollm2-early-exit-4.safetensors",  # untrained
    # the bundled trained adapter (`specd train-head --prompts P --limit 40`, P: 40 of the
    # training templates, specd.training.corpus.template_prompts(1)[:40])
    "smollm2-135m-instruct:early-exit-4+smollm2-ee4-layer-v8k":
        _DATA / "specdecpp-smollm2-early-exit-4-ee4-layer-v8k.safetensors",
}


def bundled_head_path(drafter_name: str) -> Path | None:
    """The bundled head trained for this drafter, if specd ships one."""
    return BUNDLED_HEADS.get(drafter_name)


class AcceptanceHead(nn.Module):
    """D residual blocks h <- h + W2 silu(W1 norm(h)) on the draft hidden state, then a
    linear map to one logit of acceptance."""

    def __init__(self, hidden_size: int, depth: int = 3, width: int | None = None):
        super().__init__()
        width = width or hidden_size
        self.config = {"hidden_size": hidden_size, "depth": depth, "width": width}
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(hidden_size), nn.Linear(hidden_size, width), nn.SiLU(),
                          nn.Linear(width, hidden_size))
            for _ in range(depth))
        self.out = nn.Linear(hidden_size, 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> acceptance logit [...]."""
        h = hidden.float()
        for block in self.blocks:
            h = h + block(h)
        return self.out(h).squeeze(-1)

    def save(self, path: str | Path) -> None:
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(path),
                  metadata={"specd": "specdec++-head", "config": json.dumps(self.config)})

    @classmethod
    def load(cls, path: str | Path) -> "AcceptanceHead":
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise ModelError(f"specdec++ head file not found: {path}")
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        if meta.get("specd") != "specdec++-head":
            raise ModelError(f"{path} is not a specdec++ head file")
        head = cls(**json.loads(meta["config"]))
        try:
            head.load_state_dict(load_file(str(path)))
        except RuntimeError as e:
            raise ModelError(f"{path} is a damaged specdec++ head: {e}") from e
        return head.eval()


@dataclass(frozen=True)
class SpecDecPPParams(PolicyParams):
    max_draft_tokens: int = bounded(20, 1, 256, "hard cap on tokens drafted per round")
    h: float = bounded(0.7, 0.0, 1.0, "stop when P(some token of the window is rejected) > h")
    min_draft: int = bounded(2, 1, 256, "never stop before this many tokens")


class SpecDecPPPolicy(StoppingPolicy):
    name = "specdec++"
    Params = SpecDecPPParams
    needs_hidden = True

    def __init__(self, params: PolicyParams, state: dict[str, float] | None = None,
                 resources: PolicyResources | None = None):
        super().__init__(params, state, resources)
        self.head = self.resources.specdecpp_head
        if self.head is None:
            raise InvalidRequest("policy", "specdec++ needs a trained head (--specdecpp-head PATH; "
                                           "make one with `specd train-head`)")
        self.hidden_size = self.head.config["hidden_size"]

    def begin_round(self) -> None:
        self.p_all_accepted = 1.0

    @torch.inference_mode()
    def decide(self, step: DraftStep) -> Decision:
        if step.hidden is None:
            raise InvalidRequest("drafter", "specdec++ needs a model drafter with hidden states")
        if step.hidden.shape[-1] != self.hidden_size:
            raise InvalidRequest("specdecpp_head", f"the head expects hidden size {self.hidden_size}, "
                                                   f"the drafter has {step.hidden.shape[-1]}")
        self.p_all_accepted *= float(torch.sigmoid(self.head(step.hidden)))
        if step.index >= self.params.min_draft and 1.0 - self.p_all_accepted > self.params.h:
            return Decision.STOP
        return Decision.CONTINUE
