"""Compiled decode steps (`sparsevid.fast`): the same greedy tokens as the eager steps, on every
architecture and on the embedded model; no recompilation once a run's step kinds are compiled;
a compilation that fails falls back to eager without failing the run."""

import json
import os
import re

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from sparsevid import cache, fast, kernels, runs
from sparsevid.engine import Sampling
from sparsevid.runs import compile_steps, run_method

ARCHS = ("qwen2_vl", "qwen2_5_vl", "llava_onevision")
METHODS = ("dense", "std", "streaming", "layerskip")
SETTINGS = {"k": "0.25", "gamma": "4"}  # drafts that keep a quarter: draft steps over compact buffers


def clip(n, size=112, seed=0):
    return (np.random.RandomState(seed).rand(n, size, size, 3) * 255).astype(np.uint8)


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def breaks() -> int:
    return sum(counters["graph_break"].values())


@pytest.fixture
def eager_after(tiny_loaded):
    """Every test leaves the shared tiny models eager."""
    yield
    for arch in ARCHS:
        tiny_loaded(arch).fast = None


@pytest.mark.parametrize("arch", ARCHS)
def test_compiled_steps_give_eager_tokens_and_never_recompile_after_warm_up(tiny_loaded, arch, eager_after):
    loaded = tiny_loaded(arch)
    short = loaded.adapter.build_inputs(clip(8), "what colour is the object ?")
    longer = loaded.adapter.build_inputs(clip(12, seed=1), "what colour is the object ?")
    ignore = Sampling(ignore_eos=True)
    eager = {(n, i): run_method(loaded, x, n, SETTINGS, 20, ignore).token_ids
             for n in METHODS for i, x in enumerate((short, longer))}
    fast.enable(loaded, "on")
    broken = breaks()
    assert "compiled" in compile_steps(loaded, short, METHODS, SETTINGS)
    assert breaks() == broken, f"a step is not one graph: {dict(counters['graph_break'])}"
    before, calls = graphs(), loaded.fast.calls
    for i, x in enumerate((short, longer)):  # another prompt length, every γ adaptive γ picks: no new graph
        for n in METHODS:
            assert run_method(loaded, x, n, SETTINGS, 20, ignore).token_ids == eager[n, i], (arch, n, i)
    assert graphs() == before, "a step recompiled after the warm-up"
    assert loaded.fast.calls - calls >= 4 * 2 * 19  # every run's decode steps went through the graph


