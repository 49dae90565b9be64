"""What the demo offers and accepts: limits, the settings fields and the bundled examples.

The settings fields are the methods' own declarations (`methods.all_options()`): label, help,
range, kind and choices come from there, and every value typed in the app is parsed by
`options.parse` (through `methods.check_settings`), the parser the CLI uses, so "1" for K keeps
one token and "0.1" keeps 10 %, as `--k 1` and `--k 0.1` do.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from dataclasses import dataclass

from ..methods import METHODS, all_options, check_settings, methods_using
from ..models import ASSETS
from ..options import Option

log = logging.getLogger("sparsevid.demo")

# ------------------------------------------------------------------------------------------------
# Limits (stated in the UI)

MAX_UPLOAD_MB = int(os.environ.get("SPARSEVID_MAX_UPLOAD_MB", 200))
MAX_MINUTES = float(os.environ.get("SPARSEVID_MAX_MINUTES", 10))
MAX_QUESTION_CHARS = 500
FRAMES = dict(minimum=2, maximum=256, value=16, step=2)  # 256: the bundled long clip's length
MAX_NEW_TOKENS = dict(minimum=1, maximum=256, value=96, step=1)  # a narration: up to ~70
# Passes of dense and every method whose medians give the speed figures (`runs.compare`): one pass
# is noise on a shared machine (±25 % per run measured here). At least TIMING_REPEATS (as `run
# --repeats`), and more, up to TIMING_MAX_REPEATS, while the timing passes fit in TIMING_BUDGET_S
# seconds: short clips get more pairs for the same wait.
TIMING_REPEATS = max(1, int(os.environ.get("SPARSEVID_TIMING_REPEATS", "3")))
TIMING_MAX_REPEATS = max(TIMING_REPEATS, int(os.environ.get("SPARSEVID_TIMING_MAX_REPEATS", "9")))
TIMING_BUDGET_S = float(os.environ.get("SPARSEVID_TIMING_BUDGET_S", "20"))
VIDEO_TYPES = [".mp4", ".webm", ".mov", ".mkv", ".avi", ".gif"]
EXAMPLES_DIR = os.environ.get("SPARSEVID_EXAMPLES_DIR") or os.path.join(ASSETS, "examples")


def limits_text() -> str:
    return (f"Video: {', '.join(t[1:] for t in VIDEO_TYPES)}; up to {MAX_UPLOAD_MB} MB and "
            f"{MAX_MINUTES:g} minutes. Question: up to {MAX_QUESTION_CHARS} characters.")


# ------------------------------------------------------------------------------------------------
# Settings fields, one per `methods.all_options()` entry

# Where the demo's fields start from other text than the declared default (typed as a user would).
PRESETS = {"k": ("0.25", "Default rule (blank): K = 1024 − text tokens, capped at the visual tokens, so a short "
                         "clip keeps every visual token and the draft equals dense. Demo preset: 0.25, a quarter of the visual tokens.")}


@dataclass(frozen=True)
class Field:
    """One settings widget. widget: "checkbox" | "dropdown" | "textbox" (amounts and optional whole
    numbers: blank is the default rule) | "slider" | "number". value: its initial value."""

    option: Option
    widget: str
    value: object
    info: str
    step: float | None = None

    @property
    def key(self) -> str:
        return self.option.key

    @property
    def label(self) -> str:
        return self.option.title


@dataclass(frozen=True)
class Group:
    title: str
    methods: tuple[str, ...]  # the methods that read these settings
    fields: tuple[Field, ...]


def field_for(opt: Option) -> Field:
    info = opt.help.rstrip(".") + "."
    if opt.kind == "bool":
        return Field(opt, "checkbox", bool(opt.default), info)
    if opt.kind == "choice":
        return Field(opt, "dropdown", opt.default, info)
    if opt.kind in ("amount", "optional_int"):
        value = "" if opt.default is None else str(opt.default)
        if opt.key in PRESETS:
            value, note = PRESETS[opt.key]
            info += " " + note
        return Field(opt, "textbox", value, info)
    if opt.min is not None and opt.max is not None:
        return Field(opt, "slider", opt.default, info, 1 if opt.kind == "int" else 0.01)
    return Field(opt, "number", opt.default, info)


def _group_title(names: tuple[str, ...]) -> str:
    spec = tuple(n for n, m in METHODS.items() if m.kind == "speculative")
    if names == spec:
        return "Speculative decoding (every draft)"
    stems = [METHODS[n].label.split(" (")[0].removesuffix(" draft") for n in names]
    return " / ".join(dict.fromkeys(stems))


def setting_groups() -> list[Group]:
    """The settings grouped by the methods that read them, in registry order."""
    groups: dict[tuple[str, ...], list[Field]] = {}
    for opt in all_options():
        groups.setdefault(tuple(methods_using(opt.key)), []).append(field_for(opt))
    return [Group(_group_title(names), names, tuple(fields)) for names, fields in groups.items()]


def setting_fields() -> list[Field]:
    return [f for g in setting_groups() for f in g.fields]


def settings_from(values: dict | None = None) -> dict:
    """The app's fields {key: text or value} (a missing key takes the field's initial value) ->
    parsed settings {key: value}. Raises InputError on a bad value (a one-line message)."""
    return check_settings({**{f.key: f.value for f in setting_fields()}, **(values or {})})


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
        log.warning("could not read %s", path, exc_info=True)
        return []
    out = []
    for e in entries:
        p = os.path.join(folder, e.get("file", ""))
        if e.get("file") and os.path.isfile(p) and e.get("question"):
            out.append(dict(e, path=p))
    return out


def digest(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha1(f.read(64 << 20)).hexdigest()
    except OSError:
        return None


def _index(examples: list[dict]) -> tuple[tuple[str, dict], ...]:
    return tuple((d, e) for e in examples if (d := digest(e["path"])))


@functools.lru_cache(maxsize=4)
def _bundled_index(folder: str) -> tuple[tuple[str, dict], ...]:
    return _index(load_examples(folder))


def find_example(path: str, question: str | None = None, examples: list[dict] | None = None) -> dict | None:
    """The bundled example whose file has the same content as `path` (Gradio copies uploads and
    example files, so names and folders differ) and whose question is `question` (compared after
    `toy.questions.normalise`; None: any question), or None. Its answer and boxes are about its
    own question, so another question on the same clip gets neither."""
    from ..toy.questions import normalise

    index: dict[str, list[dict]] = {}
    for e in (_bundled_index(EXAMPLES_DIR) if examples is None else _index(examples)):
        index.setdefault(e[0], []).append(e[1])
    key = digest(path) if index else None
    for e in index.get(key, []) if key else []:
        if question is None or normalise(e["question"]) == normalise(question):
            return e
    return None


def sampled_boxes(boxes: list, timestamps: list[float], fps: float) -> list:
    """Per source frame boxes (None where the object is not visible) -> one per sampled frame,
    taking the source frame on screen at each sampled timestamp."""
    return [boxes[min(len(boxes) - 1, max(0, int(round(t * fps))))] for t in timestamps] if boxes else []


# ------------------------------------------------------------------------------------------------
# The page's texts and style (app.py lays them out)

CSS = """.card thead { display: none; } .card table { width: 100%; font-size: 0.9em; }
.card td:first-child { white-space: nowrap; }
.help { color: #555; font-size: 0.92em; margin-top: -6px; }"""
INTRO = """# sparsevid: faster Video-LLM decoding from attention sparsity
Upload a video and ask a question. The model answers with **dense** decoding and with each method
you pick, on the same inputs: **StD** (a top-K sparse draft verified by dense, lossless),
**HT-Sparse** (query-guided head and token routing), **SparseMM** (visual heads get larger KV budgets),
and the Streaming and LayerSkip drafts. The answers appear on the right; the panels below show what each method did."""
FRAMES_INFO = ("Up to 256 (the bundled long clip's length): 4,608 visual tokens for the embedded model, about 1 s of "
               "prefill per run on a 2-core CPU, so 15-30 s for a few methods; 16-32 frames take a few seconds.")
SCROLL_TO_ANSWERS = "() => document.getElementById('status')?.scrollIntoView({behavior: 'smooth', block: 'start'})"
