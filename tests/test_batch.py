"""Batched decoding: B prompts of different lengths decoded together give every row the tokens of
its own one-row run, for every method, on every tiny architecture; rows end at different steps and
reject drafts at different positions; sampling per row keeps dense's distribution."""

import dataclasses

import numpy as np
import pytest
import torch

from sparsevid import cache as cache_mod, engine, kernels, runs
from sparsevid.cache import write_at
from sparsevid.engine import Sampling
from test_house import LOSSLESS

ARCHS = ("qwen2_vl", "qwen2_5_vl", "llava_onevision")

SETTINGS = {"dense": {}, **LOSSLESS,  # really sparse drafts and selections, several rounds
            "htsparse": {"heads_full": "0.25", "heads_sparse": "0.5", "eta": "0.5", "ht_layers": "all"},
            "sparsemm": {"budget": "0.3", "window": "4"}}


def clip(n, seed, size=112):
    return (np.random.RandomState(seed).rand(n, size, size, 3) * 255).astype(np.uint8)


@pytest.fixture(scope="module")
def ragged(tiny_loaded):
    """ragged(arch) -> (loaded, [inputs of 3 prompts of different lengths and questions])."""
    cache = {}

    def get(arch):
        if arch not in cache:
            loaded = tiny_loaded(arch)
            cache[arch] = (loaded, [loaded.adapter.build_inputs(clip(n, seed), q) for n, seed, q in
                                    ((8, 0, "what colour is the object ?"), (4, 1, "how many ?"),
                                     (12, 2, "describe the moving square in the video please"))])
        return cache[arch]

    return get


@pytest.mark.filterwarnings("ignore:SparseMM")  # tiny models have no calibration: uniform scores
@pytest.mark.parametrize("arch", ARCHS)
def test_every_method_batched_equals_its_one_row_runs(ragged, arch, monkeypatch):
    # one-row runs split a compact cache's heads by length wherever they differ (`cache.head_parts`);
    # a batch stacks each layer in one buffer (`SparseKV.merge`): the same tokens either way (splits
    # exist for the SDPA backend: the others stop at each head's length)
    monkeypatch.setattr(cache_mod, "SPLIT_MIN_SAVED", 1)
    monkeypatch.setattr(kernels, "FORCED", "sdpa")
    loaded, inputs = ragged(arch)
    assert len({x.m for x in inputs}) == 3
    # An end token the first row says early (and the others may say at other steps): rows end apart.
    first = runs.run_method(loaded, inputs[0], "dense", max_new_tokens=12).token_ids
    monkeypatch.setattr(type(loaded.adapter), "eos_token_ids", property(lambda self: [first[3]]))
    for name, settings in SETTINGS.items():
        one = [runs.run_method(loaded, x, name, settings, max_new_tokens=12) for x in inputs]
        batch = runs.run_rows(loaded, inputs, name, settings, max_new_tokens=12)
        assert [t.token_ids for t in batch] == [t.token_ids for t in one], name
        assert all(t.batch == 3 for t in batch)
        # continuous batching: two rows at a time, the third prompt joining as the first row ends
        flowing = runs.run_rows(loaded, inputs, name, settings, max_new_tokens=12, width=2)
        assert [t.token_ids for t in flowing] == [t.token_ids for t in one], name
        assert all(t.batch == 2 and t.decode_s > 0 for t in flowing)
        if batch[0].kind != "direct":  # lossless: dense's tokens, so the first row ends by its 4th token
            assert len(batch[0].token_ids) <= 4 < max(len(t.token_ids) for t in batch), name
        if batch[0].kind == "direct":  # the same selections per row
            for a, b in zip(one, batch):
                assert all(np.array_equal(x, y) for layer in a.layers for x, y in
                           zip(a.layers[layer].kept, b.layers[layer].kept))
    # a draft close to dense (90 % of the visual tokens): rows accept different numbers of tokens
    close = {"k": "0.9", "gamma": "3", "adaptive_gamma": "off"}  # drafting from the first round
    one = [runs.run_method(loaded, x, "std", close, max_new_tokens=12) for x in inputs]
    batch = runs.run_rows(loaded, inputs, "std", close, max_new_tokens=12)
    assert [t.token_ids for t in batch] == [t.token_ids for t in one]
    assert len({r.accepted for t in batch for r in t.rounds}) >= 2
    events = []  # two at a time: row 2 is prefilled while row 1 still decodes
    flowing = runs.run_rows(loaded, inputs, "std", close, max_new_tokens=12, width=2,
                            on_token=lambda b, t: events.append(b))
    rows = "".join(map(str, events))
    assert [t.token_ids for t in flowing] == [t.token_ids for t in one]
    assert rows.index("2") < rows.rindex("1") and rows.count("2") == len(one[2].token_ids), rows


