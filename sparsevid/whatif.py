"""What a speculative method would gain elsewhere: the memory-bound step model of decoding on an
accelerator (as in MagicDec, Chen et al., arXiv:2408.11049), no torch.

On an accelerator one decode step of a 7B model at batch B is memory-bound: it reads the weights
once and each sequence's KV cache, so `T ≈ (W + B·S·kv) / BW` (`step_s`). A same-weights sparse
draft reads the weights and only K + m_t KV entries per sequence; the dense verification of γ
tokens reads what one dense step reads (it is memory-bound too). So the draft step costs
`c = T(K + m_t) / T(S)` dense steps, `v = 1`, and the speedup is `metrics.speculative_bound` at
those costs (the StD paper's I/O model at a reference setting).

Reference figures: Qwen2-VL-7B / Qwen2.5-VL-7B / LLaVA-OV-7B share the Qwen2-7B
backbone: 28 layers, 4 KV heads, head dim 128, so one token's KV in bf16 is
2 (K and V) · 28 · 4 · 128 · 2 bytes = 57,344 B = 56 KiB; weights ≈ 15.2 GB in bf16
(8.3 B parameters with the vision tower). Peak HBM bandwidth from the vendors' data sheets:
A100 80 GB SXM 2.039 TB/s (NVIDIA A100 datasheet), H100 SXM 3.35 TB/s (H100 datasheet),
H200 4.8 TB/s (H200 datasheet).
"""

from __future__ import annotations

from dataclasses import dataclass

from .metrics import expected_tokens_per_round, speculative_bound

KV_BYTES_PER_TOKEN = 2 * 28 * 4 * 128 * 2  # K and V · layers · KV heads · head dim · bf16 bytes = 56 KiB
WEIGHT_BYTES = 15.2e9  # Qwen2-VL-7B in bf16
BANDWIDTH = {  # peak memory bandwidth, bytes/s (vendor data sheets)
    "A100 80GB": 2.0e12,
    "H100 SXM": 3.35e12,
    "H200": 4.8e12,
}
REFERENCE_MODEL = "Qwen2-VL-7B (bf16)"


@dataclass(frozen=True)
class Reference:
    """A reference setting: accelerator, batch B, visual tokens S_v, text tokens m_t, the draft's
    kept visual tokens K per KV head, draft length γ, acceptance α."""

    gpu: str = "H100 SXM"
    batch: int = 1
    visual_tokens: int = 32768
    text_tokens: int = 128
    k: int = 1024
    gamma: int = 9
    acceptance: float = 0.8


def step_s(context: float, batch: int = 1, bandwidth: float = BANDWIDTH["H100 SXM"],
           weights: float = WEIGHT_BYTES, kv_per_token: float = KV_BYTES_PER_TOKEN) -> float:
    """One memory-bound decode step, seconds: (W + B·S·kv) / BW."""
    return (weights + batch * context * kv_per_token) / bandwidth


def crossover_tokens(batch: int = 1, weights: float = WEIGHT_BYTES, kv_per_token: float = KV_BYTES_PER_TOKEN) -> float:
    """S* = W / (B·kv): the context where KV traffic equals weight traffic."""
    return weights / (batch * kv_per_token)


def draft_cost(ref: Reference) -> float:
    """c: a sparse draft step (K + m_t KV entries) in dense steps (S = S_v + m_t) at `ref`."""
    bw = BANDWIDTH[ref.gpu]
    dense = step_s(ref.visual_tokens + ref.text_tokens, ref.batch, bw)
    draft = step_s(min(ref.k, ref.visual_tokens) + ref.text_tokens, ref.batch, bw)
    return draft / dense


def predicted_speedup(ref: Reference, acceptance: float | None = None) -> float:
    """σ = Ω / (γ·c + 1) at `ref` (acceptance overrides ref.acceptance)."""
    a = ref.acceptance if acceptance is None else acceptance
    return speculative_bound(a, ref.gamma, draft_cost(ref), 1.0)


def sweep(ref: Reference, visual_tokens: list[int], batches: tuple[int, ...] = (1, 8)) -> list[dict]:
    """One row per (batch, visual tokens): dense step ms, draft cost c, Ω, predicted speedup at
    ref.acceptance and at 1.0."""
    rows = []
    for b in batches:
        for s in visual_tokens:
            r = Reference(ref.gpu, b, s, ref.text_tokens, ref.k, ref.gamma, ref.acceptance)
            rows.append(dict(batch=b, visual_tokens=s, dense_step_ms=1e3 * step_s(s + r.text_tokens, b, BANDWIDTH[r.gpu]),
                             draft_cost=draft_cost(r), tokens_per_round=expected_tokens_per_round(r.acceptance, r.gamma),
                             speedup=predicted_speedup(r), speedup_full_acceptance=predicted_speedup(r, 1.0)))
    return rows
