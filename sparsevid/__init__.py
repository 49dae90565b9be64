"""sparsevid: dense vs sparse and speculative decoding of Video-LLMs, side by side."""

import os

__version__ = "0.1.0"

# Compiled decode steps (`fast`) are cached on disk here unless TORCHINDUCTOR_CACHE_DIR is set. Set at
# import, before transformers is imported: inductor fixes its cache folder the first time it is asked
# (importing `transformers` does), and its own default is under /tmp.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "sparsevid", "inductor"))