def test_a_batch_stacks_the_rows_once_and_steps_over_rows_that_end(ragged, monkeypatch):
    """The rows share one buffer per layer ([B, ...]); while more than half of them still decode,
    rows that ended sit idle in it (no copy); once at most half are left, those are stacked again
    (a smaller buffer). Each row's cache is a view of it (rollback and refresh stay per row)."""

    loaded, inputs = ragged("qwen2_vl")
    prompts = inputs + inputs[::-1]  # six rows
    sizes, idle = [], []
    real, real_idle = cache_mod.Stack.__init__, engine._idle_rows

    def spy(self, caches, *a, **k):
        sizes.append(len(caches))
        real(self, caches, *a, **k)

    monkeypatch.setattr(cache_mod.Stack, "__init__", spy)
    monkeypatch.setattr(engine, "_idle_rows", lambda caches: idle.append(real_idle(caches)) or idle[-1])
    one = [runs.run_method(loaded, x, "std", SETTINGS["std"], max_new_tokens=12).token_ids for x in prompts]
    first = one[0]
    monkeypatch.setattr(type(loaded.adapter), "eos_token_ids", property(lambda self: [first[3]]))
    one = [runs.run_method(loaded, x, "std", SETTINGS["std"], max_new_tokens=12).token_ids for x in prompts]
    sizes.clear()
    batch = runs.run_rows(loaded, prompts, "std", SETTINGS["std"], max_new_tokens=12)
    assert [t.token_ids for t in batch] == one
    assert sizes[0] == 6 and all(n <= 3 for n in sizes[1:]), sizes
    assert any(i is not None and len(i[1]) < 6 for i in idle)  # steps with ended rows idle


@pytest.mark.filterwarnings("ignore:SparseMM")
def test_a_prompt_that_joins_takes_the_row_that_ended_in_place(ragged, monkeypatch):
    """Continuous batching, two rows at a time over five prompts: a prompt that joins where a longer
    one ended is copied into that row of the stacked buffers (the other row untouched, no restack);
    one that does not fit is stacked again; every row keeps its one-row tokens, for dense, StD
    (compact draft caches) and SparseMM (per-head layouts, split by length in its one-row runs, SDPA)."""
    monkeypatch.setattr(cache_mod, "SPLIT_MIN_SAVED", 1)
    monkeypatch.setattr(kernels, "FORCED", "sdpa")
    loaded, inputs = ragged("qwen2_vl")
    prompts = [inputs[2], inputs[1], inputs[0], inputs[1], inputs[2]]  # 12, 4, 8, 4, 12 frames
    placed, stacked = [], []
    real_replace, real_init = cache_mod.Stack.replace, cache_mod.Stack.__init__
    monkeypatch.setattr(cache_mod.Stack, "replace", lambda self, b, c: placed.append(real_replace(self, b, c))
                        or placed[-1])
    monkeypatch.setattr(cache_mod.Stack, "__init__", lambda self, caches, *a, **k: stacked.append(len(caches))
                        or real_init(self, caches, *a, **k))
    for name in ("dense", "std", "sparsemm"):
        # an end token the first (longest) prompt says early: a shorter one joins in its row
        first = runs.run_method(loaded, prompts[0], name, SETTINGS[name], max_new_tokens=12).token_ids
        monkeypatch.setattr(type(loaded.adapter), "eos_token_ids", property(lambda self, t=first[3]: [t]))
        one = [runs.run_method(loaded, x, name, SETTINGS[name], max_new_tokens=12).token_ids for x in prompts]
        placed.clear()
        stacked.clear()
        flowing = runs.run_rows(loaded, prompts, name, SETTINGS[name], max_new_tokens=12, width=2)
        assert [t.token_ids for t in flowing] == one, name
        assert any(placed) and stacked.count(2) < 4, (name, placed, stacked)


