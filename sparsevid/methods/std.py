"""StD, Sparse-to-Dense speculative decoding (Zhang et al., "Sparse-to-Dense: A Free Lunch
for Lossless Acceleration of Video Understanding in LLMs", arXiv:2505.19155).

The draft is the model itself attending, per layer and KV head, only to the K visual positions the
question attends to most (plus every text position and every generated token), chosen once at
prefill; dense verifies γ draft tokens in one pass, so the output is dense's (lossless).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import LayerStats
from ..cache import LayerSelection, Prompt
from .base import K_OPTION, Method, text_positions, uniform_selection, visual_budget


@dataclass
class TopK:
    """Per layer and KV head: the K visual positions of highest relevance + all text positions.

    k: a count, a fraction of the visual tokens (float), or None for the paper's K + m_t = 1024.
    """

    k: int | float | None = K_OPTION
    stats = ("relevance",)
    window = 0

    def selects(self, layer: int, prompt: Prompt) -> bool:
        """Only where K leaves visual tokens out: else the draft is dense and the prefill computes no
        relevance for it (a 16-frame clip's 288 visual tokens under the default K = 1024 - m_t)."""
        return visual_budget(self.k, prompt.m_v, prompt.m_t) < prompt.m_v

    def select(self, layer: int, stats: LayerStats, prompt: Prompt) -> LayerSelection | None:
        """relevance [Hkv, m] -> Hkv rows of K + m_t sorted prompt positions (None: keeps all)."""
        if not self.selects(layer, prompt):  # K keeps every visual token: the draft is dense
            return None
        vis = prompt.visual_positions.to(stats.relevance.device)
        text = text_positions(prompt).to(vis.device)
        K = visual_budget(self.k, prompt.m_v, prompt.m_t)
        top = stats.relevance[:, vis].topk(K, dim=1).indices  # [Hkv, K]
        return uniform_selection(torch.cat([text.expand(top.shape[0], -1), vis[top]], dim=1))


METHODS = [Method("std", "StD (top-K draft)", "speculative", TopK, paper="arXiv:2505.19155")]
