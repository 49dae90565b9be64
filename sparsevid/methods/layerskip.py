"""LayerSkip draft (tuning-free early exit as in Elhoushi et al.,
"LayerSkip: Enabling Early Exit Inference and Self-Speculative Decoding", arXiv:2404.16710).

The draft is the first L_e decoder layers, then the final norm and the LM head, with no training.
Its KV in those layers is exactly dense's, so it shares the dense cache; the engine runs the
truncated stack through the adapter's layer-range step, never by changing the loaded model.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..options import option
from .base import Method


@dataclass
class LayerSkip:
    """layerskip_layers: L_e, the decoder layers the draft runs (None: a third of them, at least 1)."""

    layerskip_layers: int | None = option(None, "decoder layers the draft runs; blank: a third of them",
                                          "optional_int", label="L_e: layers the draft runs", min=1,
                                          unit="layers")

    def draft_layers(self, num_layers: int) -> int:
        n = self.layerskip_layers or max(1, num_layers // 3)
        return max(1, min(n, num_layers))


METHODS = [Method("layerskip", "LayerSkip draft", "speculative", LayerSkip, paper="arXiv:2404.16710")]