def test_a_batch_prefills_into_its_stacked_buffers_so_stacking_copies_nothing(ragged, monkeypatch):
    """The first rows' dense caches are reserved in the stack's layout before their prefills
    (`cache.StackRows`): each prefill writes its KV into its row, so the stack copies nothing (it
    copied every row's KV at the batch's first step). Where a row ends at its first token the other
    rows are stacked by copying, as before. Every row keeps its one-row tokens either way."""
    loaded, inputs = ragged("qwen2_vl")
    copied = []
    real = cache_mod.Stack._copy
    monkeypatch.setattr(cache_mod.Stack, "_copy", staticmethod(lambda out, b, row: copied.append(b) or real(out, b, row)))
    one = [runs.run_method(loaded, x, "dense", max_new_tokens=8).token_ids for x in inputs]
    copied.clear()
    assert [t.token_ids for t in runs.run_rows(loaded, inputs, "dense", max_new_tokens=8)] == one
    assert copied == []
    ends = one[1][0]  # the second prompt's first token ends it
    monkeypatch.setattr(type(loaded.adapter), "eos_token_ids", property(lambda self: [ends]))
    one = [runs.run_method(loaded, x, "dense", max_new_tokens=8).token_ids for x in inputs]
    assert one[1] == [ends]
    assert [t.token_ids for t in runs.run_rows(loaded, inputs, "dense", max_new_tokens=8)] == one
    assert copied


@pytest.mark.filterwarnings("ignore:SparseMM")
@pytest.mark.parametrize("name", ["std", "htsparse", "sparsemm"])
def test_compact_caches_are_prefilled_into_their_stacked_rows_too(ragged, monkeypatch, name):
    """The compact caches of a batch's rows (StD's draft, HT-Sparse's and SparseMM's only caches)
    are built in their rows of the stacked buffers too (`StackRows.row` with the entries a selection
    needs), so the first step copies no KV at all (StD's first round copied its rows' compact caches:
    12 ms at 8 rows of 4,608 visual tokens); every row keeps its one-row tokens."""
    loaded, inputs = ragged("qwen2_vl")
    copied = []
    real = cache_mod.Stack._copy
    monkeypatch.setattr(cache_mod.Stack, "_copy", staticmethod(lambda out, b, row: copied.append(b) or real(out, b, row)))
    one = [runs.run_method(loaded, x, name, SETTINGS[name], max_new_tokens=8).token_ids for x in inputs]
    copied.clear()
    assert [t.token_ids for t in runs.run_rows(loaded, inputs, name, SETTINGS[name], max_new_tokens=8)] == one
    assert copied == []


def test_reserved_rows_are_zeroed_past_what_each_prefill_wrote(monkeypatch):
    """A reserved buffer is allocated uninitialised (here: NaN) and each row zeroed as its cache
    first writes, so the masked tail past a row's length is 0, never NaN (0 x NaN is NaN); the stack
    then holds each row's KV in place, its caches views of it."""
    monkeypatch.setattr(cache_mod.Buffers, "empty", lambda self, name, shape, dtype, device:
                        torch.full(shape, float("nan"), dtype=dtype, device=device))
    caches = [cache_mod.KVCache(1, capacity, pool=None) for capacity in (5, 7)]
    rows = cache_mod.StackRows(caches)
    kvs = [torch.randn(2, 1, 2, m, 4) for m in (3, 6)]
    for c, (k, v) in zip(caches, kvs):
        c.layers[0].update(k, v)
        c.finish_prefill(k.shape[2])
    stack = cache_mod.Stack(caches, num_heads=4)
    k_all = stack.dense[0][0]
    assert k_all.shape == (2, 2, 7, 4) and not torch.isnan(k_all).any()
    for b, (c, (k, _)) in enumerate(zip(caches, kvs)):
        m = k.shape[2]
        assert torch.equal(k_all[b, :, :m], k[0]) and not k_all[b, :, m:].any()
        assert c.layers[0].keys.data_ptr() == k_all[b].data_ptr() and c.reserved is None
    assert not rows.tensors  # handed over to the stack


