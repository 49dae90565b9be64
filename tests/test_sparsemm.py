"""SparseMM: budgets (hand-computed), token choice, calibration end to end, methods against dense."""

import json
import os

import numpy as np
import pytest
import torch

from sparsevid import calibration as C
from sparsevid.cache import Prompt
from sparsevid.methods import sparsemm as S
from sparsevid.runs import compare
from sparsevid.toy.calibration import ToyClips

TINY_ARCHS = ("qwen2_vl", "qwen2_5_vl", "llava_onevision")


# ---- budgets (SPEC §3.3 step 2) -------------------------------------------------------------------

SCORES = torch.tensor([[0.5, 0.25], [0.25, 0.0]])  # L = 2, Hkv = 2


def test_budgets_formula():
    # B = 42, w = 32: base 10, floor ⌊0.1·10⌋ = 1, pool 9·4 = 36; cap = score·36 + 1 + 32
    caps = S.budgets(SCORES, 42, w=32, rho=0.1)
    assert caps.tolist() == [[51, 42], [42, 33]]
    assert caps.sum() == 42 * 4  # floors + windows + the whole pool
    assert (caps >= 32 + 1).all()  # window and floor for every head, a zero-score one included


def test_budgets_rounding_keeps_the_total():
    # pool 27: 13.5, 8.1, 5.4 (+ 33) -> floors 46, 41, 38 = 125; one unit left -> largest remainder (0.5)
    caps = S.budgets(torch.tensor([[0.5, 0.3, 0.2]]), 42, w=32, rho=0.1)
    assert caps.tolist() == [[47, 41, 38]]


def test_budgets_redistribute_excess():
    # prompt of 45: head (0,0) asks 51 -> 45; its excess 6 goes to the others by score (0.25, 0.25, 0)
    caps = S.budgets(SCORES, 42, w=32, rho=0.1, available=45)
    assert caps.tolist() == [[45, 45], [45, 33]]
    assert caps.sum() == 168


def test_budgets_redistribute_iterates():
    # prompt of 44: (0,0) -> 44 (excess 7); then (0,1) and (1,0) ask 42 + 3.5 = 45.5 > 44 -> 44;
    # the zero-score head gets all that is left: 168 - 3·44 = 36
    caps = S.budgets(SCORES, 42, w=32, rho=0.1, available=44)
    assert caps.tolist() == [[44, 44], [44, 36]]
    assert caps.sum() == 168


def test_budgets_prompt_shorter_than_budget():
    assert S.budgets(SCORES, 42, available=30).tolist() == [[30, 30], [30, 30]]
    # B below the window: the window shrinks to B, nothing else is kept
    assert S.budgets(SCORES, 20, w=32).tolist() == [[20, 20], [20, 20]]


def test_budgets_per_head_available_and_uniform_scores():
    avail = torch.tensor([[100, 100], [100, 40]])
    caps = S.budgets(torch.zeros(2, 2), 50, w=32, rho=0.5, available=avail)  # zero scores: uniform share
    # each asks 9 + 32 + 36/4 = 50; (1,1) holds 40, its 10 go to the other three: 53.33 each
    assert caps[1, 1] == 40 and sorted(caps.flatten().tolist()[:3]) == [53, 53, 54] and caps.sum() == 200


# ---- token choice (step 3) ------------------------------------------------------------------------


def test_snapkv_keep_window_and_top_positions():
    m, w = 20, 4
    attn = torch.zeros(2, m)
    attn[0, 3:8] = torch.tensor([1.0, 2, 3, 2, 1])  # pooled (kernel 5): 5 highest, then 4 and 6, then 3 and 7
    attn[1, 10:15] = torch.tensor([1.0, 2, 3, 2, 1])
    keep = S.snapkv_keep(attn, torch.tensor([5, 9]), w)
    assert keep[0].tolist() == [5, 16, 17, 18, 19]
    assert len(keep[1]) == 9 and set(range(10, 15)) <= set(keep[1].tolist())
    assert keep[1][-4:].tolist() == [16, 17, 18, 19]


