"""Everything the Gradio app does except layout: limits, models, settings, the streamed comparison
and the panels' data. `app.py` only lays out components and wires callbacks to this module.

The run is a generator (`run_comparison`) that yields `Update`s: progress, each method's answer as
its tokens arrive, and at the end the plain data every panel is drawn from (`View`), so changing
the method, layer or head redraws from that data without running the model again.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: spinning OpenMP threads starve the server
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import hashlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import queue  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import numpy as np  # noqa: E402

from . import plots  # noqa: E402
from .adapters import check_question  # noqa: E402
from .errors import InputError, SparsevidError  # noqa: E402
from .methods import METHODS, Settings, compare, parse_methods  # noqa: E402
from .models import ASSETS, EMBEDDED_NAME, KNOWN_CHECKPOINTS, load_model  # noqa: E402
from .video import load_video  # noqa: E402

log = logging.getLogger("sparsevid.app")

# ------------------------------------------------------------------------------------------------
# Limits (stated in the UI)

MAX_UPLOAD_MB = int(os.environ.get("SPARSEVID_MAX_UPLOAD_MB", 200))
MAX_MINUTES = float(os.environ.get("SPARSEVID_MAX_MINUTES", 10))
MAX_QUESTION_CHARS = 500
FRAMES = dict(minimum=2, maximum=64, value=16, step=2)
MAX_NEW_TOKENS = dict(minimum=1, maximum=256, value=32, step=1)
VIDEO_TYPES = [".mp4", ".webm", ".mov", ".mkv", ".avi", ".gif"]
EXAMPLES_DIR = os.environ.get("SPARSEVID_EXAMPLES_DIR") or os.path.join(ASSETS, "examples")


def limits_text() -> str:
    return (f"Video: {', '.join(t[1:] for t in VIDEO_TYPES)}; up to {MAX_UPLOAD_MB} MB and "
            f"{MAX_MINUTES:g} minutes. Question: up to {MAX_QUESTION_CHARS} characters.")


# ------------------------------------------------------------------------------------------------
# Models (loaded once, cached by name) and the methods that run on them

try:  # Hugging Face ZeroGPU: the GPU function is decorated; elsewhere it runs unchanged
    import spaces  # type: ignore

    ZERO_GPU = True
except ImportError:  # pragma: no cover - depends on the platform
    spaces = None
    ZERO_GPU = False


def gpu(fn):
    """`spaces.GPU` when the `spaces` package is there (ZeroGPU), else `fn` unchanged."""
    return spaces.GPU(duration=int(os.environ.get("SPARSEVID_GPU_SECONDS", 120)))(fn) if ZERO_GPU else fn


def default_model() -> str:
    """The model the app starts with: $SPARSEVID_MODEL (a name or folder), else the embedded one."""
    return os.environ.get("SPARSEVID_MODEL") or EMBEDDED_NAME


def model_choices() -> list[str]:
    return list(dict.fromkeys([default_model(), EMBEDDED_NAME] + KNOWN_CHECKPOINTS))


_MODELS: dict[str, object] = {}
_BROKEN: dict[str, dict[str, str]] = {}  # model name -> {method: why it cannot run}
_MODEL_LOCK = threading.Lock()


def get_model(name: str):
    """The loaded model `name` (cached); raises ModelError with a user-ready message."""
    name = name or default_model()
    with _MODEL_LOCK:
        if name not in _MODELS:
            t0 = time.perf_counter()
            _MODELS[name] = load_model(name)
            log.info("loaded %s in %.1f s", name, time.perf_counter() - t0)
        return _MODELS[name]


def _probe_frames(n: int = 4) -> np.ndarray:
    rng = np.random.RandomState(0)
    f = rng.randint(0, 60, size=(n, 64, 64, 3)).astype(np.uint8)
    for i in range(n):
        f[i, 20:36, 6 + 8 * i:22 + 8 * i] = (220, 40, 40)
    return f


def broken_methods(name: str) -> dict[str, str]:
    """Methods that fail on model `name` ({method: reason}), found once by running each briefly on a
    synthetic clip. Empty on ZeroGPU (no GPU outside the decorated function) or if
    SPARSEVID_SELFCHECK=0."""
    if name in _BROKEN:
        return _BROKEN[name]
    bad: dict[str, str] = {}
    if not ZERO_GPU and os.environ.get("SPARSEVID_SELFCHECK", "1") != "0":
        loaded = get_model(name)
        inputs = loaded.adapter.build_inputs(_probe_frames(), "what colour is the object ?").to(loaded.device)
        for m in METHODS:
            if m == "dense":
                continue
            try:
                compare(loaded, inputs, ["dense", m], Settings(), max_new_tokens=3)
            except Exception as e:  # noqa: BLE001 - any failure hides the method
                bad[m] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                log.warning("method %s does not run on %s: %s", m, name, bad[m])
    _BROKEN[name] = bad
    return bad


def method_choices(model: str | None = None) -> list[tuple[str, str]]:
    """(label, name) of every registered method except dense (always run), minus those that fail on
    `model` when it is given and loads."""
    bad = {}
    if model is not None:
        try:
            bad = broken_methods(model)
        except SparsevidError:
            bad = {}
    return [(describe_method(n), n) for n in METHODS if n != "dense" and n not in bad]


def describe_method(name: str) -> str:
    m = METHODS[name]
    return f"{m.label} · {'lossless' if m.lossless else 'lossy'}"


def startup(model: str | None = None) -> dict:
    """Load the default model and find the methods that run on it. Returns {"model", "methods",
    "warning"}; never raises (a model that cannot load is reported, and every method is listed)."""
    model = model or default_model()
    try:
        get_model(model)
        return dict(model=model, methods=method_choices(model), warning=None)
    except SparsevidError as e:
        return dict(model=model, methods=method_choices(None), warning=str(e))


# ------------------------------------------------------------------------------------------------
# Settings: the UI's groups and fields, with defaults from `Settings`


@dataclass
class Field:
    name: str  # a Settings field
    label: str
    kind: str  # "int" | "float" | "optional" (blank = the method's default) | "bool" | "choice"
    info: str = ""
    minimum: float | None = None
    maximum: float | None = None
    step: float | None = None
    choices: tuple = ()

    @property
    def default(self):
        return APP_DEFAULTS.get(self.name, getattr(Settings(), self.name))


# Where the app starts from other values than `Settings`: the paper's K + m_t = 1024 keeps every
# visual token of a short clip (the embedded model sees ~300), so StD would equal dense.
APP_DEFAULTS = {"k": 0.25}


@dataclass
class Group:
    title: str
    methods: tuple[str, ...]  # the group is shown when one of these is registered
    fields: list[Field] = field(default_factory=list)


def _ht_options() -> tuple[tuple, tuple]:
    try:
        from .htsparse import LAYER_STRATEGIES, VARIANTS

        return tuple(LAYER_STRATEGIES), tuple(VARIANTS)
    except ImportError:
        return ("early", "mid", "late", "mid+late"), ("ht", "head", "token")


def setting_groups() -> list[Group]:
    """Settings groups for the methods registered now, in display order."""
    layers, variants = _ht_options()
    spec = [p for p in METHODS if METHODS[p].kind == "speculative"]
    groups = [
        Group("Speculative decoding (every draft)", tuple(spec), [
            Field("gamma", "γ: draft tokens per round", "int", "", 1, 32, 1),
            Field("refresh", "Refresh the draft cache with dense KV of accepted tokens", "bool")]),
        Group("StD / Streaming budget", ("std", "streaming"), [
            Field("k", "K: visual tokens kept per KV head", "optional",
                  "A count, or a fraction ≤ 1 of the visual tokens (default 0.25). Blank: K + text = 1024, "
                  "the paper's setting, which keeps every token of a short clip."),
            Field("sinks", "Streaming: attention-sink tokens", "int", "", 0, 64, 1)]),
        Group("LayerSkip", ("layerskip",), [
            Field("layerskip_layers", "L_e: layers the draft runs", "optional",
                  "Blank: a third of the layers.")]),
        Group("HT-Sparse", ("htsparse", "htsparse-draft"), [
            Field("tau", "τ: saliency temperature", "float", "", 0.05, 5.0, 0.05),
            Field("eta", "η: relevance coverage of the kept tokens", "float", "", 0.05, 1.0, 0.05),
            Field("l_v", "l_v: fixed visual-token budget", "optional", "Blank: use η coverage instead."),
            Field("heads_full", "h_f: full heads per layer", "optional", "Count or fraction ≤ 1; blank: 0.25."),
            Field("heads_sparse", "h_s: sparse heads per layer", "optional", "Count or fraction ≤ 1; blank: 0.75."),
            Field("ht_layers", "Routed layers", "choice", choices=layers),
            Field("ht_variant", "Variant", "choice", "ht: heads + tokens; head: heads only; token: tokens only",
                  choices=variants),
            Field("drop_mode", "Dropped heads", "choice", "zero: output 0; text_only: attend text only",
                  choices=("zero", "text_only")),
            Field("ht_summary", "Head saliency from", "choice", "last: the last prompt token's query; "
                  "mean: the mean over the question's tokens", choices=("last", "mean")),
            Field("ht_by_group", "Partition whole GQA groups (so KV memory falls with them)", "bool"),
            Field("low_rank", "r: low-rank scoring rank", "int", "0: off; else prompt keys are scored in rank r "
                  "(SVD of each KV head's prefill keys), values untouched", 0, 256, 1)]),
        Group("SparseMM", ("sparsemm", "sparsemm-draft"), [
            Field("budget", "B: average KV entries per KV head", "optional",
                  "A count, or a fraction ≤ 1 of the prompt; blank: 0.4 of the prompt."),
            Field("window", "w: local window", "int", "", 1, 256, 1),
            Field("rho", "ρ: uniform floor share", "float", "", 0.0, 1.0, 0.05)]),
    ]
    defaults = Settings()
    for g in groups:  # only the settings this version of `Settings` has
        g.fields = [f for f in g.fields if hasattr(defaults, f.name)]
    return [g for g in groups if g.fields and any(m in METHODS for m in g.methods)]


def setting_fields() -> list[Field]:
    return [f for g in setting_groups() for f in g.fields]


def _count_or_fraction(v, label: str):
    if v is None or str(v).strip() == "":
        return None
    try:
        v = float(v)
    except ValueError:
        raise InputError(f"{label} must be a number (or blank for the default), not {str(v)[:20]!r}.") from None
    if v <= 0:
        raise InputError(f"{label} must be positive (or blank for the default).")
    return v if v <= 1.0 else int(round(v))


def settings_from(values: dict) -> Settings:
    """UI values {field name: value} -> Settings (a missing field takes the app's default); raises
    InputError on a bad value."""
    s = Settings()
    for f in setting_fields():
        v = values.get(f.name, f.default)
        label = f.label.split(":")[0]
        if f.kind == "optional":
            v = _count_or_fraction(v, label)
            if f.name == "layerskip_layers" and v is not None:
                v = max(1, int(v))
        elif f.kind == "int":
            if v is None:
                v = f.default
            v = int(v)
            if (f.minimum is not None and v < f.minimum) or (f.maximum is not None and v > f.maximum):
                raise InputError(f"{label} must be between {f.minimum:g} and {f.maximum:g}.")
        elif f.kind == "float":
            v = f.default if v is None else float(v)
            if (f.minimum is not None and v < f.minimum) or (f.maximum is not None and v > f.maximum):
                raise InputError(f"{label} must be between {f.minimum:g} and {f.maximum:g}.")
        elif f.kind == "bool":
            v = bool(v)
        elif f.kind == "choice" and v not in f.choices:
            raise InputError(f"{label}: choose one of {', '.join(f.choices)}.")
        setattr(s, f.name, v)
    return s


# ------------------------------------------------------------------------------------------------
# Bundled examples (assets/examples/examples.json): question, answer, per-frame boxes


def load_examples(folder: str = EXAMPLES_DIR) -> list[dict]:
    """Entries of examples.json whose clip exists, each with `path` added; [] when there are none."""
    path = os.path.join(folder, "examples.json")
    if not os.path.exists(path):
        return []
    try:
        with open(path) as f:
            entries = json.load(f)
    except (OSError, ValueError):
        log.warning("could not read %s", path)
        return []
    out = []
    for e in entries:
        p = os.path.join(folder, e.get("file", ""))
        if e.get("file") and os.path.isfile(p) and e.get("question"):
            out.append(dict(e, path=p))
    return out


def _digest(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha1(f.read(64 << 20)).hexdigest()
    except OSError:
        return None


_EXAMPLE_INDEX: dict[str, dict] | None = None


def find_example(path: str, examples: list[dict] | None = None) -> dict | None:
    """The bundled example whose file has the same content as `path` (Gradio copies uploads and
    example files, so names and folders differ), or None."""
    global _EXAMPLE_INDEX
    if examples is None:
        if _EXAMPLE_INDEX is None:
            _EXAMPLE_INDEX = {d: e for e in load_examples() if (d := _digest(e["path"]))}
        index = _EXAMPLE_INDEX
    else:
        index = {d: e for e in examples if (d := _digest(e["path"]))}
    digest = _digest(path) if index else None
    return index.get(digest) if digest else None


def sampled_boxes(boxes: list, timestamps: list[float], fps: float) -> list:
    """Per source frame boxes (None where the object is not visible) -> one per sampled frame,
    taking the source frame on screen at each sampled timestamp."""
    if not boxes:
        return []
    out = []
    for t in timestamps:
        i = min(len(boxes) - 1, max(0, int(round(t * fps))))
        out.append(boxes[i])
    return out


# ------------------------------------------------------------------------------------------------
# The comparison, streamed


@dataclass
class View:
    """Plain data of a finished run: everything the panels are drawn from (kept in gr.State)."""

    frames: np.ndarray  # sampled frames, downscaled for display [T, h, w, 3] uint8
    timestamps: list[float]
    token_grid: np.ndarray  # [m_v, 3]
    grid: tuple[int, int, int]
    boxes: list | None  # per sampled frame, normalised box or None; None when the clip has no ground truth
    num_layers: int
    num_heads: int
    num_kv_heads: int
    labels: dict[str, str]  # method -> label, in run order (dense first)
    kept: dict[str, dict[int, np.ndarray]] = field(default_factory=dict)  # method -> layer -> bool [Hkv, m_v]
    roles: dict[str, dict] = field(default_factory=dict)  # method -> {roles [L, H], saliency, kv_lengths}
    scores: dict[str, dict] = field(default_factory=dict)  # method -> {scores, budgets, top5}
    drafts: dict[str, dict] = field(default_factory=dict)  # method -> {first, rounds}
    speed: list[dict] = field(default_factory=list)  # plots.speedups rows

    def selection_methods(self) -> list[str]:
        return [m for m in self.labels if m in self.kept]

    def draft_methods(self) -> list[str]:
        return [m for m in self.labels if m in self.drafts]


@dataclass
class Update:
    """One step of a run, for the UI. `cards`: method -> markdown (only the methods run);
    `view` and `figures` come once, at the end; `error`: a user-ready message (the run stopped)."""

    status: str = ""
    cards: dict[str, str] = field(default_factory=dict)
    progress: tuple[float, str] | None = None
    view: View | None = None
    figures: dict | None = None
    error: str | None = None


class _Cancelled(Exception):
    pass


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def card(name: str, text: str, res=None, state: str = "") -> str:
    """Markdown of one method's column: answer, then its numbers once it has finished."""
    m = METHODS[name]
    e = res.extra if res is not None else {}
    kind = "reference" if m.kind == "dense" else ("lossless" if m.lossless else "lossy")
    mark = ""
    if res is not None and name != "dense":
        same = e.get("identical_to_dense")
        mark = " · **✓ identical to dense**" if same else (" · **✗ differs from dense**" if m.lossless
                                                           else " · differs from dense")
    head = f"### {m.label}\n{kind}{(' · *' + state + '*') if state else ''}{mark}\n\n"
    answer = text if text.strip() else ("…" if state else "(empty answer)")
    body = head + "> " + answer.replace("\n", " ") + ("▌" if state.startswith("decoding") else "") + "\n\n"
    if res is None:
        return body
    rows = [("wall time", f"{res.total_s:.2f} s (prefill {res.prefill_s:.2f} + decode {res.decode_s:.2f})"),
            ("tokens/s", f"{res.tokens_per_s:.1f} ({len(res.token_ids)} tokens)")]
    if name != "dense":
        sp = e.get("speedup")
        e2e = e.get("e2e_speedup") or 0.0
        rows.append(("speedup", "n/a" if sp is None else f"**{sp:.2f}×** decode, {e2e:.2f}× end to end"))
    kv = _fmt_bytes(res.kv_bytes)
    if e.get("kv_ratio") is not None:
        kv += f" ({e['kv_ratio']:.0%} of dense)"
    rows.append(("KV memory", kv))
    if e.get("acceptance") is not None:
        rows.append(("acceptance", f"{e['acceptance']:.0%} · {e.get('tokens_per_round') or 0:.2f} tokens/round · "
                                   f"{e.get('rounds')} rounds (γ = {e.get('gamma')})"))
    return body + "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows) + "\n"


def _token_text(loaded, tok: int) -> str:
    """A token as a short readable string (byte-level pieces shown as the tokenizer's token)."""
    s = loaded.tokenizer.decode([tok], skip_special_tokens=False)
    if "\ufffd" in s or not s.strip():
        s = str(loaded.tokenizer.convert_ids_to_tokens(tok)).replace("Ġ", "␣").replace("Ċ", "⏎")
    return s.strip() or "␣"


def _view(loaded, inputs, results: dict, boxes) -> View:
    """Plain panel data from the results (tensors -> numpy, token ids -> strings)."""
    frames = np.asarray(inputs.frames)
    side = max(frames.shape[1:3])
    if side > 256:  # keep the session state small
        from PIL import Image

        s = 256 / side
        size = (max(1, round(frames.shape[2] * s)), max(1, round(frames.shape[1] * s)))
        frames = np.stack([np.asarray(Image.fromarray(f).resize(size, Image.BILINEAR)) for f in frames])
    vis = inputs.visual_positions.cpu().numpy()
    index = np.full(inputs.m, -1, dtype=np.int64)
    index[vis] = np.arange(len(vis))
    L, H, Hkv = loaded.num_layers, loaded.num_heads, loaded.num_kv_heads
    v = View(frames=frames, timestamps=list(inputs.timestamps), token_grid=inputs.token_grid.cpu().numpy(),
             grid=tuple(int(x) for x in inputs.grid), boxes=boxes, num_layers=L, num_heads=H, num_kv_heads=Hkv,
             labels={n: METHODS[n].label for n in results})
    for name, res in results.items():
        tr, e = res.trace, res.extra
        sels = tr.get("selections") or {}
        if sels:
            kept = {}
            for layer, sel in sels.items():
                mask = np.zeros((len(sel.keep), len(vis)), bool)
                for g, keep in enumerate(sel.keep):
                    j = index[keep.cpu().numpy()]
                    mask[g, j[j >= 0]] = True
                kept[int(layer)] = mask
            v.kept[name] = kept
        roles = _roles(tr, sels, L, H)
        if roles is not None:
            v.roles[name] = roles
        sc = _scores(tr, e)
        if sc is not None:
            v.scores[name] = sc
        if tr.get("rounds") is not None:
            v.drafts[name] = dict(first=_token_text(loaded, res.token_ids[0]) if res.token_ids else "", rounds=[
                dict(proposed=[_token_text(loaded, t) for t in r["proposed"]], accepted=r["accepted"],
                     bonus=None if r.get("bonus") is None else _token_text(loaded, r["bonus"]),
                     draft_s=r.get("draft_s", 0.0), verify_s=r.get("verify_s", 0.0)) for r in tr["rounds"]])
        if name != "dense":
            hover = (f"{res.tokens_per_s:.1f} tokens/s, {res.total_s:.2f} s, KV {_fmt_bytes(res.kv_bytes)}"
                     + (f", acceptance {e['acceptance']:.0%}" if e.get("acceptance") is not None else ""))
            v.speed.append(dict(label=METHODS[name].label, speedup=e.get("speedup"), e2e_speedup=e.get("e2e_speedup"),
                                kv_ratio=e.get("kv_ratio"), predicted_speedup=e.get("predicted_speedup"), hover=hover))
    return v


def _np(x):
    if x is None:
        return None
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=float)