def test_write_at_per_row_and_head_positions():
    buf = torch.zeros(2, 3, 10, 4)
    x = torch.randn(2, 3, 2, 4)
    pos = torch.tensor([[[1, 2], [5, 6], [0, 1]], [[7, 8], [3, 4], [2, 3]]])
    write_at(buf, pos, x)
    for b in range(2):
        for h in range(3):
            assert torch.equal(buf[b, h, pos[b, h]], x[b, h])
    assert int((buf.abs().sum(-1) > 0).sum()) == 12


@pytest.mark.parametrize("which", kernels.BACKENDS)
def test_attend_with_per_sequence_masks_matches_the_reference(which):
    if which == "triton" and not kernels.triton_available():
        pytest.skip("triton not installed")
    torch.manual_seed(0)
    B, Hkv, G, N, D, q = 3, 2, 3, 40, 16, 2
    query = torch.randn(B, Hkv * G, q, D)
    k, v = torch.randn(B, Hkv, N, D), torch.randn(B, Hkv, N, D)
    start = torch.tensor([[30, 12], [5, 5], [37, 20]])
    bias = torch.zeros(B, Hkv, G, N).masked_fill_(torch.rand(B, Hkv, G, N) < 0.3, float("-inf"))
    bias[..., 0] = 0  # every row sees an entry
    out = kernels.attend(query, k, v, start, 0.25, bias, which=which)
    ref = kernels.reference(query, k, v, start, 0.25, bias)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.filterwarnings("ignore:SparseMM")
def test_batched_speculative_sampling_matches_dense_distribution(tiny_loaded, frames):
    """The chi-square test of `test_house`, batched: 300 sampled speculative runs as 30 batches of 10
    rows (each row its own seed) against 300 one-row dense runs; tokens 1-6, std draft k 0.1, γ 1.
    Every row also equals its own one-row run with the same seed."""
    from scipy.stats import chi2_contingency

    from sparsevid.models import load_model
    from sparsevid.tiny import make_tiny_model
    import tempfile

    folder = make_tiny_model("qwen2_vl", tempfile.mkdtemp(), initializer_range=0.5)  # peaked distributions
    loaded = load_model(folder, device="cpu", dtype="float32")
    inputs = loaded.adapter.build_inputs(frames, "what colour is the moving object ?")
    s = Sampling(temperature=1.0, top_p=0.9, ignore_eos=True)
    n, length, rows = 300, 7, 10
    fixed = {"k": "0.1", "gamma": "1", "adaptive_gamma": "off"}  # adaptive γ follows timings: so would the draws
    dense = [engine.decode(loaded, inputs, max_new_tokens=length, sampling=dataclasses.replace(s, seed=i)).token_ids
             for i in range(n)]
    spec = []
    for i in range(0, n, rows):
        seeds = list(range(10_000 + i, 10_000 + i + rows))
        batch = runs.run_rows(loaded, [inputs] * rows, "std", fixed, max_new_tokens=length, sampling=s, seeds=seeds)
        spec += [t.token_ids for t in batch]
        if i == 0:
            one = runs.run_method(loaded, inputs, "std", fixed, max_new_tokens=length,
                                  sampling=dataclasses.replace(s, seed=seeds[3]))
            assert one.token_ids == spec[3]
    for pos in range(1, length):
        a, b = [t[pos] for t in dense], [t[pos] for t in spec]
        keys = sorted(set(a) | set(b))
        table = np.array([[a.count(k) for k in keys], [b.count(k) for k in keys]])
        big = table.sum(0) >= 10
        table = np.concatenate([table[:, big], table[:, ~big].sum(1, keepdims=True)], axis=1)
        table = table[:, table.sum(0) > 0]
        assert table.shape[1] >= 2
        assert chi2_contingency(table)[1] > 0.001, pos