def test_observation_rows_stay_out_of_the_video():
    from sparsevid.attention import LayerStats

    m, w = 40, 8
    window, relevance = torch.zeros(2, m), torch.zeros(2, m)
    window[:, 20:25] = torch.tensor([1.0, 2, 3, 2, 1])  # last-w rows, some of them visual tokens, like 22
    relevance[:, 5:10] = torch.tensor([1.0, 2, 3, 2, 1])  # the query tokens (36..39) like 7
    stats = LayerStats(relevance, window, torch.ones(4), torch.ones(4))

    def prompt(query_start):
        return Prompt(m, torch.arange(10, query_start), query_start, num_layers=1, num_heads=4, num_kv_heads=2)

    scores = C.HeadScores.uniform(1, 4, 2).scores
    p = prompt(36)  # 4 query tokens < w
    query = S.SparseMM(budget=w + 1, window=w, scores=scores).select(0, stats, p)
    assert [k.tolist() for k in query.keep] == [[7] + list(range(32, 40))] * 2
    plain = S.SparseMM(budget=w + 1, window=w, observe="window", scores=scores).select(0, stats, p)
    assert [k.tolist() for k in plain.keep] == [[22] + list(range(32, 40))] * 2
    # 10 query tokens >= w: SnapKV's last-w rows either way
    assert S.SparseMM(budget=w + 1, window=w, scores=scores).select(0, stats, prompt(30)).keep[0].tolist()[0] == 22
    # and a prefill computes only the rows it reads: the query's relevance, or the last w rows' attention
    assert S.SparseMM(window=w).needs(p) == (("relevance",), 0)
    assert S.SparseMM(window=w, observe="window").needs(p) == (("window",), w)
    assert S.SparseMM(window=w).needs(prompt(30)) == (("window",), w)


# ---- calibration ----------------------------------------------------------------------------------


def test_item_regions_and_naming(tiny_loaded):
    loaded = tiny_loaded("qwen2_vl")
    frames = np.zeros((4, 112, 112, 3), np.uint8)  # 112 px -> 4 x 4 token cells of 28 px, 2 frames per token
    inputs = loaded.adapter.build_inputs(frames, "hello")
    box = np.array([[30, 2, 50, 20]] * 4)  # covers cell (row 0, col 1) only
    late = np.array([[-1] * 4, [-1] * 4, [60, 60, 110, 110], [-1] * 4])  # frame 2 only: 2nd temporal token
    regions = C.item_regions(inputs, [C.Item(("apple",), box), C.Item(("apricot",), late)])
    vp = inputs.visual_positions
    assert regions[0].nonzero().squeeze(1).tolist() == [int(vp[1]), int(vp[16 + 1])]
    assert regions[1].nonzero().squeeze(1).tolist() == [int(vp[16 + 10]), int(vp[16 + 11]), int(vp[16 + 14]),
                                                         int(vp[16 + 15])]
    items = [C.Item(("apple",), box), C.Item(("apricot",), late)]
    assert C.named_item(" Apple", items) == 0
    assert C.named_item("ric", items) == 1  # a sub-word piece inside one word
    assert C.named_item("ap", items) is None  # inside both: names no single item
    assert C.named_item(",", items) is None


def test_hits_are_one_over_region_size(tiny_loaded, monkeypatch):
    loaded = tiny_loaded("qwen2_vl")
    frames = np.zeros((2, 112, 112, 3), np.uint8)
    item = C.Item(("red",), np.array([[0, 0, 56, 28]] * 2))  # two cells: (0,0), (0,1)
    sample = C.CalibSample(frames, "hello", [item])
    inputs = loaded.adapter.build_inputs(frames, "hello")
    L, H = loaded.num_layers, loaded.num_heads
    vp = inputs.visual_positions
    top1 = torch.zeros(3, L, H, dtype=torch.long)  # everything on position 0 (text)
    top1[0, 1, 2] = vp[1]  # token 0 names "red": layer 1 head 2 looks inside the region
    top1[0, 2, 0] = vp[5]  # ... layer 2 head 0 looks outside
    top1[1, 1, 2] = vp[0]  # token 1 names nothing: no hit
    red, blue = (loaded.tokenizer.convert_tokens_to_ids(w) for w in ("red", "blue"))
    monkeypatch.setattr(C, "generate_top1", lambda *a: ([red, blue, red], top1))
    hits, counts = C.sample_hits(loaded, sample, 8)
    expected = torch.zeros(L, H, dtype=torch.float64)
    expected[1, 2] = 0.5
    assert torch.equal(hits, expected) and counts["named"] == 2


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_generate_top1_matches_dense(tiny_loaded, video_inputs, arch):
    from sparsevid.engine import decode

    loaded, inputs = tiny_loaded(arch), video_inputs(arch)
    tokens, top1 = C.generate_top1(loaded, inputs, 10)
    assert tokens == decode(loaded, inputs, max_new_tokens=10).token_ids
    assert top1.shape == (len(tokens), loaded.num_layers, loaded.num_heads)
    assert int(top1.max()) < inputs.m + len(tokens)