def _roles(trace: dict, sels: dict, L: int, H: int) -> dict | None:
    """HT-Sparse head roles [L, H] with -1 for layers not routed, saliency π [L, H], KV lengths."""
    roles = trace.get("roles")
    if roles is not None:
        roles = _np(roles).astype(int)
        routed = trace.get("routed_layers")
        if routed is not None:
            mask = np.ones(L, bool)
            mask[list(routed)] = False
            roles[mask] = -1
    else:
        per = {l: s.roles for l, s in sels.items() if getattr(s, "roles", None) is not None}
        if not per:
            return None
        roles = np.full((L, H), -1)
        for l, r in per.items():
            roles[l] = _np(r).astype(int)
    sal = _np(trace.get("saliency"))
    kv = _np(trace.get("kv_lengths"))
    return dict(roles=roles, saliency=sal, kv_lengths=None if kv is None else kv.astype(int))


def _scores(trace: dict, extra: dict) -> dict | None:
    """SparseMM's layer x head score map and per-KV-head budgets, if the method recorded them."""
    d = trace.get("sparsemm")
    if isinstance(d, dict) and (d.get("score_map") is not None or d.get("kv_scores") is not None):
        scores = _np(d.get("score_map") if d.get("score_map") is not None else d.get("kv_scores"))
        return dict(scores=scores, budgets=_np(d.get("kept")), top5=extra.get("top5_mass"),
                    uniform=bool(extra.get("sparsemm_uniform")))
    return None


