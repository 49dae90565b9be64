"""What every method shares: its registry entry, the speculative options, and selection helpers.

A policy is a small dataclass whose option fields are its settings (`sparsevid.options`) and which
turns one layer's prefill statistics into a `LayerSelection` (`select`). It says which statistics it
needs (`stats`: "relevance", "window", "query_norms"; `window`: SnapKV rows; or `needs(prompt)` giving
both, where they depend on the prompt), so prefill computes nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import LayerSelection, Prompt
from ..options import Option, option, options_of


@dataclass
class Speculative:
    """Options of every draft verified by dense (the StD paper): γ (the most draft tokens per round),
    the draft-cache refresh, and whether γ adapts per round to the measured costs."""

    gamma: int = option(9, "draft tokens per round", "int", label="γ: draft tokens per round", min=1, max=32,
                        unit="tokens")
    refresh: bool = option(True, "after each round, replace the accepted tokens' KV in the draft cache by dense's",
                           "bool", label="Refresh the draft cache with dense KV of accepted tokens")
    adaptive_gamma: bool = option(True, "choose each round's γ (0 to gamma; 0 = a plain dense step) from the run's "
                                  "measured step costs and acceptance; off: always gamma (greedy answers are "
                                  "identical either way; sampled answers repeat for a seed only with it off, "
                                  "since γ follows timings)", "bool",
                                  label="Adaptive γ (never slower than dense by design)")


# One visual budget for StD and Streaming (the same key, so both read one setting).
K_OPTION = option(None, "visual tokens kept per KV head: a count (e.g. 288) or a fraction of the visual tokens "
                        "(e.g. 0.25); blank: K + text = 1024, the paper's setting", "amount",
                  key="k", label="K: visual tokens kept per KV head", min=1, unit="tokens")


@dataclass(frozen=True)
class Method:
    """A registry entry. kind: "dense" | "direct" (the policy runs alone: lossy) | "speculative"
    (the config is a draft verified by dense: lossless). config: the dataclass of its settings."""

    name: str
    label: str
    kind: str
    config: type | None = None
    paper: str = ""

    @property
    def lossless(self) -> bool:
        return self.kind != "direct"

    def options(self) -> list[Option]:
        opts = [o for _, o in options_of(self.config)] if self.config is not None else []
        if self.kind == "speculative":
            opts += [o for _, o in options_of(Speculative)]
        return opts


def text_positions(prompt: Prompt) -> torch.Tensor:
    """LongTensor [m_t]: every prompt position outside the visual span."""
    mask = torch.ones(prompt.m, dtype=torch.bool)
    mask[prompt.visual_positions.cpu()] = False
    return mask.nonzero().squeeze(1)


def visual_budget(k: int | float | None, m_v: int, m_t: int, total: int = 1024) -> int:
    """K as a count, as a fraction of m_v (float), or by default so that K + m_t = total; within [1, m_v]."""
    if k is None:
        k = total - m_t
    elif isinstance(k, float):
        k = round(k * m_v)
    return max(1, min(int(k), m_v))


def uniform_selection(per_head: torch.Tensor) -> LayerSelection:
    """[Hkv, n] prompt positions (any order) -> LayerSelection with sorted rows."""
    return LayerSelection(list(per_head.sort(dim=1).values))