class WholeFrame:
    """A text image whose one item covers every frame cell and is named by every known word, so
    any head whose top-1 key is visual scores: the hit path runs end to end on random models."""

    name = "whole-frame"

    def samples(self, loaded, n):
        for s in C.TextImages(words=4, frames=(2,)).samples(loaded, n):
            T, Hp, Wp = s.frames.shape[:3]
            words = tuple(C.TextImages().vocabulary(loaded))
            yield C.CalibSample(s.frames, s.question, [C.Item(words, np.array([[0, 0, Wp, Hp]] * T))])


@pytest.mark.filterwarnings("ignore:SparseMM calibration")  # random weights: few hits on real words
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_calibrate_end_to_end(tiny_loaded, arch, tmp_path):
    loaded = tiny_loaded(arch)
    L, H, Hkv = loaded.num_layers, loaded.num_heads, loaded.num_kv_heads
    out = str(tmp_path / "heads.json")
    hs = C.calibrate(loaded, samples=4, progress=False, out=out, max_new_tokens=12)  # rendered OCR images
    assert os.path.exists(out) and hs.meta["source"] == "text-images"
    assert hs.scores.shape == (L, Hkv) and hs.head_scores.shape == (L, H)
    assert torch.isclose(hs.scores.sum(), torch.tensor(1.0)) and torch.isclose(hs.head_scores.sum(), torch.tensor(1.0))
    assert torch.allclose(hs.scores, hs.head_scores.view(L, Hkv, -1).sum(-1))
    again = C.calibrate(loaded, samples=4, progress=False, out=out)  # reused, not recomputed
    assert again.meta["created"] == hs.meta["created"] and torch.equal(again.scores, hs.scores)
    hs = C.calibrate(loaded, samples=4, progress=False, source=WholeFrame(), max_new_tokens=24)
    assert not hs.meta["uniform"] and hs.meta["named_tokens"] > 0
    assert hs.meta["file"] == C.scores_path(loaded)  # default: the cache, keyed by model and revision
    assert torch.isclose(hs.scores.sum(), torch.tensor(1.0))
    assert C.load_scores(loaded).meta["file"] == hs.meta["file"]  # and the methods find it
    assert json.load(open(hs.meta["file"]))["key"] == C.model_key(loaded)


@pytest.mark.filterwarnings("ignore:SparseMM calibration")
def test_toy_clip_source_runs_on_any_model(tiny_loaded, tmp_path):
    loaded = tiny_loaded("qwen2_vl")  # its tokenizer knows the toy's colour and shape words
    hs = C.calibrate(loaded, samples=3, progress=False, out=str(tmp_path / "t.json"),
                     source=ToyClips(frames=(8,)), max_new_tokens=8)
    assert hs.meta["source"] == "toy-clips" and hs.meta["generated_tokens"] > 0
    assert torch.isclose(hs.scores.sum(), torch.tensor(1.0))


EMBEDDED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "toy-qwen2vl")


@pytest.mark.skipif(not os.path.exists(os.path.join(EMBEDDED, "config.json")), reason="embedded model not built")
def test_embedded_model_calibration(tmp_path):
    from sparsevid.models import load_model

    loaded = load_model("embedded", device="cpu", dtype="float32")
    from sparsevid.toy.calibration import default_source

    assert default_source(loaded).name == "toy-clips"
    shipped = C.find_scores(loaded)
    assert shipped is not None and shipped.startswith(C.SHIPPED_DIR), \
        "no calibration shipped for this embedded model: python -m sparsevid calibrate --ship --samples 200"
    hs = C.load_scores(loaded)
    assert not hs.meta["uniform"] and torch.isclose(hs.scores.sum(), torch.tensor(1.0))
    fresh = C.calibrate(loaded, samples=6, progress=False, out=str(tmp_path / "e.json"), max_new_tokens=12,
                        source=default_source(loaded))
    assert fresh.meta["source"] == "toy-clips" and fresh.meta["named_tokens"] > 0 and not fresh.meta["uniform"]


# ---- the methods ----------------------------------------------------------------------------------