def test_run_with_several_questions_decodes_them_together(tiny_model_dir, tmp_path, capsys):
    """`run VIDEO Q1 Q2 --json`: one entry per question, each method's answer as dense's (lossless)."""
    import json

    from sparsevid import cli
    from sparsevid.toy.questions import make_sample
    from sparsevid.video import write_video

    path = str(tmp_path / "clip.mp4")
    write_video(path, make_sample(7, 8, "colour").clip.frames, fps=4)
    assert cli.main(["run", path, "what colour ?", "describe the video", "--model", tiny_model_dir("qwen2_vl"),
                     "--frames", "8", "--methods", "dense,std", "--max-new-tokens", "6", "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [b["question"] for b in out["batch"]] == ["what colour ?", "describe the video"]
    for b in out["batch"]:
        assert b["methods"]["std"]["token_ids"] == b["methods"]["dense"]["token_ids"]
        assert b["methods"]["std"]["batch"] == 2


def test_run_refuses_an_empty_question_before_loading_anything(tmp_path, capsys):
    """`run VIDEO "" ...`: the question's error comes first, not the video's or the model's (the
    command used to decode the video and load the model, ~15 s, before saying the question was empty)."""
    from sparsevid import cli

    assert cli.main(["run", str(tmp_path / "missing.mp4"), "what colour ?", "  ", "--model", "no/such-model"]) == 2
    err = capsys.readouterr().err
    assert "question is empty" in err and "does not exist" not in err and "could not be loaded" not in err


@pytest.mark.parametrize("argv, flag", [(["bench", "--frames", "0"], "--frames"), (["bench", "--frames", "16,abc"], "--frames"),
                                        (["bench", "--batch", "1,x"], "--batch"),
                                        (["run", "v.mp4", "q", "--max-new-tokens", "0"], "--max-new-tokens"),
                                        (["run", "v.mp4", "q", "--frames", "-3"], "--frames"),
                                        (["eval", "--data", "x", "--batch", "0"], "--batch")])
def test_counts_on_the_command_line_are_refused_where_they_are_typed(argv, flag, capsys):
    """A count below 1 or not a number is a usage error naming the flag (it was an IndexError or a
    ValueError from deep inside a run, `bench --frames 0` after loading the model)."""
    from sparsevid import cli

    assert cli.main(argv) == 2
    assert f"argument {flag}: expected a whole number >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("module, argv", [("sparsevid.htsparse_ablation", ["--frames", "16,0"]),
                                          ("sparsevid.toy.__main__", ["eval", "--n", "0"])])
def test_the_other_command_lines_refuse_counts_below_one_too(module, argv, capsys):
    """`python -m sparsevid.htsparse_ablation --frames 0` and `python -m sparsevid.toy eval --n 0`
    ended in an IndexError and a TypeError traceback."""
    import importlib

    with pytest.raises(SystemExit) as e:
        importlib.import_module(module).main(argv)
    assert e.value.code == 2 and "expected a whole number >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ARCHS)
def test_questions_on_one_video_share_its_pixels_and_vision_tower(tiny_loaded, arch, monkeypatch):
    """Several questions on one video (`run VIDEO Q1 Q2 ...`, the app's batch): the video is
    preprocessed once and its vision tower runs once for all of them, and each question's answer
    is the one its own inputs, built alone, give."""
    import functools

    loaded = tiny_loaded(arch)
    frames, questions = clip(8, 3), ["what colour is the object ?", "how many ?", "where does it go ?"]
    batch = loaded.adapter.build_questions(frames, questions)
    pixels = {id(x.model_kwargs["pixel_values_videos"]) for x in batch}
    assert len(pixels) == 1 and len({x.m for x in batch}) == 3
    inner, calls = loaded.model.model, []
    encode = inner.get_video_features

    @functools.wraps(encode)
    def counted(*args, **kwargs):
        calls.append(1)
        return encode(*args, **kwargs)

    monkeypatch.setattr(inner, "get_video_features", counted)
    together = runs.run_rows(loaded, batch, "std", LOSSLESS["std"], max_new_tokens=8)
    runs.run_rows(loaded, batch, "dense", max_new_tokens=8)
    assert len(calls) == 1
    alone = [runs.run_method(loaded, loaded.adapter.build_inputs(frames, q), "std", LOSSLESS["std"], max_new_tokens=8)
             for q in questions]
    assert len(calls) == 4
    assert [t.token_ids for t in together] == [t.token_ids for t in alone]