def run_comparison(video: str | None, question: str, model: str, n_frames: int, methods: list[str],
                   settings: dict, max_new_tokens: int, min_interval: float = 0.12):
    """Validate, decode the video, then run dense and each method, yielding `Update`s as tokens
    arrive. Bad input ends with an Update carrying `error` (never an exception)."""
    t0 = time.perf_counter()
    try:
        if not video:
            raise InputError("Upload a video first (or pick an example).")
        question = check_question(question, MAX_QUESTION_CHARS)
        names = parse_methods(["dense"] + list(methods or []))
        s = settings_from(settings or {})
        n_frames = int(n_frames or FRAMES["value"])
        if not FRAMES["minimum"] <= n_frames <= FRAMES["maximum"]:
            raise InputError(f"Frames must be between {FRAMES['minimum']} and {FRAMES['maximum']}.")
        max_new_tokens = int(max_new_tokens or MAX_NEW_TOKENS["value"])
        if not MAX_NEW_TOKENS["minimum"] <= max_new_tokens <= MAX_NEW_TOKENS["maximum"]:
            raise InputError(f"Max new tokens must be between {MAX_NEW_TOKENS['minimum']} and "
                             f"{MAX_NEW_TOKENS['maximum']}.")
        yield Update(status="Decoding video frames…", progress=(0.02, "Decoding video frames"))
        vid = load_video(video, n_frames, max_bytes=MAX_UPLOAD_MB * 2**20, max_duration=MAX_MINUTES * 60)
        yield Update(status=f"{len(vid.frames)} frames decoded; loading the model…", progress=(0.1, "Loading model"))
        loaded = get_model(model)
        skipped = {n: why for n, why in broken_methods(model or default_model()).items() if n in names}
        names = [n for n in names if n not in skipped]
        inputs = loaded.adapter.build_inputs(vid.frames, question, vid.timestamps).to(loaded.device)
    except SparsevidError as e:
        yield Update(status=f"⚠️ {e}", error=str(e))
        return
    except Exception as e:  # noqa: BLE001 - never a traceback in the UI
        log.exception("run failed before decoding")
        msg = f"Unexpected error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        yield Update(status=f"⚠️ {msg}", error=msg)
        return

    example = find_example(video)
    boxes = None
    if example and example.get("boxes"):
        boxes = sampled_boxes(example["boxes"], vid.timestamps, float(example.get("fps") or vid.fps))
    info = (f"**{len(vid.frames)} frames** ({vid.duration:.1f} s video) → {inputs.m_v} visual tokens, prompt "
            f"{inputs.m} tokens · model `{loaded.name}` on {loaded.device.type} ({str(loaded.dtype)[6:]})")
    if example:
        info += f" · bundled example, expected answer: *{example.get('answer', '?')}*"
    events: queue.Queue = queue.Queue()
    stop = threading.Event()

    def on_token(name, tok):
        if stop.is_set():
            raise _Cancelled
        events.put(("token", name, tok))

    def work():
        try:
            compare(loaded, inputs, names, s, max_new_tokens, on_token=on_token,
                    on_result=lambda r: events.put(("result", r.method, r)))
            events.put(("done", None, None))
        except _Cancelled:
            events.put(("done", None, None))
        except Exception as e:  # noqa: BLE001
            events.put(("error", None, e))

    tokens = {n: [] for n in names}
    results: dict = {}
    current, first_token_s = names[0], None

    def cards() -> dict[str, str]:
        out = {}
        for n in names:
            if n in results:
                out[n] = card(n, results[n].text, results[n])
            elif n == current:
                st = f"decoding, {len(tokens[n])} tokens" if tokens[n] else "prefill…"
                out[n] = card(n, loaded.adapter.decode(tokens[n]), state=st)
            else:
                out[n] = card(n, "", state="waiting")
        for n, why in skipped.items():
            out[n] = f"### {METHODS[n].label}\n\n⚠️ Not available for this model ({why})."
        return out

    def progress() -> tuple[float, str]:
        i = names.index(current) if current in names else len(names)
        frac = 0.15 + 0.85 * (i + min(1.0, len(tokens.get(current, [])) / max_new_tokens)) / len(names)
        what = f"{METHODS[current].label}: " + (f"decoding ({len(tokens[current])} tokens)" if tokens.get(current)
                                               else "prefill")
        return min(frac, 0.99), what

    thread = threading.Thread(target=work, name="sparsevid-compare", daemon=True)
    thread.start()
    last = 0.0
    try:
        while True:
            try:
                kind, name, payload = events.get(timeout=min_interval)
            except queue.Empty:
                kind = None
            changed = False
            while kind is not None:
                if kind == "token":
                    if first_token_s is None:
                        first_token_s = time.perf_counter() - t0
                    current = name
                    tokens[name].append(payload)
                elif kind == "result":
                    results[name] = payload
                    changed = True
                    i = names.index(name)
                    current = names[i + 1] if i + 1 < len(names) else None
                elif kind == "error":
                    raise payload
                elif kind == "done":
                    break
                try:
                    kind, name, payload = events.get_nowait()
                except queue.Empty:
                    kind = None
            if kind == "done":
                break
            now = time.perf_counter()
            if changed or now - last >= min_interval:
                last = now
                yield Update(status=info, cards=cards(), progress=progress())
    except SparsevidError as e:
        yield Update(status=f"⚠️ {e}", cards=cards(), error=str(e))
        return
    except Exception as e:  # noqa: BLE001
        log.exception("comparison failed")
        msg = f"Unexpected error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        yield Update(status=f"⚠️ {msg}", cards=cards(), error=msg)
        return
    finally:
        stop.set()
        thread.join(timeout=30)
    total_s = time.perf_counter() - t0
    view = _view(loaded, inputs, results, boxes)
    timing = (f"first token after **{first_token_s:.2f} s**, full comparison in **{total_s:.2f} s**"
              if first_token_s is not None else f"done in {total_s:.2f} s")
    log.info("run: %d methods, first token %.2f s, total %.2f s", len(names), first_token_s or -1, total_s)
    yield Update(status=info + "<br>" + timing, cards=cards(), progress=(1.0, "done"), view=view,
                 figures=figures(view))


