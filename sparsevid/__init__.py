"""sparsevid: dense vs sparse and speculative decoding of Video-LLMs, side by side."""

__version__ = "0.1.0"
