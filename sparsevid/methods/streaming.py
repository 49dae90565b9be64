"""Streaming draft (StreamingLLM: Xiao et al., "Efficient Streaming
Language Models with Attention Sinks", arXiv:2309.17453).

The draft keeps the first `sinks` prompt positions and the most recent ones, the same total
budget as StD (K + m_t entries per KV head), whatever the question attends to: the baseline that
shows what query-guided selection adds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import LayerStats
from ..cache import LayerSelection, Prompt
from ..options import option
from .base import K_OPTION, Method, uniform_selection, visual_budget


@dataclass
class Streaming:
    """Attention sinks + recent window, K + m_t entries per KV head; needs no prefill statistics."""

    k: int | float | None = K_OPTION
    sinks: int = option(4, "attention-sink tokens kept at the start of the prompt", "int",
                        label="Streaming: attention-sink tokens", min=0, max=64, unit="tokens")
    stats = ()
    window = 0

    def select(self, layer: int, stats: LayerStats, prompt: Prompt) -> LayerSelection | None:
        """-> Hkv identical rows: positions [0, sinks) and the last K + m_t - sinks (None: keeps all)."""
        m = prompt.m
        total = visual_budget(self.k, prompt.m_v, prompt.m_t) + prompt.m_t
        if total >= m:
            return None
        sinks = min(self.sinks, total)
        keep = torch.cat([torch.arange(sinks), torch.arange(m - (total - sinks), m)])
        return uniform_selection(keep.expand(prompt.num_kv_heads, -1))


METHODS = [Method("streaming", "Streaming draft", "speculative", Streaming, paper="arXiv:2309.17453")]
