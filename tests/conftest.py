"""Shared fixtures: tiny random-weight models of each architecture, built once per session.

The environment is set before torch/transformers are imported: no hub access, and OpenMP
threads that sleep instead of spinning (the test machines are shared).
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("SPARSEVID_COMPILE", "off")  # the app's background compile: only where a test asks
# the app's timing passes: its minimum (3) only, not more within its 20 s budget (test time; the budget
# itself is tested on runs.compare)
os.environ.setdefault("SPARSEVID_TIMING_BUDGET_S", "0")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():  # Triton's kernels run through its interpreter on the CPU (tests/test_kernels.py);
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton.language is first imported, so set it here

ARCHS = ("qwen2_vl", "qwen2_5_vl", "llava_onevision")


@pytest.fixture(autouse=True)
def own_calibration_cache(tmp_path, monkeypatch):
    """SparseMM calibrations land in a per-test cache, never in the user's ~/.cache (the files shipped
    in assets/visual_heads/ still apply), and no test sees another's loaded scores."""
    from sparsevid import calibration

    monkeypatch.setenv("SPARSEVID_CACHE", str(tmp_path / "cache"))
    calibration._LOADED_SCORES.clear()
    yield
    calibration._LOADED_SCORES.clear()


@pytest.fixture(autouse=True)
def no_carried_gamma_verdicts():
    """Every test starts without the verdicts earlier tests' adaptive runs left on the shared models
    (`engine.HopelessShapes`: a draft found hopeless at a shape is not probed in the next runs there)."""
    from sparsevid.engine import HopelessShapes

    HopelessShapes.VERDICTS.clear()
    yield


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """tiny_model_dir(arch) -> folder of a saved tiny `arch` model (built once per session)."""
    from sparsevid.tiny import make_tiny_model

    built = {}

    def get(arch: str) -> str:
        if arch not in built:
            built[arch] = make_tiny_model(arch, str(tmp_path_factory.mktemp(arch)))
        return built[arch]

    return get


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dir):
    """tiny_loaded(arch) -> `Loaded` tiny model on CPU in float32, through `load_model` (once per session).

    Shared between tests: a test that changes the model (e.g. its attention implementation)
    must restore it.
    """
    from sparsevid.models import load_model

    loaded = {}

    def get(arch: str):
        if arch not in loaded:
            loaded[arch] = load_model(tiny_model_dir(arch), device="cpu", dtype="float32")
        return loaded[arch]

    return get


@pytest.fixture(scope="session", params=ARCHS)
def arch(request):
    return request.param


@pytest.fixture(scope="session")
def frames():
    """Six 60 x 80 RGB frames: a bright square moving left to right on a dark noisy background."""
    rng = np.random.RandomState(0)
    out = rng.randint(0, 60, size=(6, 60, 80, 3)).astype(np.uint8)
    for i in range(len(out)):
        x = 4 + 10 * i
        out[i, 20:36, x:x + 16] = (230, 40, 40)
    return out


@pytest.fixture(scope="session")
def video_inputs(tiny_loaded, frames):
    """video_inputs(arch) -> the prefill inputs of `frames` and a fixed question for that model."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = tiny_loaded(arch).adapter.build_inputs(frames, "what colour is the moving object ?")
        return cache[arch]

    return get



EMBEDDED_QUESTION_SEED = 12345  # a 16-frame colour question of the toy task (outside the training seeds)


def _load_embedded():
    from sparsevid.models import EMBEDDED, load_model

    if not os.path.exists(os.path.join(EMBEDDED, "config.json")):
        pytest.skip("embedded model not built (python -m sparsevid.toy train)")
    return load_model("embedded", device="cpu", dtype="float32")


def _embedded_inputs(loaded):
    from sparsevid.toy.questions import make_sample

    s = make_sample(EMBEDDED_QUESTION_SEED, 16, "colour")
    return loaded.adapter.build_inputs(s.clip.frames, s.question)


@pytest.fixture(scope="session")
def model_inputs(tiny_loaded, video_inputs):
    """model_inputs(name) -> (Loaded, VideoInputs): a tiny architecture of `ARCHS` with `frames`, or
    "embedded": the embedded toy Qwen2-VL (CPU, float32; skips where it has not been built) with a
    16-frame toy clip and its colour question. Loaded once per session."""
    cache = {}

    def get(name: str):
        if name not in cache:
            if name == "embedded":
                loaded = _load_embedded()
                cache[name] = (loaded, _embedded_inputs(loaded))
            else:
                cache[name] = (tiny_loaded(name), video_inputs(name))
        return cache[name]

    return get


@pytest.fixture(scope="session")
def embedded(model_inputs):
    """The embedded toy model (`Loaded`), once per session; skips where it has not been built."""
    return model_inputs("embedded")[0]


@pytest.fixture(scope="session")
def embedded_inputs(model_inputs):
    return model_inputs("embedded")[1]
