"""The Gradio app: its logic and figures in process, then the running app end to end through
`gradio_client` (a real video file uploaded, every method run, bad inputs, the app still up).

The server is `app.py` in a subprocess (see `_appserver.py`): the embedded model when it is in
assets/, else a tiny random-weight Qwen2-VL; few frames and tokens keep it fast on a shared CPU.
"""

import json
import os
import re

import numpy as np
import pytest

import _appserver
from sparsevid import app_logic as logic
from sparsevid import plots
from sparsevid.errors import InputError
from sparsevid.methods import METHODS

FRAMES, MAX_NEW = 8, 8


# ------------------------------------------------------------------------------------------------
# In process: settings, examples, cards, figures


def test_settings_defaults_and_parsing():
    s = logic.settings_from({})
    assert s.k == 0.25 and s.gamma == 9 and s.refresh is True  # the app's K, else Settings' defaults
    s = logic.settings_from({"k": "", "gamma": 5, "refresh": False})
    assert s.k is None and s.gamma == 5 and s.refresh is False
    assert logic.settings_from({"k": "0.5"}).k == 0.5
    assert logic.settings_from({"k": "64"}).k == 64 and isinstance(logic.settings_from({"k": "64"}).k, int)
    for bad in ({"k": "abc"}, {"k": "-3"}, {"gamma": 0}, {"gamma": 99}):
        with pytest.raises(InputError):
            logic.settings_from(bad)
    if "htsparse" in METHODS:
        assert logic.settings_from({"ht_layers": "late"}).ht_layers == "late"
        with pytest.raises(InputError):
            logic.settings_from({"ht_layers": "nowhere"})


def test_setting_groups_cover_registered_methods():
    groups = logic.setting_groups()
    assert groups and all(any(m in METHODS for m in g.methods) for g in groups)
    names = {f.name for g in groups for f in g.fields}
    assert {"gamma", "k"} <= names
    if "htsparse" in METHODS:
        assert {"tau", "eta", "ht_layers"} <= names
    if "sparsemm" in METHODS:
        assert {"budget", "window", "rho"} <= names


def test_examples_and_boxes(tmp_path):
    clip = _appserver.write_clip(str(tmp_path / "a.mp4"), n=8)
    boxes = [None, [0.1, 0.2, 0.3, 0.4]] + [[0.5, 0.5, 0.9, 0.9]] * 6
    (tmp_path / "examples.json").write_text(json.dumps([
        {"file": "a.mp4", "question": "What colour is the square?", "answer": "red", "fps": 8, "boxes": boxes},
        {"file": "missing.mp4", "question": "q"}]))
    ex = logic.load_examples(str(tmp_path))
    assert [e["file"] for e in ex] == ["a.mp4"]
    copy = tmp_path / "upload" / "renamed.mp4"  # Gradio copies files: found by content
    copy.parent.mkdir()
    copy.write_bytes((tmp_path / "a.mp4").read_bytes())
    assert logic.find_example(str(copy), ex)["answer"] == "red"
    assert logic.find_example(clip, []) is None
    assert logic.sampled_boxes(boxes, [0.0, 0.125, 0.5], 8.0) == [None, boxes[1], boxes[4]]


