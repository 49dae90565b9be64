"""Plain records of what a run did: numbers, lists and numpy arrays, no torch, JSON-serialisable.

The engine emits one `Trace` per method run; `metrics` computes every ratio from traces, `plots`
draws from them, and the CLI's JSON, bench, eval and the app all read the same records.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class ModelShape:
    """Language-model sizes (for FLOPs and bytes): layers L, query heads H, KV heads Hkv, head dim D,
    hidden d, MLP width I, vocabulary V, bytes per element, and the weights' total bytes."""

    L: int
    H: int
    Hkv: int
    D: int
    d: int
    I: int  # noqa: E741
    V: int
    bytes: int
    weight_bytes: int = 0


@dataclass
class PromptInfo:
    """The prompt all methods of a comparison share. visual_positions [m_v]; token_grid [m_v, 3]
    (frame, row, column) of each visual position; grid (t, rows, cols)."""

    m: int
    query_start: int
    visual_positions: np.ndarray
    token_grid: np.ndarray
    grid: tuple[int, int, int]

    @property
    def m_v(self) -> int:
        return int(len(self.visual_positions))

    @property
    def m_t(self) -> int:
        return self.m - self.m_v


@dataclass
class LayerRecord:
    """What one layer of a sparse method kept.

    kept: per KV head, its sorted prompt positions (int32). query_mask: bool [H, m] or None (every
    query head reads its group's `kept`). head_scale: [H] or None (0: a dropped head). info: the
    policy's own per-layer values (HT-Sparse: roles [H] 0 full / 1 sparse / 2 dropped, saliency
    [H], tokens [k] the selected visual positions). rows: the prompt positions [m'] (int32) the
    layer's prefill processed when earlier pruning removed the others (HT-Sparse `prune_after`),
    else None (all m). Positions are always the prompt's own, pruned layers included.
    """

    kept: list[np.ndarray]
    query_mask: np.ndarray | None = None
    head_scale: np.ndarray | None = None
    info: dict = field(default_factory=dict)
    rows: np.ndarray | None = None

    @property
    def lengths(self) -> list[int]:
        return [len(k) for k in self.kept]


@dataclass
class Round:
    """One speculative round: the draft's tokens, how many dense accepted, its bonus token (None when
    the answer ended first), the round's draft and verify times (verify_s includes the draft caches'
    catch-up after it: `PolicyDraft.end_round`'s refresh), its γ and why that γ (adaptive γ:
    "dense step" to measure one, "probe", "best", "draft = dense", "hopeless here before": no probe
    where the previous run at this shape found the draft could not pay; fixed: "fixed")."""

    proposed: list[int]
    accepted: int
    bonus: int | None
    draft_s: float
    verify_s: float
    gamma: int = 0
    why: str = ""


@dataclass
class Trace:
    """One method's run on one prompt. Times in seconds; kv_bytes: KV held at the end of decoding.

    kind: "dense" | "direct" | "speculative". step_s: the time of each decode step after the first
    token (dense and direct runs). rounds: speculative rounds. layers: {layer: LayerRecord} of the
    layers the policy selected in (a layer missing keeps everything). draft_entries: mean prompt +
    kept entries a draft step reads per layer and KV head. draft_layers: LayerSkip's L_e.
    head_scores: SparseMM's scores (score_map [L, H], kv_scores [L, Hkv], caps [L, Hkv], file,
    uniform). peak_memory_bytes: the run's peak memory, `peak_memory_source` "cuda" (peak allocated
    bytes, weights included) or "rss" (CPU: growth of the peak resident size over the run; None
    where neither can be measured). config: the
    method's settings as it ran (its dataclass fields, and γ / refresh for a draft). decode_runs_s:
    with repeated timing passes, each pass's decode time in the order run (decode_s is their median).
    dense_pair_s: for each of those passes, the decode time of dense it is compared with: the mean of
    the dense runs just before and just after it (`runs.compare`, `bench`), so that a drift of the
    machine's speed over the runs cancels to first order.
    """

    method: str
    kind: str
    token_ids: list[int]
    text: str
    prefill_s: float
    decode_s: float
    kv_bytes: int
    step_s: list[float] = field(default_factory=list)
    rounds: list[Round] = field(default_factory=list)
    layers: dict[int, LayerRecord] = field(default_factory=dict)
    draft_entries: float | None = None
    draft_layers: int | None = None
    gamma: int | None = None
    head_scores: dict | None = None
    peak_memory_bytes: int | None = None
    peak_memory_source: str | None = None
    config: dict = field(default_factory=dict)
    decode_runs_s: list[float] = field(default_factory=list)  # each timing pass's decode time (runs.compare)
    dense_pair_s: list[float] = field(default_factory=list)  # the dense decode time each pass is paired with
    fast_steps: int = 0  # decode steps (and verification passes) served by a compiled or captured graph
    batch: int = 1  # prompts decoded together (batched decoding: step times are the batch's)
    # the decode time of the batch this row was decoded in: every step (round) once, the whole pass
    # with continuous batching (`engine.decode_rows`' width); one row: its decode_s
    batch_decode_s: float | None = None
    # its prompt was not prefilled again: the run decoded from the state an earlier run of the same
    # prompt left after its prefill (`engine.Prefilled`, `runs.compare`'s decode-only passes);
    # prefill_s is that run's
    prefill_reused: bool = False

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def decode_tokens(self) -> int:
        """Tokens produced by decoding (the first token comes from the prefill)."""
        return max(0, len(self.token_ids) - 1)

    def to_json(self, with_layers: bool = False) -> dict:
        """A JSON-ready dict (per-layer selections only with `with_layers`: they can be large)."""
        d = asdict(self)
        if not with_layers:
            d.pop("layers")
        d.update(decode_tokens=self.decode_tokens, total_s=self.total_s)
        return to_plain(d)


def to_plain(x):
    """numpy arrays and scalars -> lists and Python numbers, recursively (keys -> str)."""
    if isinstance(x, dict):
        return {str(k): to_plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_plain(v) for v in x]
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    return x