# ------------------------------------------------------------------------------------------------
# Panels from a View


PANEL_TITLES = ("Selected tokens per head", "Head partition (HT-Sparse)", "Visual-head scores (SparseMM)",
                "Draft tokens, round by round", "Speed and memory relative to dense")


def default_choices(view: View) -> dict:
    """Initial method / layer / head / draft-method choices for a view."""
    sel = view.selection_methods()
    return dict(method=sel[0] if sel else None, layer=view.num_layers // 2, head=0,
                draft=(view.draft_methods() or [None])[0])


def panel_tokens(view: View, method: str | None, layer: int, head: int):
    title = PANEL_TITLES[0]
    if method not in view.kept:
        t = f"{title}: run a sparse method (StD, Streaming, HT-Sparse, SparseMM) to see the kept tokens"
        return plots.token_mosaic(view.frames, view.token_grid, view.grid, None, view.boxes, view.timestamps, t)
    layer = int(layer) if layer is not None else 0
    head = int(head) if head is not None else 0
    per = view.kept[method]
    if layer not in per:
        layer = min(per)
    mask = per[layer][min(head, per[layer].shape[0] - 1)]
    t = (f"{view.labels[method]} · layer {layer} · KV head {head}: keeps {int(mask.sum())} of {mask.size} "
         f"visual tokens ({mask.mean():.0%})")
    if view.boxes:
        share = plots.on_object_share(mask, view.token_grid, view.grid, view.boxes)
        if share is not None:
            t += (f"<br><sub>in frames showing the asked object, {share[0]:.0%} of the kept tokens fall on it "
                  f"(of all tokens: {share[1]:.0%})</sub>")
    return plots.token_mosaic(view.frames, view.token_grid, view.grid, mask, view.boxes, view.timestamps, t)