def test_questions_on_one_video_read_its_shared_prefix_once(tiny_loaded, monkeypatch):
    """Rows of questions on one video hold bit-identical KV over their common prefix: the stack
    finds it (the first row of the group is read for the others, `cache.Stack.prefix`), the CPU op
    reads one copy, and every row keeps the tokens of its own one-row run, dense and StD (whose
    verifications read the dense layers). Rows of different videos share nothing; a prompt that
    joins in a row the others read from stops them reading it."""
    if not kernels.cpu_available():
        pytest.skip(f"the CPU op is not built here: {kernels.describe(torch.device('cpu'))}")
    loaded = tiny_loaded("qwen2_vl")
    frames, questions = clip(64, 5), ["what colour is the object ?", "how many ?", "where does it go ?"]
    batch = loaded.adapter.build_questions(frames, questions)
    prefixes = []
    real = cache_mod.Stack.__init__

    def spy(self, caches, *a, **k):
        real(self, caches, *a, **k)
        prefixes.append(self.prefix.tolist())

    monkeypatch.setattr(cache_mod.Stack, "__init__", spy)
    common = next(i for i, (a, b) in enumerate(zip(*(x.model_kwargs["input_ids"][0] for x in batch[:2]))) if a != b)
    assert common > cache_mod.SHARED_MIN  # past the op's first split of 512 keys: one is read from row 0
    for name in ("dense", "std"):
        prefixes.clear()
        together = runs.run_rows(loaded, batch, name, LOSSLESS.get(name), max_new_tokens=8)
        alone = [runs.run_method(loaded, x, name, LOSSLESS.get(name), max_new_tokens=8) for x in batch]
        assert [t.token_ids for t in together] == [t.token_ids for t in alone], name
        assert prefixes[0][0] == [0, 0] and all(r[0] == 0 and r[1] >= common for r in prefixes[0][1:]), prefixes
    prefixes.clear()
    others = [loaded.adapter.build_inputs(clip(64, seed), questions[0]) for seed in (6, 7)]
    runs.run_rows(loaded, others, "dense", max_new_tokens=4)
    assert prefixes[0] == [[0, 0], [1, 0]]
    # two at a time: another video's question joins in row 0 (where row 1 read its prefix) as row 0 ends
    first = runs.run_method(loaded, batch[0], "dense", max_new_tokens=12).token_ids
    monkeypatch.setattr(type(loaded.adapter), "eos_token_ids", property(lambda self: [first[3]]))
    prompts = [batch[0], batch[1], others[0]]
    alone = [runs.run_method(loaded, x, "dense", max_new_tokens=12).token_ids for x in prompts]
    assert len(alone[0]) == 4 < len(alone[1])
    placed, real_replace = [], cache_mod.Stack.replace
    monkeypatch.setattr(cache_mod.Stack, "replace", lambda self, b, c: placed.append((b, real_replace(self, b, c)))
                        or placed[-1][1])
    prefixes.clear()
    flowing = runs.run_rows(loaded, prompts, "dense", max_new_tokens=12, width=2)
    assert prefixes[0] == [[0, 0], [0, prefixes[0][1][1]]] and (0, True) in placed, (prefixes, placed)
    assert [t.token_ids for t in flowing] == alone


def test_the_bytes_bound_counts_a_shared_prefix_once(tiny_loaded, monkeypatch):
    """`bench --batch`'s bytes-only bound: questions on one video read their common prefix once where
    the kernel reads it so (the CPU op, Triton); SDPA reads every row's own; different videos share
    nothing."""
    from sparsevid import bench

    loaded = tiny_loaded("qwen2_vl")
    questions = ["what colour is the object ?", "how many ?", "where does it go ?"]
    batch = loaded.adapter.build_questions(clip(64, 5), questions)
    entry = 2 * loaded.num_layers * loaded.num_kv_heads * loaded.head_dim * 4
    common = cache_mod.common_prefix(batch[0].model_kwargs["input_ids"][0], batch[1].model_kwargs["input_ids"][0])
    assert common >= cache_mod.SHARED_MIN
    monkeypatch.setattr(kernels, "FORCED", "cpu")
    assert bench.shared_bytes(loaded, batch) == 2 * common * entry  # rows 1 and 2 read row 0's
    others = [loaded.adapter.build_inputs(clip(64, seed), questions[0]) for seed in (6, 7)]
    assert bench.shared_bytes(loaded, others) == 0
    monkeypatch.setattr(kernels, "FORCED", "sdpa")
    assert bench.shared_bytes(loaded, batch) == 0