def _uneven_scores(loaded):
    L, H = loaded.num_layers, loaded.num_heads
    hits = torch.zeros(L, H)
    hits[0, 0], hits[-1, -1], hits[1, 1] = 3.0, 1.0, 0.5
    return C.HeadScores.from_hits(hits, loaded.num_kv_heads)


def test_budget_at_least_prompt_equals_dense(tiny_loaded, video_inputs):
    loaded, inputs = tiny_loaded("qwen2_vl"), video_inputs("qwen2_vl")
    with pytest.warns(RuntimeWarning, match="no visual-head calibration"):
        traces, figures = compare(loaded, inputs, ["sparsemm"], {"budget": str(inputs.m)}, max_new_tokens=12)
    t = traces["sparsemm"]
    assert t.token_ids == traces["dense"].token_ids and figures["sparsemm"]["identical_to_dense"]
    assert t.head_scores["uniform"]
    assert t.layers == {}  # every layer keeps everything: nothing selected, no compact copy
    assert t.kv_bytes == traces["dense"].kv_bytes


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_small_budget_per_head_cache_and_lossless_draft(tiny_loaded, video_inputs, arch):
    loaded, inputs = tiny_loaded(arch), video_inputs(arch)
    path = _uneven_scores(loaded).save(C.scores_path(loaded))
    settings = {"budget": str(inputs.m // 3), "window": "8"}
    traces, figures = compare(loaded, inputs, ["sparsemm", "sparsemm-draft"], settings, max_new_tokens=12)
    direct, draft = traces["sparsemm"], traces["sparsemm-draft"]
    assert draft.token_ids == traces["dense"].token_ids and figures["sparsemm-draft"]["identical_to_dense"]
    assert direct.kv_bytes < traces["dense"].kv_bytes and figures["sparsemm"]["kv_ratio"] < 0.6
    kept = torch.tensor([direct.layers[l].lengths for l in range(loaded.num_layers)])
    assert kept.shape == (loaded.num_layers, loaded.num_kv_heads)
    assert kept.tolist() == direct.head_scores["caps"].tolist()
    assert len(set(kept.flatten().tolist())) > 1  # per-head lengths differ
    assert kept.sum() == (inputs.m // 3) * kept.numel()  # the budget is spent exactly
    assert kept[0, 0] == kept.max()  # the most visual head holds the most
    assert all(int(k[-1]) == inputs.m - 1 for k in direct.layers[0].kept)  # the local window is kept
    e, hs = figures["sparsemm"], direct.head_scores
    assert hs["file"] == path and not hs["uniform"] and 0 < hs["top5_mass"] <= 1
    assert e["prefill_kv_pct"] < 60 and e["decode_kv_pct"] < 100
    assert np.isclose(np.sum(hs["score_map"]), 1.0)


@pytest.mark.filterwarnings("ignore:SparseMM calibration")
def test_calibrate_cli(tiny_model_dir, tmp_path, capsys):
    from sparsevid.cli import main

    out = tmp_path / "cal.json"
    assert main(["calibrate", "--model", tiny_model_dir("qwen2_vl"), "--samples", "2", "--max-new-tokens", "4",
                 "--out", str(out), "--json", "--device", "cpu"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["file"] == str(out) and np.isclose(np.sum(d["scores"]), 1.0) and out.exists()


@pytest.mark.skipif(not os.path.exists(os.path.join(EMBEDDED, "config.json")), reason="embedded model not built")
def test_settings_sweep_cli_runs_sparsemm(capsys):
    """`htsparse_ablation --method sparsemm` sweeps SparseMM's budget beside dense on the embedded
    model: a budget that keeps the whole prompt is dense, a small one keeps less KV; an unknown
    method or setting is one line on stderr, no traceback."""
    from sparsevid.htsparse_ablation import main

    assert main(["--method", "sparsemm", "--n", "1", "--frames", "16", "--configs", "budget=1.0,0.2", "--json"]) == 0
    dense, whole, small = json.loads(capsys.readouterr().out)
    assert whole["same_as_dense"] == 100 and whole["accuracy"] == dense["accuracy"]
    assert small["decode_kv_pct"] < 50 < whole["decode_kv_pct"]
    for argv in (["--method", "nope"], ["--method", "sparsemm", "--configs", "budgte=0.3"]):
        assert main(argv + ["--n", "1", "--frames", "16"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("error: Unknown") and "Traceback" not in "".join(err)