def _pick(d: dict, preferred: str | None):
    if preferred in d:
        return preferred
    return next(iter(d), None)


def panel_partition(view: View, method: str | None = None):
    m = _pick(view.roles, method)
    if m is None:
        return plots.placeholder(PANEL_TITLES[1], "Run HT-Sparse to see this panel.")
    r = view.roles[m]
    return plots.head_partition(r["roles"], r.get("saliency"), r.get("kv_lengths"),
                                title=f"{PANEL_TITLES[1]} · {view.labels[m]}")


def panel_scores(view: View, method: str | None = None):
    m = _pick(view.scores, method)
    if m is None:
        return plots.placeholder(PANEL_TITLES[2], "Run SparseMM to see this panel.")
    d = view.scores[m]
    sub = "uniform scores: no calibration file for this model" if d.get("uniform") else None
    return plots.visual_head_scores(d["scores"], d.get("budgets"), title=f"{PANEL_TITLES[2]} · {view.labels[m]}",
                                    subtitle=sub)


def panel_drafts(view: View, method: str | None):
    m = _pick(view.drafts, method)
    if m is None:
        return plots.placeholder(PANEL_TITLES[3], "Run a speculative method (StD, Streaming, LayerSkip or a draft) "
                                                  "to see this panel.")
    d = view.drafts[m]
    return plots.draft_rounds(d["first"], d["rounds"], title=f"{PANEL_TITLES[3]} · {view.labels[m]}")


def panel_speed(view: View):
    if not view.speed:
        return plots.placeholder(PANEL_TITLES[4], "Run at least one method besides dense to see this panel.")
    return plots.speedups(view.speed, title=PANEL_TITLES[4])


def figures(view: View, method: str | None = None, layer: int | None = None, head: int | None = None,
            draft: str | None = None) -> dict:
    """All five panels: {"tokens", "partition", "scores", "drafts", "speed"}."""
    c = default_choices(view)
    method = method if method is not None else c["method"]
    return dict(tokens=panel_tokens(view, method, c["layer"] if layer is None else layer, head or 0),
                partition=panel_partition(view, method), scores=panel_scores(view, method),
                drafts=panel_drafts(view, draft or c["draft"]), speed=panel_speed(view))


def empty_figures() -> dict:
    msg = "Upload a video, ask a question and press Run."
    return dict(tokens=plots.placeholder(PANEL_TITLES[0], msg), partition=plots.placeholder(PANEL_TITLES[1], msg),
                scores=plots.placeholder(PANEL_TITLES[2], msg), drafts=plots.placeholder(PANEL_TITLES[3], msg),
                speed=plots.placeholder(PANEL_TITLES[4], msg))

