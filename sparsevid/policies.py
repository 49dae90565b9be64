"""Selection policies: at prefill, each layer's statistics -> which prompt KV entries to keep.

A policy is a small dataclass with `window` (how many trailing prompt rows of attention statistics
it needs, 0 for none) and `select(layer, stats, run) -> LayerSelection | None` (None keeps all).
The same policy runs directly (lossy) or as the draft of speculative decoding (lossless).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import LayerStats, Run
from .cache import LayerSelection


def text_positions(run: Run, m: int) -> torch.Tensor:
    """LongTensor [m_t]: every prompt position outside the visual span."""
    mask = torch.ones(m, dtype=torch.bool)
    mask[run.visual_positions] = False
    return mask.nonzero().squeeze(1)


def visual_budget(k: int | float | None, m_v: int, m_t: int, total: int = 1024) -> int:
    """K as a count, as a fraction of m_v (float <= 1), or by default so that K + m_t = total."""
    if k is None:
        k = total - m_t
    elif isinstance(k, float) and k <= 1.0:
        k = round(k * m_v)
    return max(1, min(int(k), m_v))


def uniform_selection(per_head: torch.Tensor) -> LayerSelection:
    """[Hkv, n] prompt positions (any order) -> LayerSelection with sorted rows."""
    return LayerSelection(list(per_head.sort(dim=1).values))


@dataclass
class TopK:
    """StD (SPEC §3.1): per layer and KV head, the K most relevant visual positions + all text.

    k: count, fraction of the visual tokens (float <= 1), or None for the paper's K + m_t = 1024.
    """

    k: int | float | None = None
    window: int = 0
    name: str = "std"

    def select(self, layer: int, stats: LayerStats, run: Run) -> LayerSelection | None:
        m = stats.relevance.shape[1]
        vis = run.visual_positions.to(stats.relevance.device)
        text = text_positions(run, m).to(vis.device)
        K = visual_budget(self.k, len(vis), len(text))
        if K >= len(vis):
            return None
        top = stats.relevance[:, vis].topk(K, dim=1).indices  # [Hkv, K]
        Hkv = top.shape[0]
        return uniform_selection(torch.cat([text.expand(Hkv, -1), vis[top]], dim=1))


@dataclass
class Streaming:
    """StreamingLLM-style draft: the first `sinks` prompt positions + the most recent ones, with the
    same total budget as StD (K + m_t entries per KV head), whatever their relevance."""

    k: int | float | None = None
    sinks: int = 4
    window: int = 0
    name: str = "streaming"

    def select(self, layer: int, stats: LayerStats, run: Run) -> LayerSelection | None:
        m = stats.relevance.shape[1]
        m_v = len(run.visual_positions)
        total = visual_budget(self.k, m_v, m - m_v) + (m - m_v)
        if total >= m:
            return None
        sinks = min(self.sinks, total)
        keep = torch.cat([torch.arange(sinks), torch.arange(m - (total - sinks), m)])
        return uniform_selection(keep.expand(stats.relevance.shape[0], -1))
