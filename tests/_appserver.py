"""The app in a subprocess, started once per test process and shared by test_app and test_browser.

The model is the embedded one when `assets/toy-qwen2vl` holds it, else a tiny random-weight
Qwen2-VL built in a temporary folder. The server runs with the shared-CPU settings the app needs
(OMP_WAIT_POLICY=PASSIVE, one OpenMP thread) and no hub access.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMBEDDED_CONFIG = os.path.join(ROOT, "assets", "toy-qwen2vl", "config.json")
START_TIMEOUT = 240  # seconds: imports + model load + the start-up method check on a loaded CPU

_server: dict | None = None


def pick_model(tmp: str) -> str:
    """$SPARSEVID_TEST_MODEL if set; else 'embedded' when the trained toy model is there; else a tiny
    random Qwen2-VL folder in tmp."""
    if os.environ.get("SPARSEVID_TEST_MODEL"):
        return os.environ["SPARSEVID_TEST_MODEL"]
    if os.path.exists(EMBEDDED_CONFIG):
        return "embedded"
    from sparsevid.tiny import make_tiny_model

    return make_tiny_model("qwen2_vl", os.path.join(tmp, "tiny-qwen2vl"))


def question_for(model: str) -> str:
    return "What colour is the square?" if model == "embedded" else "what colour is the object ?"


def write_clip(path: str, n: int = 16, fps: float = 8.0) -> str:
    """A red square moving left to right over a dark noisy background, like the toy clips."""
    from sparsevid.video import write_video

    rng = np.random.RandomState(0)
    frames = rng.randint(0, 50, size=(n, 96, 96, 3)).astype(np.uint8)
    for i in range(n):
        x = 4 + 4 * i
        frames[i, 36:60, x:x + 24] = (220, 40, 40)
    write_video(path, frames, fps)
    return path


def write_examples(folder: str, model: str) -> str:
    """A stand-in for assets/examples (until the bundled clips exist): one clip, its question and
    the square's per-frame boxes, in the bundled examples.json format."""
    os.makedirs(folder, exist_ok=True)
    n, fps = 16, 8.0
    write_clip(os.path.join(folder, "square.mp4"), n, fps)
    boxes = [[(4 + 4 * i) / 96, 36 / 96, (28 + 4 * i) / 96, 60 / 96] for i in range(n)]
    with open(os.path.join(folder, "examples.json"), "w") as f:
        json.dump([{"file": "square.mp4", "question": question_for(model), "answer": "red", "fps": fps,
                    "frames": n, "boxes": boxes}], f)
    return folder


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop() -> None:
    global _server
    if _server is None:
        return
    proc = _server["proc"]
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
    _server["log"].close()
    shutil.rmtree(_server["tmp"], ignore_errors=True)
    _server = None


def server() -> dict:
    """{"url", "model", "examples", "tmp", "proc", "log_path"} of the running app (started on first call)."""
    global _server
    if _server is not None and _server["proc"].poll() is None:
        return _server
    tmp = tempfile.mkdtemp(prefix="sparsevid-app-")
    model = pick_model(tmp)
    port = _free_port()
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", GRADIO_ANALYTICS_ENABLED="False",
               GRADIO_SERVER_NAME="127.0.0.1", GRADIO_SERVER_PORT=str(port), SPARSEVID_MODEL=model,
               PYTHONUNBUFFERED="1", GRADIO_TEMP_DIR=os.path.join(tmp, "gradio"))
    examples = os.path.join(ROOT, "assets", "examples")
    if not os.path.exists(os.path.join(examples, "examples.json")):
        examples = env["SPARSEVID_EXAMPLES_DIR"] = write_examples(os.path.join(tmp, "examples"), model)
    log_path = os.path.join(tmp, "server.log")
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "app.py")], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    _server = dict(url=f"http://127.0.0.1:{port}/", model=model, tmp=tmp, proc=proc, log=log, log_path=log_path,
                   examples=examples)
    atexit.register(_stop)
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            with urllib.request.urlopen(_server["url"], timeout=5) as r:
                if r.status == 200:
                    return _server
        except OSError:
            time.sleep(0.5)
    tail = log_tail()
    _stop()
    raise RuntimeError(f"the app did not start within {START_TIMEOUT} s:\n{tail}")


def log_tail(n: int = 4000) -> str:
    if _server is None:
        return ""
    with open(_server["log_path"]) as f:
        return f.read()[-n:]