@pytest.mark.filterwarnings("ignore:SparseMM")
def test_per_head_steps_keep_their_block_slots_constant(tiny_loaded, eager_after):
    """Only the sizes `fast` marks dynamic are symbolic in a compiled step. With dynamo's automatic
    dynamism, the step kind compiled after the dense one made every block's write slot and width
    symbolic: a per-head step (HT-Sparse, SparseMM) took 16 size arguments against dense's 8, each
    converted and guarded at every call (at 288 visual tokens both ran at 0.95x of dense for it).
    Read from dynamo's guards on the compiled step (a slot guarded equal to its value is a
    constant of the graph; a symbolic one is guarded only as an int)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    loaded = tiny_loaded("qwen2_vl")
    x = loaded.adapter.build_inputs(clip(8), "what colour is the object ?")
    settings = {"heads_full": "0.25", "heads_sparse": "0.5", "eta": "0.5", "ht_layers": "all",
                "budget": "0.3", "window": "4"}
    fast.enable(loaded, "on")
    assert "compiled" in compile_steps(loaded, x, ("dense", "htsparse", "sparsemm"), settings)
    assert loaded.fast.per_head_calls > 0  # per-head layouts went through the graph
    code = loaded.fast.compiled_step()._torchdynamo_orig_callable.__code__
    guards = [p for e in _debug_get_cache_entry_list(code) for p in e.guard_manager.code_parts if "].slot" in p]
    assert guards and all(re.search(r"\]\.slot == \d+$", p) for p in guards), guards


def test_two_models_compiled_side_by_side_each_run_their_own_graphs(tiny_loaded, tmp_path, eager_after):
    """Each model compiles its own copy of the step, without guards on its modules: two models whose
    caches have the same shapes (only their MLPs differ, which no unguarded input shows) compiled in
    one process, their runs alternating, each give their own eager tokens (a graph of one never
    serves the other)."""
    from sparsevid.models import load_model
    from sparsevid.tiny import make_tiny_model

    a = tiny_loaded("qwen2_vl")
    b = load_model(make_tiny_model("qwen2_vl", str(tmp_path), seed=1, intermediate_size=256),
                   device="cpu", dtype="float32")
    models = {"a": a, "b": b}
    inputs = {k: m.adapter.build_inputs(clip(8), "what colour is the object ?") for k, m in models.items()}
    ignore = Sampling(ignore_eos=True)
    eager = {(k, n): run_method(m, inputs[k], n, SETTINGS, 10, ignore).token_ids
             for k, m in models.items() for n in ("dense", "std")}
    assert eager["a", "dense"] != eager["b", "dense"]
    for k, m in models.items():
        fast.enable(m, "on")
    for _ in range(2):
        for k, m in models.items():
            for n in ("dense", "std"):
                res = run_method(m, inputs[k], n, SETTINGS, 10, ignore)
                assert res.token_ids == eager[k, n] and res.fast_steps > 0, (k, n)
    assert a.fast.compiled is not b.fast.compiled


def test_a_model_once_asked_for_its_attentions_still_compiles_each_step_as_one_graph(tiny_loaded, eager_after):
    """transformers hooks a model's layers the first time a call asks for hidden states or attentions;
    the hooks read a ContextVar, which dynamo cannot trace. The step switches them off: no graph
    break, the eager tokens."""
    loaded = tiny_loaded("qwen2_vl")
    inputs = loaded.adapter.build_inputs(clip(8), "what colour is the object ?")
    with torch.inference_mode():
        loaded.model(**inputs.model_kwargs, use_cache=False, output_attentions=True)
    assert any(getattr(m, "_output_capturing_hooks_installed", False) for m in loaded.model.modules())
    eager = run_method(loaded, inputs, "dense", None, 8, Sampling(ignore_eos=True)).token_ids
    fast.enable(loaded, "on")
    broken, calls = breaks(), loaded.fast.calls
    assert run_method(loaded, inputs, "dense", None, 8, Sampling(ignore_eos=True)).token_ids == eager
    assert breaks() == broken, f"a step is not one graph: {dict(counters['graph_break'])}"
    assert loaded.fast.calls - calls == 7


def test_compiled_batches_are_compiled_in_the_warm_up_and_give_eager_tokens(tiny_loaded, eager_after):
    """SPARSEVID_CPU_BATCH_COMPILE's graphs (one for every batch size): `runs.compare_rows` compiles
    them in its warm-up (`warm_rows`), so its timed batched runs compile nothing, with each row's
    eager tokens."""
    from sparsevid.runs import compare_rows, warm_rows, warm_up

    loaded = tiny_loaded("qwen2_vl")
    rows = [loaded.adapter.build_inputs(clip(n, seed=n), "what colour is the object ?") for n in (8, 12, 4)]
    eager = {n: [run_method(loaded, x, n, SETTINGS, 12).token_ids for x in rows] for n in ("dense", "std")}
    fast.enable(loaded, "on")
    loaded.fast.batched = True
    warm_up(loaded, rows[0], names=["dense", "std"], settings=SETTINGS, max_new_tokens=12)  # compare_rows' warm-up
    warm_rows(loaded, rows[:2], ["dense", "std"], SETTINGS, 12)
    before, calls = graphs(), loaded.fast.calls
    out = compare_rows(loaded, rows, ["dense", "std"], SETTINGS, 12, width=2, warmup=False)
    assert graphs() == before, "a batched step compiled in a timed run"
    assert [r["dense"].token_ids for r, _ in out] == eager["dense"]
    assert [r["std"].token_ids for r, _ in out] == eager["std"]
    assert loaded.fast.calls > calls and all(r["std"].fast_steps for r, _ in out)


@pytest.mark.parametrize("split", [False, True], ids=["one_call", "split_heads"])
def test_per_head_steps_compiled_or_eager_give_the_same_tokens(tiny_loaded, eager_after, split, monkeypatch):
    """HT-Sparse's and SparseMM's per-head layouts (ragged lengths, masks, scales; in one call per
    layer, or their heads split by length in two) through the graph, and eager where `per_head` is
    off (auto mode turns it off where their compiled step measures slower)."""
    monkeypatch.setattr(cache, "SPLIT_MIN_SAVED", 1 if split else 10**9)
    if split:  # heads split by length exist for the SDPA backend (the others stop at each head's length)
        monkeypatch.setattr(kernels, "FORCED", "sdpa")
    loaded = tiny_loaded("qwen2_vl")
    inputs = loaded.adapter.build_inputs(clip(8), "what colour is the object ?")
    ignore = Sampling(ignore_eos=True)
    eager = {n: run_method(loaded, inputs, n, None, 12, ignore).token_ids for n in ("dense", "htsparse", "sparsemm")}
    fast.enable(loaded, "on")
    broken = breaks()
    for n in ("htsparse", "sparsemm"):
        assert run_method(loaded, inputs, n, None, 12, ignore).token_ids == eager[n], n
    assert breaks() == broken, f"a step is not one graph: {dict(counters['graph_break'])}"
    assert loaded.fast.per_head_calls >= 11  # HT-Sparse's at least (SparseMM's too where its budgets differ by head)
    loaded.fast.per_head = False
    per_head_calls, calls = loaded.fast.per_head_calls, loaded.fast.calls
    assert run_method(loaded, inputs, "htsparse", None, 12, ignore).token_ids == eager["htsparse"]
    assert loaded.fast.calls == calls and loaded.fast.per_head_calls == per_head_calls  # eager
    assert run_method(loaded, inputs, "dense", None, 12, ignore).token_ids == eager["dense"]
    assert loaded.fast.calls == calls + 11  # dense's steps still compiled


@pytest.mark.parametrize("method", ["htsparse", "htsparse-draft"])
def test_per_head_steps_take_their_own_thread_count_where_steps_run_on_several(tiny_loaded, eager_after,
                                                                            monkeypatch, method):
    """Where decode steps run on two threads, auto mode compiles the per-head layouts for one
    (their many small kernels each wake the sleeping thread: HT-Sparse 0.62x of dense's step on
    the embedded model) and keeps whichever of compiled on one, eager on one and eager on two
    measures fastest (a draft's by its draft steps); a per-head step then runs on its count and a
    dense step on the step count, with the same tokens either way."""
    from sparsevid import engine

    loaded = tiny_loaded("qwen2_vl")
    inputs = loaded.adapter.build_inputs(clip(8), "what colour is the object ?")
    ignore = Sampling(ignore_eos=True)
    eager = {n: run_method(loaded, inputs, n, None, 12, ignore).token_ids for n in ("dense", method)}
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setattr(loaded, "step_threads", 2)
    monkeypatch.setattr(loaded, "head_threads", None)
    try:
        fast.enable(loaded, "auto")
        message = compile_steps(loaded, inputs, [method])
        assert loaded.head_threads in (1, 2) and "per-head steps" in message, message
        assert loaded.fast.per_head == (f"per-head steps compiled on {loaded.head_threads}" in message)
        for n in ("dense", method):  # whatever was chosen: the same tokens
            assert run_method(loaded, inputs, n, None, 12, ignore).token_ids == eager[n], n
        if method != "htsparse":
            return
        loaded.fast.enabled, loaded.head_threads = False, 1
        seen = []
        real = engine.static_step
        monkeypatch.setattr(engine, "static_step", lambda *a: seen.append(torch.get_num_threads()) or real(*a))
        assert run_method(loaded, inputs, "dense", None, 12, ignore).token_ids == eager["dense"]
        assert seen == [2] * 11
        seen.clear()
        assert run_method(loaded, inputs, "htsparse", None, 12, ignore).token_ids == eager["htsparse"]
        assert seen == [1] * 11 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_embedded_model_answers_the_same_compiled(eager_after):
    from sparsevid.bench import bench_clip
    from sparsevid.models import load_model

    loaded = load_model(None)
    frames, question, _ = bench_clip(16, None, None)
    inputs = loaded.adapter.build_inputs(frames, question)
    eager = {n: run_method(loaded, inputs, n, None, 96) for n in ("dense", "std")}
    assert len(eager["dense"].token_ids) > 15  # a narration: a few sentences
    fast.enable(loaded, "on")
    for n in ("dense", "std"):
        assert run_method(loaded, inputs, n, None, 96).token_ids == eager[n].token_ids, n
    assert loaded.fast.calls > 30


def test_a_failed_compilation_falls_back_to_eager_and_says_so(tiny_loaded, eager_after):
    loaded = tiny_loaded("qwen2_vl")
    inputs = loaded.adapter.build_inputs(clip(8), "what colour is the object ?")
    dense = run_method(loaded, inputs, "dense", None, 12, Sampling(ignore_eos=True))

    def broken_backend(gm, example_inputs):
        raise RuntimeError("no C++ compiler")

    fs = fast.enable(loaded, "auto")
    fs.compiled = torch.compile(fast.static_step, backend=broken_backend)
    with pytest.warns(RuntimeWarning, match="compilation failed"):
        res = run_method(loaded, inputs, "dense", None, 12, Sampling(ignore_eos=True))
    assert res.token_ids == dense.token_ids
    assert not fs.enabled and "no C++ compiler" in fs.message and fs.calls == 0
    torch._dynamo.reset()  # forget the broken backend's cache entry for the other tests


def test_the_app_compiles_in_the_background_and_reports_it(tiny_model_dir, monkeypatch):
    """The app's start-up thread compiles every method's steps (one method at a time under the run
    lock), then runs go through the compiled steps and the comparison's JSON says so; a comparison
    of several questions (one batch) then compiles nothing either."""
    from sparsevid.demo import backend, worker

    monkeypatch.setenv("SPARSEVID_COMPILE", "on")
    folder = tiny_model_dir("qwen2_vl")
    thread = backend.compile_in_background(folder)
    thread.join(timeout=600)
    loaded = backend.get_model(folder)
    assert not thread.is_alive() and loaded.fast.enabled and loaded.fast.message.startswith("compiled")
    assert backend.RUN_LOCK.acquire(blocking=False)  # the thread let go of the lock
    backend.RUN_LOCK.release()
    calls = loaded.fast.calls
    from sparsevid.video import write_video

    path = str(tiny_model_dir("qwen2_vl")) + "/clip.mp4"
    write_video(path, clip(8), fps=4)
    out = worker.compare_json(path, "what colour is the object ?", folder, 8, ["std"], {"k": "0.25"}, 12)
    assert out["compile"].startswith("compiled") and loaded.fast.calls > calls
    before = graphs()  # several questions: their batch steps were compiled in the background too
    out = worker.compare_json(path, "what colour is the object ?\nwhat shape is the object ?", folder, 8, ["std"],
                              {"k": "0.25"}, 12)
    assert len(out["batch"]) == 2 and graphs() == before
    backend.get_model.cache_clear()


def test_decode_steps_run_on_the_thread_count_that_measures_faster(tiny_model_dir, monkeypatch):
    """`runs.choose_step_threads`: once per model, torch's count or one thread, by timing steps of
    one and two rows; the steps then run on it (and torch's count is back for the prefill); a model
    whose steps are long keeps every thread; SPARSEVID_STEP_THREADS sets it."""
    from sparsevid.engine import step_threads
    from sparsevid.models import load_model
    from sparsevid.runs import choose_step_threads

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    x = None
    for env, long_step_s, expect in ((None, 0.05, {1, 2}), (None, 0.0, {2}), ("1", 0.05, {1})):
        loaded = load_model(tiny_model_dir("qwen2_vl"), device="cpu", dtype="float32")
        x = x or loaded.adapter.build_inputs(np.zeros((4, 56, 56, 3), np.uint8), "what colour is the object ?")
        if env:
            monkeypatch.setenv("SPARSEVID_STEP_THREADS", env)
        note = choose_step_threads(loaded, x, long_step_s=long_step_s)
        assert loaded.step_threads in expect and f"steps on {loaded.step_threads} thread" in note, note
        assert choose_step_threads(loaded, x) == note  # once per model
        with step_threads(loaded):
            assert torch.get_num_threads() == loaded.step_threads
        assert torch.get_num_threads() == 2
    torch.set_num_threads(before)


def test_bench_verify_kernels_times_each_backend_exact_to_float32(capsys):
    from sparsevid import cli

    assert cli.main(["bench", "--verify-kernels", "--visual-tokens", "256", "--batch", "1,2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    bound = [r for r in rows if r[3].startswith("read K and V")]  # the memory bound of a step, per batch
    blas = [r for r in rows if r[3].startswith("the same matmuls")]  # a verification's arithmetic alone
    rows = [r for r in rows if r not in bound + blas]
    assert len(bound) == 2 and all(float(r[5]) > 0 for r in bound)
    assert len(blas) == 2 and all(r[2] == "10" and float(r[6]) > 0 for r in blas)
    assert len(rows) == 8 and {r[3] for r in rows} == {"sdpa", "cpu"}  # the CPU's backends; 1 and γ + 1 rows, 2 batches
    assert all(float(r[-1].rstrip(" |")) < 1e-6 for r in rows)  # exact attention
    # the choice the GPU check records: per (batch, entries, rows) the fastest exact kernel, never a bound
    line = next(x for x in out.splitlines() if x.startswith("fastest within the dtype's tolerance: "))
    picks = re.findall(r"batch (\d+), 256 entries, (\d+) row\(s\): (\w+) \(([\d.]+) ms\)", line)
    assert len(picks) == 4 and "read K" not in line and "matmuls" not in line
    for b, q, kernel, ms in picks:
        timed = {r[3]: r[4] for r in rows if r[0].strip("| ") == b and r[2] == q}
        assert timed[kernel] == ms == min(timed.values(), key=float)
    if torch.get_num_threads() > 1:  # this machine's two-thread threshold for a compiled step's calls
        assert re.search(r"takes \d+ threads from [\d,]+ \(KV pairs", out)


def test_bench_shape_measures_each_batch_and_length_at_a_real_shape(capsys):
    """The cost side at a 7B shape (one random layer): dense step, draft step and verification for
    every batch size and prompt length asked, through the static steps."""
    import json

    from sparsevid import cli

    assert cli.main(["bench", "--shape", "qwen2-vl-7b", "--layers", "1", "--seq", "320,576", "--batch", "1,2",
                     "--k", "64", "--compile", "off", "--repeats", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["batch"], r["prompt"]) for r in rows] == [(1, 320), (1, 576), (2, 320), (2, 576)]
    assert all(r["k"] == 64 and r["dense_ms"] > 0 and r["draft_ms"] > 0 and r["verify_ms"] > 0 for r in rows)
    # each step against its limit (weights + KV read at the measured copy bandwidth), and StD's bound
    assert all(r["dense_vs_limit"] > 0.5 and r["dense_limit_ms"] > r["draft_limit_ms"] for r in rows)
    assert all(0 < r["round_bound"] and 1 <= r["ideal_round_bound"] for r in rows)
    # HT-Sparse's and SparseMM's per-head layouts at their default proportions
    assert all(r["htsparse_ms"] > 0 and r["sparsemm_ms"] > 0 and r["htsparse_limit_ms"] < r["dense_limit_ms"]
               and 0 < r["sparsemm_kv_pct"] < 100 for r in rows)
    assert not any("prefill_ms" in r for r in rows)  # timed on CUDA only (the GPU check)
    assert all(r["routed_attention_ms"] > 0 and r["prefill_attention_ms"] > 0 for r in rows if r["batch"] == 1)


def test_bench_shape_rounds_decodes_batches_of_a_real_shape_losslessly(capsys):
    """Real rounds at a real shape (the GPU check's 7B batch-8 part, here a one-layer 2B shape on a
    short random clip): batch 1 and 2, StD speculating with a fixed γ, tokens identical to dense's."""
    import json

    from sparsevid import cli

    assert cli.main(["bench", "--shape", "qwen2-vl-2b", "--rounds", "--layers", "1", "--seq", "300", "--batch", "1,2",
                     "--methods", "std", "--k", "64", "--gamma", "3", "--no-adaptive-gamma", "--max-new-tokens", "13",
                     "--ignore-eos", "--repeats", "1", "--compile", "off", "--device", "cpu", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["rows"]
    assert out["random_weights"] and out["layers"] == 1 and [r["batch"] for r in rows] == [1, 2]
    assert all(r["rows"] == 2 and r["visual_tokens"] == 512 and r["identical_to_dense"] for r in rows)
    assert all(r["dense_tok_s"] > 0 and r["tok_s"] > 0 and r["acceptance"] is not None for r in rows)
    assert all(1 <= r["tokens_per_round"] <= 4 for r in rows)
    # dense's bound at batch 2 against batch 1: the weights read once, the KV twice; and a read of those bytes
    assert "bytes_bound" not in rows[0] and 1 < rows[1]["bytes_bound"] < 2
    assert rows[1]["read_bound"] > 0 and rows[1]["read_ms"] > 0 and rows[1]["step_mb"] > 0
    # and the steps after each pass's first 10 (12 here): what a step costs once its KV is back in the caches
    assert rows[1]["settled_step_ms"] > 0 and 0 < rows[1]["settled_vs_batch1"] < 4  # (2 rows: about 2 at most)
    # two questions on one clip: the second row reads the first's copy of their common prefix
    assert all(r["clips"] == 1 for r in rows) and rows[1]["shared_mb"] > 0


def test_bench_shape_rounds_on_different_clips_shares_nothing(capsys):
    """--clips 2: the two rows are two different prompts (the StD paper's batch of different
    prompts), so nothing is read once for both: the bytes bound counts each row's KV, and each row's
    tokens still equal its own dense run's."""
    import json

    from sparsevid import cli

    assert cli.main(["bench", "--shape", "qwen2-vl-2b", "--rounds", "--layers", "1", "--seq", "300", "--batch", "2",
                     "--clips", "2", "--methods", "std", "--k", "64", "--gamma", "3", "--no-adaptive-gamma",
                     "--max-new-tokens", "13", "--ignore-eos", "--repeats", "1", "--compile", "off", "--device", "cpu",
                     "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert row["clips"] == 2 and row["rows"] == 2 and row["identical_to_dense"]
    assert row["shared_mb"] == 0 and 1 < row["bytes_bound"] < 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run by python -m sparsevid.gpu_check)")
def test_cuda_graph_steps_give_eager_tokens_on_the_embedded_model():
    """float32 on CUDA: every method's tokens through captured graphs equal its eager tokens, and
    once warmed up, runs of the prompt replay graphs without capturing any (buffers from the pool)."""
    from sparsevid.bench import bench_clip
    from sparsevid.models import load_model

    loaded = load_model(None, device="cuda", dtype="float32")
    frames, question, _ = bench_clip(256, None, None)
    inputs = loaded.adapter.build_inputs(frames, question).to(loaded.device)
    eager = {n: run_method(loaded, inputs, n, SETTINGS, 48).token_ids for n in METHODS + ("htsparse", "sparsemm")}
    fast.enable(loaded, "on")
    compile_steps(loaded, inputs, list(eager), SETTINGS, capacity_tokens=48)
    before = loaded.fast.captures
    for n, tokens in eager.items():
        res = run_method(loaded, inputs, n, SETTINGS, 48)
        assert res.token_ids == tokens, n
        assert res.fast_steps > 0, n
    assert loaded.fast.captures == before


@pytest.mark.skipif(not kernels.triton_available(), reason="Triton is not installed")
@pytest.mark.parametrize("arch", ARCHS)
def test_decode_steps_through_the_fused_layer_kernels_give_the_same_tokens(tiny_model_dir, tiny_loaded, arch,
                                                                          monkeypatch):
    """With the fused RMSNorm, rotary and KV-write kernels (on CUDA in every decode step; here through
    Triton's interpreter) dense and StD give the tokens of transformers' own ops, float32; every
    decode step of every layer runs them and the prefill does not (it keeps transformers' code)."""
    if torch.cuda.is_available():
        from sparsevid.models import load_model

        loaded = load_model(tiny_model_dir(arch), device="cuda", dtype="float32")
    elif os.environ.get("TRITON_INTERPRET") == "1":
        loaded = tiny_loaded(arch)
    else:
        pytest.skip("Triton runs on the CPU only through its interpreter")
    calls = {"rms_norm": 0, "rotary": 0, "write_kv": 0}
    for name in calls:
        def counted(*args, name=name, fn=getattr(kernels, name)):
            calls[name] += 1
            return fn(*args)

        monkeypatch.setattr(kernels, name, counted)
    inputs = loaded.adapter.build_inputs(clip(8), "what colour is the object ?").to(loaded.device)
    ignore = Sampling(ignore_eos=True)
    tokens = {}
    for mode in ("off", "on"):
        monkeypatch.setattr(fast, "FUSED", mode)
        for n in ("dense", "std"):
            tokens[mode, n] = run_method(loaded, inputs, n, SETTINGS, 20, ignore).token_ids
            if (mode, n) == ("on", "dense"):
                L = len(getattr(loaded.model.model, "language_model", loaded.model.model).layers)
                assert calls == dict(rms_norm=19 * (2 * L + 1), rotary=19 * L, write_kv=19 * L), calls  # no prefill
    assert calls["rotary"] > 19 * L  # StD's steps too
    assert tokens["on", "dense"] == tokens["off", "dense"] == tokens["on", "std"] == tokens["off", "std"]
    # a batch of two prompts of different lengths (per-row write positions): each row's own tokens
    other = loaded.adapter.build_inputs(clip(6, seed=3), "what moves ?").to(loaded.device)
    alone = run_method(loaded, other, "std", SETTINGS, 12, ignore).token_ids
    before = calls["write_kv"]
    rows = runs.run_rows(loaded, [inputs, other], "std", SETTINGS, 12, ignore)
    assert [r.token_ids for r in rows] == [tokens["off", "std"][:12], alone]
    assert calls["write_kv"] > before


@pytest.mark.filterwarnings("ignore:SparseMM")
def test_bench_gives_a_direct_methods_bound_from_the_kv_it_reads(tiny_model_dir, capsys):
    """`bench` on a direct method: its decode bound from the KV it reads and the share of a dense step
    that scales with the KV (measured in the same run), between 1x and 1 / (KV read), and the
    measured speedup's share of it."""
    from sparsevid import cli

    assert cli.main(["bench", "--model", tiny_model_dir("qwen2_vl"), "--frames", "256", "--methods", "sparsemm",
                     "--budget", "0.3", "--max-new-tokens", "8", "--ignore-eos", "--repeats", "1", "--compile", "off",
                     "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    row = out["rows"][0]
    assert out["cpu_stolen_pct"] is None or 0 <= out["cpu_stolen_pct"] <= 100  # the host's share, beside the figures
    assert row["method"] == "sparsemm" and 0 < row["decode_kv_pct"] < 100
    assert 0 < row["attention_kv_pct"] <= 100
    assert 1 <= row["bound_speedup"] <= 100 / row["decode_kv_pct"]
    assert row["bound_share"] == pytest.approx(row["speedup"] / row["bound_speedup"])
    assert row["speedups"] == [row["speedup"]] and "speedup_pairs" not in row  # one pair: no spread to show


def test_bench_shows_the_spread_of_its_pairs_beside_their_median(tiny_model_dir, capsys):
    """`bench --repeats 2`: each row's decode speedup is the median of its (method, dense) pairs, and the
    table shows their range beside it (on a shared machine single pairs move by 15 % or more)."""
    from sparsevid import cli

    assert cli.main(["bench", "--model", tiny_model_dir("qwen2_vl"), "--frames", "16", "--methods", "std",
                     "--max-new-tokens", "6", "--ignore-eos", "--repeats", "2", "--compile", "off", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["rows"][0]
    lo, hi = min(row["speedups"]), max(row["speedups"])
    assert len(row["speedups"]) == 2 and lo <= row["speedup"] <= hi
    assert row["speedup_pairs"] == f"{lo:.2f}-{hi:.2f}x"
    assert cli.main(["bench", "--model", tiny_model_dir("qwen2_vl"), "--frames", "16", "--methods", "std",
                     "--max-new-tokens", "6", "--ignore-eos", "--repeats", "2", "--compile", "off"]) == 0
    table = capsys.readouterr().out
    assert "| decode speedup | its pairs |" in table and re.search(r"\| \d\.\d\dx \| \d\.\d\d-\d\.\d\dx \|", table)


def test_the_buffer_pool_remembers_what_waited_idle_the_whole_run():
    """On CUDA a run's peak memory is the allocator's peak less the pool's buffers that no run used
    (`engine._peak`). Read after the run has given its own buffers back, the idle bytes then would
    subtract the run's own KV too; the low-water mark since the run began counts only what waited."""
    from sparsevid.cache import BufferPool

    pool = BufferPool()
    k, other = torch.ones(1000), torch.ones(500)  # 4,000 and 2,000 bytes, given back by an earlier run
    pool.give_back({"k": k, "other": other})
    pool.mark()  # a run begins
    t = pool.take("k", (1000,), torch.float32, "cpu")
    assert t is k and bool((t == 0).all())  # the same buffer, zeroed
    pool.give_back({"k": t})  # the run ends
    assert pool.idle_bytes() == 6000 and pool.low == 2000


def test_a_captured_steps_kernels_are_counted_by_family_per_step():
    """`bench.kernel_breakdown` (the GPU check's profile of a captured step) on kernel names as a
    profiler reports them: cuBLAS's and CUTLASS's matmuls, this project's Triton kernels, PyTorch's
    elementwise ones; per step, with the GPU's idle time between kernels."""
    from sparsevid.bench import kernel_breakdown

    one = [("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64", 2.0),
           ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm>(Params)", 3.0), ("split_kv", 4.0),
           ("combine", 1.0), ("rms_norm", 1.0), ("rotary", 1.0), ("write_kv", 1.0),
           ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", 1.0)]
    events, t = [], 0.0
    for _ in range(2):  # two replays, each kernel 0.5 us after the previous one's end
        for name, us in one:
            events.append((name, t, us))
            t += us + 0.5
    b = kernel_breakdown(events, steps=2)
    fam = b["families"]
    assert fam["matmul"] == dict(kernels=2, us=5.0) and fam["attention"] == dict(kernels=2, us=5.0)
    assert fam["fused ops"] == dict(kernels=3, us=3.0) and fam["other"]["kernels"] == 1
    assert b["busy_us"] == 14.0 and b["span_us"] == (t - 0.5) / 2 and b["idle_us"] == b["span_us"] - 14.0
    assert b["other_top"][0][0].startswith("void at::native::vectorized_elementwise_kernel")


def test_gpu_check_parts_are_commands_the_cli_takes():
    """Every bench part of the GPU check parses as the CLI would (a typo there would cost a lent
    GPU's minutes): the paper-comparable rounds take 8 different clips, the shared ones one."""
    from sparsevid import cli, gpu_check

    parser = cli.build_parser()
    parsed = {name: parser.parse_args(cmd[cmd.index("sparsevid") + 1:])
              for name, (cmd, _) in gpu_check.PARTS.items() if "sparsevid" in cmd}
    assert parsed["rounds"].clips == 8 and parsed["rounds-shared"].clips == 0
    assert len(parsed) == 7 and all(a.cmd == "bench" for a in parsed.values())
