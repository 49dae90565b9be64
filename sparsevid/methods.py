"""Methods by name, and the side-by-side comparison against dense on the same inputs.

Every method is dense, a policy used directly (lossy), or a draft verified by dense (lossless).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .adapters import VideoInputs
from .engine import Result, Sampling, decode
from .models import Loaded
from .policies import Streaming, TopK
from .speculative import LayerSkipDraft, PolicyDraft, speculative_decode


@dataclass
class Settings:
    """Method settings with the defaults the CLI and app start from.

    k: StD / Streaming visual budget (count, fraction of m_v, or None for K + m_t = 1024).
    gamma: draft length. refresh: copy dense KV of accepted tokens into the draft cache.
    layerskip_layers: L_e for LayerSkip (None: a third of the layers, at least 1).
    """

    k: int | float | None = None
    gamma: int = 9
    refresh: bool = True
    layerskip_layers: int | None = None
    sinks: int = 4
    # HT-Sparse (SPEC §3.2)
    tau: float = 1.0
    eta: float | None = 0.7
    l_v: int | float | None = None
    heads_full: int | float | None = 0.25
    heads_sparse: int | float | None = 0.75
    ht_layers: str = "mid+late"
    ht_variant: str = "ht"
    drop_mode: str = "zero"
    ht_summary: str = "last"
    ht_by_group: bool = True
    low_rank: int = 0  # HT-Sparse low-rank scoring rank (0: off)
    # SparseMM (SPEC §3.3)
    budget: int | None = None
    window: int = 32
    rho: float = 0.5  # SPEC/paper: 0.1; 0.5 chosen on the embedded model (sparsemm.py)
    extra: dict = field(default_factory=dict)


@dataclass
class Method:
    name: str
    label: str
    kind: str  # "dense" | "direct" | "speculative"
    build: Callable[[Settings, Loaded], object]  # -> policy (direct) or draft (speculative)
    figures: Callable | None = None  # (result, dense_result, inputs, loaded) -> None: method's own extras

    @property
    def lossless(self) -> bool:
        return self.kind != "direct"


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    METHODS[method.name] = method
    return method


register(Method("dense", "Dense", "dense", lambda s, l: None))
register(Method("std", "StD (top-K draft)", "speculative",
                lambda s, l: PolicyDraft(TopK(s.k), refresh=s.refresh)))
register(Method("streaming", "Streaming draft", "speculative",
                lambda s, l: PolicyDraft(Streaming(s.k, s.sinks), refresh=s.refresh)))
register(Method("layerskip", "LayerSkip draft", "speculative",
                lambda s, l: LayerSkipDraft(s.layerskip_layers or max(1, l.num_layers // 3))))


def parse_methods(spec: str | list[str]) -> list[str]:
    """'dense,std' -> ['dense', 'std'] (dense always first). Unknown names raise InputError."""
    from .errors import InputError

    names = [n.strip() for n in (spec.split(",") if isinstance(spec, str) else spec) if n.strip()]
    bad = [n for n in names if n not in METHODS]
    if bad:
        raise InputError(f"Unknown method(s): {', '.join(bad)}. Available: {', '.join(METHODS)}.")
    return ["dense"] + [n for n in dict.fromkeys(names) if n != "dense"]


def run_method(loaded: Loaded, inputs: VideoInputs, name: str, settings: Settings = Settings(),
               max_new_tokens: int = 64, sampling: Sampling = Sampling(),
               on_token: Callable[[int], None] | None = None) -> Result:
    method = METHODS[name]
    built = method.build(settings, loaded)
    if method.kind == "dense":
        return decode(loaded, inputs, method=name, max_new_tokens=max_new_tokens, sampling=sampling,
                      on_token=on_token)
    if method.kind == "direct":
        return decode(loaded, inputs, method=name, policy=built, max_new_tokens=max_new_tokens,
                      sampling=sampling, on_token=on_token)
    return speculative_decode(loaded, inputs, built, method=name, gamma=settings.gamma,
                              max_new_tokens=max_new_tokens, sampling=sampling, on_token=on_token)


def compare(loaded: Loaded, inputs: VideoInputs, names: list[str], settings: Settings = Settings(),
            max_new_tokens: int = 64, sampling: Sampling = Sampling(),
            on_token: Callable[[str, int], None] | None = None,
            on_result: Callable[[Result], None] | None = None) -> dict[str, Result]:
    """Run dense and each method on the same inputs; fill each result's ratios against dense."""
    results: dict[str, Result] = {}
    for name in parse_methods(names):
        cb = (lambda tok, n=name: on_token(n, tok)) if on_token else None
        res = run_method(loaded, inputs, name, settings, max_new_tokens, sampling, cb)
        if name != "dense":
            add_ratios(res, results["dense"], inputs, loaded)
        results[name] = res
        if on_result is not None:
            on_result(res)
    return results


def add_ratios(res: Result, dense: Result, inputs: VideoInputs, loaded: Loaded) -> None:
    """speedup (decode throughput), kv_ratio, identical_to_dense and the I/O model's prediction."""
    method = METHODS[res.method]
    e = res.extra
    e["speedup"] = res.tokens_per_s / dense.tokens_per_s if dense.tokens_per_s else None
    e["e2e_speedup"] = dense.total_s / res.total_s if res.total_s else None
    e["kv_ratio"] = res.kv_bytes / dense.kv_bytes if dense.kv_bytes else None
    e["identical_to_dense"] = res.token_ids == dense.token_ids
    e["lossless"] = method.lossless
    e["predicted_speedup"] = None
    alpha, gamma = e.get("acceptance"), e.get("gamma")
    if method.kind == "speculative" and alpha:
        m = inputs.m
        draft_entries = e["draft_entries"]
        io_avg = (gamma * draft_entries + m) / (alpha * gamma)
        e["predicted_speedup"] = m / io_avg
    if method.figures is not None:
        method.figures(res, dense, inputs, loaded)


from . import htsparse  # noqa: E402,F401  (registers its methods)
from . import sparsemm  # noqa: E402,F401  (registers its methods)