def test_figures_from_plain_data():
    frames = np.random.RandomState(0).randint(0, 255, (4, 48, 64, 3)).astype(np.uint8)
    t, rows, cols = 2, 3, 4
    idx = np.arange(t * rows * cols)
    grid = np.stack([(idx // (rows * cols)) * 2, (idx % (rows * cols)) // cols, idx % cols], 1)
    kept = idx % 3 == 0
    boxes = [[0.0, 0.0, 0.5, 0.5]] * 4
    fig = plots.token_mosaic(frames, grid, (t, rows, cols), kept, boxes, [0, 0.5, 1, 1.5])
    assert fig.data[0].type == "image" and sum(d.type == "heatmap" for d in fig.data) == t
    assert len(fig.layout.shapes) == t  # one ground-truth box per shown frame
    share = plots.on_object_share(kept, grid, (t, rows, cols), boxes)
    assert share is not None and 0 <= share[0] <= 1
    roles = np.array([[-1, -1, -1, -1], [0, 1, 2, 2]])
    assert plots.head_partition(roles, np.full((2, 4), 0.25)).data[0].type == "heatmap"
    assert len(plots.visual_head_scores(np.ones((2, 4)) / 8, np.full((2, 2), 10)).data) == 2
    fig = plots.draft_rounds("a", [dict(proposed=["b", "c", "x"], accepted=2, bonus="d", draft_s=0.01, verify_s=0.02)])
    assert {d.name for d in fig.data} == {"prefill", "accepted", "rejected", "bonus"}
    assert plots.speedups([dict(label="StD", speedup=1.5, kv_ratio=1.2)]).data
    ph = plots.placeholder("t", "Run SparseMM to see this panel.")
    assert ph.layout.meta["placeholder"] and ph.data
    assert plots.top_share(np.array([0.9, 0.05, 0.05])) == pytest.approx(0.9)


def test_bad_input_never_raises(tmp_path):
    bad = tmp_path / "notes.mp4"
    bad.write_text("not a video")
    for args, needle in (((None, "q"), "Upload a video"), ((str(bad), ""), "question is empty"),
                         ((str(bad), "x" * 2000), "limit is"), ((str(bad), "what ?"), "notes.mp4")):
        ups = list(logic.run_comparison(args[0], args[1], "embedded", FRAMES, [], {}, MAX_NEW))
        assert ups[-1].error and needle in ups[-1].error, ups[-1].error
    ups = list(logic.run_comparison(str(bad), "q", "embedded", FRAMES, ["no-such-method"], {}, MAX_NEW))
    assert "Unknown method" in ups[-1].error


def test_run_streams_partial_answers(tiny_model_dir, tmp_path):
    clip = _appserver.write_clip(str(tmp_path / "c.mp4"), n=8)
    model = tiny_model_dir("qwen2_vl")
    ups = list(logic.run_comparison(clip, "what colour is the object ?", model, 4, ["std"], {}, 6,
                                    min_interval=0.005))
    assert ups[0].progress and "frames" in ups[0].progress[1].lower()
    assert any(u.cards and any("decoding" in c for c in u.cards.values()) for u in ups[:-1])
    final = ups[-1]
    assert final.error is None and set(final.cards) == {"dense", "std"}
    assert "first token after" in final.status and set(final.figures) == {"tokens", "partition", "scores",
                                                                           "drafts", "speed"}
    assert final.view.selection_methods() == ["std"] and final.view.draft_methods() == ["std"]
    kept = final.view.kept["std"]
    assert all(m.shape[1] == final.view.token_grid.shape[0] for m in kept.values())


# ------------------------------------------------------------------------------------------------
# The running app, through gradio_client


@pytest.fixture(scope="module")
def app():
    return _appserver.server()


@pytest.fixture(scope="module")
def client(app):
    from gradio_client import Client

    return Client(app["url"], verbose=False)


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    return _appserver.write_clip(str(tmp_path_factory.mktemp("clip") / "moving square.mp4"))


def _offered_methods(client) -> list[str]:
    for comp in client.config["components"]:
        if comp.get("props", {}).get("label", "").startswith("Methods"):
            return [c[1] if isinstance(c, (list, tuple)) else c for c in comp["props"]["choices"]]
    raise AssertionError("no methods checkbox")


def _args(video, question, model, methods, frames=FRAMES, max_new=MAX_NEW):
    from gradio_client import handle_file

    return handle_file(video) if video else None, question, model, frames, methods, max_new


def _run(client, video, question, model, methods, **kw):
    return client.predict(*_args(video, question, model, methods, **kw), api_name="/run")


def _cards(out) -> dict[str, str]:
    """method label -> card markdown, from a /run result."""
    return {o.splitlines()[0][4:]: o for o in out if isinstance(o, str) and o.startswith("### ")}


def _answer(card: str) -> str:
    m = re.search(r"^> (.*)$", card, re.M)
    assert m, card
    return m.group(1).strip()


def _plots(out) -> list[dict]:
    return [json.loads(o["plot"]) for o in out if isinstance(o, dict) and o.get("type") == "plotly"]


def test_app_runs_every_method(app, client, clip):
    offered = _offered_methods(client)
    assert sorted(offered) == sorted(n for n in METHODS if n != "dense"), "a registered method is hidden"
    out = _run(client, clip, _appserver.question_for(app["model"]), app["model"], offered)
    status = out[1]
    assert "full comparison in" in status and not status.startswith("⚠️"), status
    cards = _cards(out)
    assert set(cards) == {METHODS[n].label for n in ["dense"] + offered}, cards.keys()
    dense = _answer(cards["Dense"])
    assert dense and dense != "(empty answer)"
    for n in offered:
        card = cards[METHODS[n].label]
        assert "wall time" in card and "tokens/s" in card and "KV memory" in card and "speedup" in card
        if METHODS[n].lossless:
            assert _answer(card) == dense, (n, card)
            assert "✓ identical to dense" in card, card
        if METHODS[n].kind == "speculative":
            assert "acceptance" in card
    figs = _plots(out)
    assert len(figs) == 5
    for fig in figs:
        assert fig["data"], fig["layout"].get("title")
        assert not (fig["layout"].get("meta") or {}).get("placeholder"), fig["layout"].get("title")
    # Redraw panels 1-3 from the stored run (same session), no model call.
    sel = [n for n in offered if n in ("htsparse", "sparsemm", "std")] or offered
    layers = next(o for o in out if isinstance(o, dict) and o.get("__type__") == "update" and "maximum" in o)
    layer = int(layers["maximum"])
    redrawn = client.predict(sel[0], layer, 1, api_name="/redraw")
    figs = _plots(redrawn)
    assert len(figs) == 3 and all(f["data"] for f in figs)
    assert f"layer {layer} · KV head 1" in figs[0]["layout"]["title"]["text"]


def test_app_bundled_example_draws_ground_truth(app, client):
    ex = logic.load_examples(app["examples"])
    assert ex, "no bundled example"
    job = client.submit(*_args(ex[0]["path"], ex[0]["question"], app["model"], ["std"]), api_name="/run")
    out = job.result()
    assert len(job.outputs()) > 2  # streamed: progress and tokens before the final result
    assert "bundled example" in out[1] and "full comparison in" in out[1], out[1]
    tokens = _plots(out)[0]
    assert tokens["layout"].get("shapes"), "no ground-truth box on panel 1"


def test_app_bad_inputs_then_still_answers(app, client, clip, tmp_path):
    fake = tmp_path / "notes.mp4"  # a text file renamed .mp4
    fake.write_text("these are my notes, not a video\n" * 20)
    q = _appserver.question_for(app["model"])
    out = _run(client, str(fake), q, app["model"], [])
    assert out[1].startswith("⚠️") and "notes.mp4" in out[1], out[1]
    out = _run(client, clip, "   ", app["model"], [])
    assert out[1].startswith("⚠️") and "question is empty" in out[1], out[1]
    from sparsevid.models import KNOWN_CHECKPOINTS

    out = _run(client, clip, q, KNOWN_CHECKPOINTS[0], [])  # offline: the hub is unreachable
    assert out[1].startswith("⚠️") and "could not be loaded" in out[1], out[1]
    out = _run(client, clip, q, app["model"], ["std"], frames=4, max_new=4)
    assert "full comparison in" in out[1], out[1]
    cards = _cards(out)
    assert _answer(cards["Dense"]) == _answer(cards[METHODS["std"].label])
    assert app["proc"].poll() is None
    assert "Traceback" not in _appserver.log_tail(100_000)
