"""The decoding engine: prefill, then token-by-token decoding on a preallocated cache.

`decode` runs dense (the full cache) or a selection policy directly (lossy: only the compact
caches are held). `speculative.py` reuses `prefill` and `step` for drafts verified by dense.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .adapters import VideoInputs
from .attention import Run, active
from .cache import KVCache
from .models import Loaded


@dataclass
class Sampling:
    """Greedy when temperature == 0; else temperature + nucleus (top_p) sampling from `seed`.

    ignore_eos: decode exactly max_new_tokens (benchmarks of fixed length, as serving benchmarks do).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = False

    def eos(self, loaded) -> set[int]:
        return set() if self.ignore_eos else set(loaded.adapter.eos_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def generator(self, device) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(self.seed)


def probs_from_logits(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] after temperature and top-p (float32)."""
    p = torch.softmax(logits.float() / s.temperature, dim=-1)
    if s.top_p < 1.0:
        sp, idx = p.sort(dim=-1, descending=True)
        drop = sp.cumsum(-1) - sp > s.top_p  # keep the smallest prefix reaching top_p
        sp = sp.masked_fill(drop, 0.0)
        p = torch.zeros_like(p).scatter_(-1, idx, sp)
        p = p / p.sum(-1, keepdim=True)
    return p


def choose(logits: torch.Tensor, s: Sampling, gen: torch.Generator | None) -> int:
    """Next token from logits [V]."""
    if s.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(probs_from_logits(logits, s), 1, generator=gen))


@dataclass
class Result:
    """One method's run. Times in seconds; kv_bytes: KV entries held at the end of decoding."""

    method: str
    token_ids: list[int]
    text: str
    prefill_s: float
    decode_s: float
    step_s: list[float]
    kv_bytes: int
    extra: dict = field(default_factory=dict)
    trace: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> int | None:
    """Peak bytes allocated since `reset_peak_memory` (CUDA only; None elsewhere)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def new_run(loaded: Loaded, inputs: VideoInputs, capacity_extra: int, policy=None, store_dense=True,
            keep_stats=False) -> Run:
    cache = KVCache(loaded.num_layers, inputs.m + capacity_extra, store_dense=store_dense)
    return Run(cache, loaded.num_heads, inputs.visual_positions, inputs.query_start, policy, keep_stats)


def align_mrope_decode(model, model_kwargs: dict) -> None:
    """M-RoPE models (Qwen2-VL, Qwen2.5-VL): make the tokens fed after the prompt continue from the
    prompt's last position, as `generate` does and as one forward over prompt + answer does.

    transformers' forward places a cached step at `cache length + rope_deltas`, with rope_deltas
    taken from the largest position anywhere in the prompt; `get_rope_index` (transformers 5.x) puts
    the text after a video at positions that can be far below the video's largest temporal index.
    On a 256-frame clip the prompt ended at 31 and decoding went on at 143, not 32: multi-token
    answers lost words. Rewrites `model.model.rope_deltas` [B, 1] from the prompt's own positions.
    No-op for other models."""
    inner = getattr(model, "model", None)
    if getattr(inner, "rope_deltas", None) is None or not hasattr(inner, "get_rope_index"):
        return
    params = inspect.signature(inner.get_rope_index).parameters
    kw = {k: v for k, v in model_kwargs.items() if k in params and k != "input_ids"}
    ids = model_kwargs["input_ids"]
    pos, _ = inner.get_rope_index(ids, **kw)  # [3, B, L]
    inner.rope_deltas = (pos[:, :, -1].amax(0) + 1 - ids.shape[1]).unsqueeze(1).to(inner.rope_deltas)


@torch.inference_mode()
def prefill(loaded: Loaded, inputs: VideoInputs, run: Run) -> torch.Tensor:
    """Run the prompt through the model, filling the caches. Returns the last position's logits [V]."""
    with active(run):
        out = loaded.model(**inputs.model_kwargs, past_key_values=run.cache, use_cache=True, logits_to_keep=1)
    align_mrope_decode(loaded.model, inputs.model_kwargs)
    run.cache.finish_prefill(inputs.m)
    return out.logits[0, -1]


@torch.inference_mode()
def step(loaded: Loaded, run: Run, tokens: list[int], mode: str | None = None) -> torch.Tensor:
    """Feed `tokens` (appended after the current length of `mode`'s cache). Returns logits [q, V]."""
    cache = run.cache
    if mode is not None:
        cache.mode = mode
    ids = torch.tensor([tokens], device=loaded.device)
    with active(run):
        out = loaded.model(input_ids=ids, past_key_values=cache, use_cache=True)
    cache.advance(len(tokens))
    return out.logits[0]


@torch.inference_mode()
def decode(loaded: Loaded, inputs: VideoInputs, *, method: str = "dense", policy=None, max_new_tokens: int = 64,
           sampling: Sampling = Sampling(), on_token: Callable[[int], None] | None = None,
           keep_stats: bool = False) -> Result:
    """Dense decoding (policy None) or a policy applied directly (lossy; compact caches only)."""
    dev = loaded.device
    eos = sampling.eos(loaded)
    run = new_run(loaded, inputs, max_new_tokens + 1, policy, store_dense=policy is None, keep_stats=keep_stats)
    gen = sampling.generator(dev)
    sync(dev)
    reset_peak_memory(dev)
    t0 = time.perf_counter()
    logits = prefill(loaded, inputs, run)
    tokens: list[int] = []
    tok = choose(logits, sampling, gen)
    sync(dev)
    t1 = time.perf_counter()
    steps = []
    while True:
        tokens.append(tok)
        if on_token is not None:
            on_token(tok)
        if tok in eos or len(tokens) >= max_new_tokens:
            break
        ts = time.perf_counter()
        logits = step(loaded, run, [tok])[-1]
        tok = choose(logits, sampling, gen)
        sync(dev)
        steps.append(time.perf_counter() - ts)
    t2 = time.perf_counter()
    kv = run.cache.dense_nbytes() if policy is None else run.cache.sparse_nbytes()
    res = Result(method, tokens, loaded.adapter.decode(tokens), t1 - t0, t2 - t1, steps, kv)
    res.extra.update(peak_memory_bytes=peak_memory(dev))
    res.trace.update(selections=run.selections, stats=run.stats)
    return res
