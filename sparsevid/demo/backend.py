"""Models (loaded once, cached by name), the one lock that serialises every use of them, and the
start-up check of which methods run on a model.

`RUN_LOCK` is held by whatever runs a model (a comparison's worker thread, the start-up check) for
its whole life, so a cancelled or abandoned run can never overlap the next one: the next run waits
for it (and the cancelled one stops at its next token).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import SparsevidError
from ..methods import METHODS
from ..models import EMBEDDED_NAME, KNOWN_CHECKPOINTS, Loaded, load_model
from ..runs import compile_steps, figures, run_method, warm_rows
from .config import settings_from

log = logging.getLogger("sparsevid.demo")

RUN_LOCK = threading.Lock()  # held while a model runs: one run at a time, never two overlapping

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


def describe_method(name: str) -> str:
    m = METHODS[name]
    return f"{m.label} · {'lossless' if m.lossless else 'lossy'}"


def one_line(e: BaseException) -> str:
    """`Type: first line of the message` (for the UI; the log gets the traceback)."""
    msg = str(e).splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


@functools.lru_cache(maxsize=None)
def get_model(name: str | None = None) -> Loaded:
    """The loaded model `name` (cached; a failed load is not cached); raises ModelError with a
    user-ready message. Call it with RUN_LOCK held. A loaded model is only read by runs (the engine
    never writes on it)."""
    name = name or default_model()
    t0 = time.perf_counter()
    loaded = load_model(name)
    log.info("loaded %s in %.1f s", name, time.perf_counter() - t0)
    return loaded


def _probe_frames(n: int = 4) -> np.ndarray:
    rng = np.random.RandomState(0)
    f = rng.randint(0, 60, size=(n, 64, 64, 3)).astype(np.uint8)
    for i in range(n):
        f[i, 20:36, 6 + 8 * i:22 + 8 * i] = (220, 40, 40)
    return f


def check_methods(name: str) -> dict[str, str]:
    """{method: why it fails} on model `name`: each method run briefly on a synthetic clip with the
    app's settings, its figures computed; a failure is logged with its traceback. Call it with
    RUN_LOCK held. Raises SparsevidError when the model does not load."""
    loaded = get_model(name)
    inputs = loaded.adapter.build_inputs(_probe_frames(), "what colour is the object ?").to(loaded.device)
    settings = settings_from()
    dense = run_method(loaded, inputs, "dense", settings, max_new_tokens=3)
    bad = {}
    for m in METHODS:
        if m == "dense":
            continue
        try:
            figures(run_method(loaded, inputs, m, settings, max_new_tokens=3), dense, loaded, inputs)
        except Exception as e:  # noqa: BLE001 - reported in the UI and logged with its traceback
            bad[m] = one_line(e)
            log.error("method %s does not run on model %s: %s", m, name, bad[m], exc_info=True)
    return bad


@functools.lru_cache(maxsize=None)
def _checked(name: str) -> tuple[tuple[str, str], ...]:
    return tuple(check_methods(name).items())


def broken_methods(name: str | None = None) -> dict[str, str]:
    """`check_methods`, once per model; {} on ZeroGPU (no GPU outside the decorated function) or
    with SPARSEVID_SELFCHECK=0. Call it with RUN_LOCK held."""
    if ZERO_GPU or os.environ.get("SPARSEVID_SELFCHECK", "1") == "0":
        return {}
    return dict(_checked(name or default_model()))


@dataclass
class Startup:
    """What the app shows at start: the default model, every method (label, name), the methods
    that failed the check ({name: why}) and a warning when the model did not load."""

    model: str
    methods: list[tuple[str, str]]
    broken: dict[str, str] = field(default_factory=dict)
    warning: str | None = None

    def message(self) -> str:
        """Markdown for the UI: what failed at start-up, and why ('' when nothing did)."""
        lines = []
        if self.warning:
            lines.append(f"⚠️ The default model could not be loaded: {self.warning}")
        for name, why in self.broken.items():
            lines.append(f"⚠️ **{METHODS[name].label}** failed the start-up check on `{self.model}` and will be "
                         f"skipped: {why}")
        return "\n\n".join(lines)


def compile_in_background(name: str | None = None, broken=()) -> threading.Thread | None:
    """Compile model `name`'s decode steps (`runs.compile_steps`) in a daemon thread: one method at a time
    under RUN_LOCK, the app's runs eager in between and until it is done; then (where compiled steps
    were kept) each method's batch steps (`runs.warm_rows` on two rows: one graph serves every batch
    size), so the first comparison of several questions does not compile them (11-65 s on 2 cores with
    a cold compile cache). $SPARSEVID_COMPILE: auto
    (default: kept where it measures faster), on, or off (also off on ZeroGPU, where the GPU is
    lent per request). Returns the thread, or None when off."""
    from .. import fast

    mode = os.environ.get("SPARSEVID_COMPILE", "auto")
    if mode == "off" or ZERO_GPU:
        return None

    def work():
        try:
            with RUN_LOCK:
                loaded = get_model(name)
                steps = fast.enable(loaded, mode)
                steps.enabled, steps.message = False, "eager while compiling in the background"
                steps.prepared = True  # a run's warm-up must not compile: this thread does
            inputs = loaded.adapter.build_inputs(_probe_frames(8), "what colour is the object ?").to(loaded.device)
            names = [m for m in METHODS if m != "dense" and m not in broken]
            settings = dict(settings_from(), k="0.25")  # every draft selects: its step kind gets compiled
            log.info("decode steps of %s: %s", loaded.name, compile_steps(loaded, inputs, names, settings, lock=RUN_LOCK))
            for method in ["dense", *names]:  # several questions decode as one batch: its steps' graphs too
                with RUN_LOCK:
                    warm_rows(loaded, [inputs, inputs], [method], settings, 12)
        except Exception:  # noqa: BLE001 - the app goes on eager
            log.exception("compiling the decode steps failed; the app stays eager")

    t = threading.Thread(target=work, name="sparsevid-compile", daemon=True)
    t.start()
    return t


def startup(model: str | None = None) -> Startup:
    """Load the default model, check which methods run on it and start compiling its decode steps
    in the background (`compile_in_background`). Never raises: a model that cannot load or an
    unexpected failure is logged and reported in `warning`; every method stays listed."""
    model = model or default_model()
    methods = [(describe_method(n), n) for n in METHODS if n != "dense"]
    try:
        with RUN_LOCK:
            broken = broken_methods(model)
        compile_in_background(model, broken)
        return Startup(model, methods, broken)
    except SparsevidError as e:
        log.warning("default model %s: %s", model, e)
        return Startup(model, methods, warning=str(e))
    except Exception as e:  # noqa: BLE001 - the app still starts; the reason is shown and logged
        log.exception("start-up check of %s failed", model)
        return Startup(model, methods, warning=one_line(e))
