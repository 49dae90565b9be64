"""sparsevid: dense vs sparse and speculative decoding of Video-LLMs, side by side."""

import os

__version__ = "0.1.0"

def _op_key() -> str:
    """A short hash of the CPU attention op's source: compiled steps call the op through its schema,
    and a graph cached against another version of it (another argument list) crashed the process."""
    import hashlib

    try:
        with open(os.path.join(os.path.dirname(__file__), "csrc", "decode_attention.cpp"), "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()[:12]
    except OSError:
        return "no-op"


# Compiled decode steps (`fast`) are cached on disk here unless TORCHINDUCTOR_CACHE_DIR is set, one
# folder per version of the CPU op (`_op_key`). Set at import, before transformers is imported:
# inductor fixes its cache folder the first time it is asked (importing `transformers` does), and its
# own default is under /tmp.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                      os.path.join(os.path.expanduser("~"), ".cache", "sparsevid", "inductor", _op_key()))
