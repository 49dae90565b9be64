"""The house rules of the library (issue "The house").

- import rules, read from the source with `ast` (every import, those inside functions included);
- one parser: a setting typed in the CLI or the app gives one configuration and one selection;
- one test matrix: every lossless method equals dense greedily on every architecture; every lossy
  one, set to keep everything, equals dense bit for bit;
- each policy keeps what its definition says, on real prefill statistics;
- speculative sampling over several rounds with a sparse draft and top_p < 1 samples dense's
  distribution;
- no state shared between runs: a run leaves the model as it found it;
- KV bytes are honest and prefill statistics are computed only as the policy asks.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import sparsevid
from sparsevid import attention, engine, methods, options, runs
from sparsevid.engine import Sampling

ROOT = Path(sparsevid.__file__).resolve().parent
MODELS = ("qwen2_vl", "qwen2_5_vl", "llava_onevision", "embedded")


# =============================================================================================
# Import rules
# =============================================================================================


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


@dataclasses.dataclass(frozen=True)
class Imp:
    """One import statement's target: `module` (absolute), the `names` taken from it (from-imports),
    its line."""

    module: str
    names: tuple[str, ...]
    line: int


def _imports(name: str, path: Path) -> list[Imp]:
    """Every import in the module's source (top level, functions, classes, conditionals), absolute."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [Imp(a.name, (), node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            out.append(Imp(mod, tuple(a.name for a in node.names), node.lineno))
    return out


def _targets(imp: Imp, modules: dict) -> list[str]:
    """The modules an import loads: `from pkg import sub` loads pkg.sub when that is a module."""
    subs = [f"{imp.module}.{n}" for n in imp.names if f"{imp.module}.{n}" in modules]
    plain = [n for n in imp.names if f"{imp.module}.{n}" not in modules]
    return subs + ([imp.module] if plain or not imp.names else [])


def _graph() -> tuple[dict[str, list[Imp]], dict[str, set[str]]]:
    """({module: its imports}, {module: the sparsevid modules it imports}). A module's own parent
    packages, run implicitly by Python before it, are not edges."""
    modules = _modules()
    imps = {m: _imports(m, p) for m, p in modules.items()}
    graph = {}
    for m, lst in imps.items():
        graph[m] = {t for i in lst for t in _targets(i, modules)
                    if t in modules and t != m and not m.startswith(t + ".")}
    return imps, graph


def _is(target: str, prefix: str) -> bool:
    return target == prefix or target.startswith(prefix + ".")


def _violations(imps, rule) -> list[str]:
    modules = _modules()
    out = []
    for m, lst in sorted(imps.items()):
        for imp in lst:
            for t in _targets(imp, modules) + [imp.module]:
                why = rule(m, t)
                if why:
                    out.append(f"{m}:{imp.line} imports {t} ({why})")
    return sorted(set(out))


def test_import_resolution_sees_function_level_and_relative_imports():
    """The checker itself: relative, `from pkg import sub` and in-function imports are all seen."""
    imps, graph = _graph()
    assert "sparsevid.methods.std" in graph["sparsevid.methods"]  # from . import ..., std
    assert "sparsevid.cache" in graph["sparsevid.methods.std"]  # from ..cache import ...
    assert "sparsevid.calibration" in graph["sparsevid.runs"]  # imported inside a function
    assert "sparsevid.methods" not in graph["sparsevid.methods.std"]  # the parent package: no edge


def test_imports_name_existing_modules():
    """No module still imports one the restructuring removed (methods.Settings' old home, policies,
    speculative, sparsemm, htsparse ...)."""
    imps, _ = _graph()
    modules = _modules()
    bad = _violations(imps, lambda m, t: "no such module" if _is(t, "sparsevid") and t not in modules
                      and t.rpartition(".")[0] not in modules else None)
    bad += [f"{m}:{i.line} from {i.module} import {n} (no such module)" for m, lst in imps.items() for i in lst
            if _is(i.module, "sparsevid") and i.module not in modules for n in i.names]
    assert not bad, "\n".join(sorted(set(bad)))


def test_library_never_imports_gradio():
    imps, _ = _graph()
    bad = _violations(imps, lambda m, t: "gradio" if _is(t, "gradio") else None)
    assert not bad, "\n".join(bad)


FACES = ("cli", "bench", "evaluation", "demo", "htsparse_ablation", "calibration", "gpu_check")


def test_methods_import_only_the_core():
    imps, _ = _graph()
    banned = ["sparsevid.engine", "sparsevid.runs", "sparsevid.toy"] + [f"sparsevid.{f}" for f in FACES]

    def rule(m, t):
        if _is(m, "sparsevid.methods"):
            return next((f"methods must not import {b}" for b in banned if _is(t, b)), None)

    bad = _violations(imps, rule)
    assert not bad, "\n".join(bad)


PURE = ("sparsevid.traces", "sparsevid.metrics", "sparsevid.plots")
HEAVY = ("torch", "transformers", "sparsevid.models")


def test_records_metrics_and_plots_are_free_of_torch():
    """traces, metrics and plots import neither torch, transformers nor the models, directly or
    through another sparsevid module."""
    imps, graph = _graph()
    bad = _violations(imps, lambda m, t: "pure module" if m in PURE and any(_is(t, h) for h in HEAVY) else None)
    # ... nor through the sparsevid modules they import
    for m in PURE:
        seen, todo, via = {m}, [m], {m: [m]}
        while todo:
            cur = todo.pop()
            for nxt in graph.get(cur, ()):
                if nxt not in seen:
                    seen.add(nxt)
                    via[nxt] = via[cur] + [nxt]
                    todo.append(nxt)
        for dep in seen - {m}:
            for imp in imps[dep]:
                if any(_is(imp.module, h) for h in HEAVY) or dep == "sparsevid.models":
                    bad.append(f"{m} -> {' -> '.join(via[dep][1:])} imports {imp.module} (line {imp.line})")
                    break
    assert not bad, "\n".join(sorted(set(bad)))


def test_no_module_imports_private_names():
    imps, _ = _graph()
    bad = []
    for m, lst in sorted(imps.items()):
        for imp in lst:
            if not _is(imp.module, "sparsevid") or imp.module == m:
                continue
            for n in imp.names:
                if n.startswith("_") and not (n.startswith("__") and n.endswith("__")):
                    bad.append(f"{m}:{imp.line} from {imp.module} import {n}")
    assert not bad, "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each as one cycle through them."""
    index, low, stack, on, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for comp in comps:  # one concrete cycle: a path back to the first module inside the component
        start, members = comp[0], set(comp)
        prev, todo = {start: None}, [start]
        cycle = None
        while todo and cycle is None:
            cur = todo.pop(0)
            for nxt in sorted(graph[cur] & members):
                if nxt == start:
                    path = [cur]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    cycle = path[::-1] + [start]
                    break
                if nxt not in prev:
                    prev[nxt] = cur
                    todo.append(nxt)
        out.append(cycle)
    return out


def test_cycle_finder():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(g) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    _, graph = _graph()
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


# =============================================================================================
# One parser
# =============================================================================================


def _cli_values(argv: list[str]) -> dict:
    opts = methods.all_options()
    parser = argparse.ArgumentParser()
    options.add_arguments(parser, opts)
    return options.values_from_args(parser.parse_args(argv), opts)


def _kept(trace) -> dict:
    return {layer: [k.tolist() for k in rec.kept] for layer, rec in trace.layers.items()}


@pytest.mark.parametrize("model", ["embedded", "llava_onevision"])
def test_one_parser_cli_and_app_give_one_selection(model, model_inputs):
    loaded, inputs = model_inputs(model)
    vis = set(inputs.visual_positions.tolist())
    text = set(range(inputs.m)) - vis
    for typed, value in (("1", 1), ("0.1", 0.1)):
        cli = _cli_values(["--k", typed])
        assert cli == {"k": typed}
        parsed_cli, parsed_app = methods.check_settings(cli), methods.check_settings({"k": typed})
        assert parsed_cli == parsed_app == {"k": value}
        assert type(parsed_cli["k"]) is type(value)  # "1" is a count, "0.1" a fraction
        assert methods.configure("std", cli) == methods.configure("std", {"k": typed}) \
            == methods.configure("std", parsed_app)
        a = runs.run_method(loaded, inputs, "std", parsed_cli, max_new_tokens=2)
        b = runs.run_method(loaded, inputs, "std", {"k": typed}, max_new_tokens=2)
        assert _kept(a) == _kept(b) and a.config == b.config and a.config["k"] == value
        want = 1 if typed == "1" else round(0.1 * inputs.m_v)
        assert set(a.layers) == set(range(loaded.num_layers))
        for layer, rec in a.layers.items():
            assert len(rec.kept) == loaded.num_kv_heads
            for kept in rec.kept:
                kept = set(kept.tolist())
                assert text <= kept, (typed, layer)  # every text position
                assert len(kept & vis) == want, (typed, layer)
    # "1.0" is the whole (every visual token), not a count of one: nothing is selected
    assert methods.check_settings({"k": "1.0"}) == {"k": 1.0}
    assert runs.run_method(loaded, inputs, "std", _cli_values(["--k", "1.0"]), max_new_tokens=2).layers == {}


def test_one_parser_rejects_the_same_bad_text_both_ways():
    from sparsevid.errors import InputError

    for bad in ("0", "1.5", "abc", "-3"):
        with pytest.raises(InputError) as app:
            methods.check_settings({"k": bad})
        with pytest.raises(InputError) as cli:
            methods.check_settings(_cli_values(["--k", bad]))
        assert str(app.value) == str(cli.value)


# =============================================================================================
# One test matrix: methods x architectures
# =============================================================================================

N_NEW = 8
GREEDY = Sampling(ignore_eos=True)  # exactly N_NEW tokens, however early the model would stop

# Settings that make each draft really sparse (and several rounds: γ = 3).
LOSSLESS = {
    "std": {"k": "0.25", "gamma": "3"},
    "streaming": {"k": "0.25", "sinks": "2", "gamma": "3"},
    "layerskip": {"gamma": "3"},
    "htsparse-draft": {"heads_full": "0.25", "heads_sparse": "0.5", "eta": "0.5", "ht_layers": "all",
                       "ht_by_group": "false", "gamma": "3"},
    "sparsemm-draft": {"budget": "0.3", "window": "4", "gamma": "3"},
}

# Settings under which a lossy method keeps every entry; "m" stands for the prompt length.
KEEP_ALL = {
    "htsparse/all-full": ("htsparse", {"heads_full": "1.0", "ht_layers": "all"}),
    "htsparse/head-variant": ("htsparse", {"ht_variant": "head", "heads_full": "0.25", "heads_sparse": "0.75",
                                           "ht_layers": "all"}),
    "htsparse/token-eta1": ("htsparse", {"ht_variant": "token", "eta": "1.0", "ht_layers": "all"}),
    "sparsemm/budget-m": ("sparsemm", {"budget": "m"}),
    "sparsemm/budget-1.0": ("sparsemm", {"budget": "1.0", "window": "4"}),
}


@pytest.fixture(scope="module")
def dense_of(model_inputs):
    cache = {}

    def get(model):
        if model not in cache:
            loaded, inputs = model_inputs(model)
            cache[model] = runs.run_method(loaded, inputs, "dense", {}, max_new_tokens=N_NEW, sampling=GREEDY)
        return cache[model]

    return get


@pytest.mark.filterwarnings("ignore:SparseMM")  # tiny models have no calibration: uniform scores
@pytest.mark.parametrize("method", list(LOSSLESS))
@pytest.mark.parametrize("model", MODELS)
def test_lossless_methods_equal_dense(model, method, model_inputs, dense_of):
    loaded, inputs = model_inputs(model)
    dense = dense_of(model)
    t = runs.run_method(loaded, inputs, method, LOSSLESS[method], max_new_tokens=N_NEW, sampling=GREEDY)
    assert t.token_ids == dense.token_ids and len(t.token_ids) == N_NEW
    assert t.kind == "speculative" and len(t.rounds) >= 2
    # the draft really is sparse
    if method == "layerskip":
        assert t.draft_layers < loaded.num_layers
    else:
        assert t.layers and t.draft_entries < inputs.m
        assert any(n < inputs.m for rec in t.layers.values() for n in rec.lengths)


@pytest.mark.filterwarnings("ignore:SparseMM")
@pytest.mark.parametrize("case", list(KEEP_ALL))
@pytest.mark.parametrize("model", MODELS)
def test_lossy_methods_keeping_everything_equal_dense(model, case, model_inputs, dense_of):
    loaded, inputs = model_inputs(model)
    name, settings = KEEP_ALL[case]
    settings = {k: (str(inputs.m) if v == "m" else v) for k, v in settings.items()}
    dense = dense_of(model)
    t = runs.run_method(loaded, inputs, name, settings, max_new_tokens=N_NEW, sampling=GREEDY)
    assert t.kind == "direct" and t.token_ids == dense.token_ids
    assert all(n == inputs.m for rec in t.layers.values() for n in rec.lengths)
    assert all(rec.query_mask is None and rec.head_scale is None for rec in t.layers.values())
    assert t.kv_bytes == dense.kv_bytes  # the same entries, held once
    # ... and the same logits, bit for bit, at every step
    config, _ = methods.configure(name, settings)
    if getattr(config, "needs_head_scores", False):
        from sparsevid.calibration import load_scores

        config = dataclasses.replace(config, scores=load_scores(loaded).scores)
    d_tokens, d_logits = _steps(loaded, inputs, None, len(dense.token_ids) - 1, dense.token_ids)
    s_tokens, s_logits = _steps(loaded, inputs, config, len(dense.token_ids) - 1, dense.token_ids)
    assert s_tokens == d_tokens == dense.token_ids
    assert torch.equal(s_logits, d_logits)


def _steps(loaded, inputs, policy, n, feed):
    """Prefill + n steps fed `feed` (teacher-forced); -> (argmax tokens, logits [n + 1, V])."""
    run = engine.new_run(loaded, inputs, n + 1, policy, store_dense=policy is None)
    logits = [engine.prefill(loaded, inputs, run)]
    for t in feed[:n]:
        logits.append(engine.step(loaded, run, [t])[-1])
    return [int(x.argmax()) for x in logits], torch.stack(logits)


# =============================================================================================
# Each policy keeps what its definition says (real prefill statistics)
# =============================================================================================


class Recorder:
    """Wraps a policy: the same statistics, window and choices, each layer's (stats, selection) kept."""

    def __init__(self, policy):
        self.policy, self.seen = policy, {}
        self.route_prefill = getattr(policy, "route_prefill", False)

    def needs(self, prompt):
        return attention.needs(self.policy, prompt)

    def select(self, layer, stats, prompt):
        sel = self.policy.select(layer, stats, prompt)
        self.seen[layer] = (stats, sel)
        return sel


def _prefill_with(loaded, inputs, policy):
    rec = Recorder(policy)
    run = engine.new_run(loaded, inputs, 2, rec)
    engine.prefill(loaded, inputs, run)
    assert set(rec.seen) == set(range(loaded.num_layers))
    return rec.seen, engine.prompt_of(loaded, inputs)


POLICY_MODELS = ["embedded", "qwen2_5_vl"]


@pytest.mark.parametrize("model", POLICY_MODELS)
def test_topk_keeps_the_k_most_relevant_visual_tokens_and_all_text(model, model_inputs):
    from sparsevid.methods.std import TopK

    loaded, inputs = model_inputs(model)
    vis = inputs.visual_positions
    text = sorted(set(range(inputs.m)) - set(vis.tolist()))
    K = round(0.25 * inputs.m_v)
    seen, _ = _prefill_with(loaded, inputs, TopK(0.25))
    for layer, (stats, sel) in seen.items():
        assert stats.window is None and stats.query_norm_last is None  # asked for relevance only
        for g, keep in enumerate(sel.keep):
            keep = keep.tolist()
            assert keep == sorted(keep)
            kept_vis = [p for p in keep if p not in text]
            assert [p for p in keep if p in text] == text and len(kept_vis) == K
            r = stats.relevance[g]
            dropped = sorted(set(vis.tolist()) - set(kept_vis))
            assert r[kept_vis].min() >= r[dropped].max(), (layer, g)  # the K highest


@pytest.mark.parametrize("model", POLICY_MODELS)
def test_streaming_keeps_sinks_and_the_recent_window(model, model_inputs):
    from sparsevid.methods.streaming import Streaming

    loaded, inputs = model_inputs(model)
    m, sinks = inputs.m, 3
    total = round(0.25 * inputs.m_v) + (m - inputs.m_v)
    seen, _ = _prefill_with(loaded, inputs, Streaming(0.25, sinks))
    expected = list(range(sinks)) + list(range(m - (total - sinks), m))
    for layer, (stats, sel) in seen.items():
        assert stats == attention.LayerStats()  # it needs no statistics: none computed
        assert [k.tolist() for k in sel.keep] == [expected] * loaded.num_kv_heads


def _pooled(x: np.ndarray, kernel: int = 5) -> np.ndarray:
    """Mean over a centred window of `kernel` (zeros beyond the ends, as count_include_pad pooling)."""
    return np.convolve(x, np.ones(kernel) / kernel, mode="same")


@pytest.mark.parametrize("window", [4, 32])  # 4: SnapKV's last-w rows; 32 > the query tokens: the query's rows
@pytest.mark.parametrize("model", POLICY_MODELS)
def test_sparsemm_budgets_and_snapkv_choice(model, window, model_inputs):
    from sparsevid.calibration import load_scores
    from sparsevid.methods.sparsemm import SparseMM

    loaded, inputs = model_inputs(model)
    m, L, Hkv = inputs.m, loaded.num_layers, loaded.num_kv_heads
    if model == "embedded":
        scores = load_scores(loaded).scores  # the shipped calibration: uneven
    else:
        scores = torch.rand(L, Hkv, generator=torch.Generator().manual_seed(0)) ** 3
        scores /= scores.sum()
    policy = SparseMM(budget=0.3, window=window, scores=scores)
    seen, prompt = _prefill_with(loaded, inputs, policy)
    B = round(0.3 * m)
    w = min(window, B)
    floor = math.floor(policy.rho * (B - w))
    caps = policy.caps
    assert caps.shape == (L, Hkv) and int(caps.sum()) == B * L * Hkv
    assert (caps >= floor + w).all() and (caps <= m).all()
    if B > w:  # a pool to share: uneven scores, uneven caps
        assert len(set(caps.flatten().tolist())) > 1
        top = tuple(int(i) for i in np.unravel_index(int(scores.argmax()), scores.shape))
        assert caps[top] == caps.max()  # the most visual head holds the most
    query_rows = m - inputs.query_start < window
    for layer, (stats, sel) in seen.items():
        obs = (stats.relevance if query_rows else stats.window).numpy()
        for g, keep in enumerate(sel.keep):
            keep = keep.tolist()
            cap = int(caps[layer, g])
            assert len(keep) == cap and keep[-w:] == list(range(m - w, m))  # the last w
            earlier = keep[:-w]
            pooled = _pooled(obs[g, : m - w])
            others = sorted(set(range(m - w)) - set(earlier))
            if earlier and others:
                assert pooled[earlier].min() >= pooled[others].max() - 1e-7, (layer, g)


@pytest.mark.parametrize("by_group", [False, True])
@pytest.mark.parametrize("model", POLICY_MODELS)
def test_htsparse_roles_follow_saliency(model, by_group, model_inputs):
    from sparsevid.methods.htsparse import DROPPED, FULL, SPARSE, HTSparse

    loaded, inputs = model_inputs(model)
    H, Hkv, m = loaded.num_heads, loaded.num_kv_heads, inputs.m
    G = H // Hkv
    policy = HTSparse(heads_full=0.25, heads_sparse=0.5, eta=0.6, layers="all", by_group=by_group)
    seen, _ = _prefill_with(loaded, inputs, policy)
    vis = inputs.visual_positions
    text = set(range(m)) - set(vis.tolist())
    for layer, (stats, sel) in seen.items():
        roles, pi = sel.info["roles"], sel.info["saliency"]
        z = stats.query_norm_last - stats.query_norm_last.mean()
        z = z / stats.query_norm_last.std(unbiased=False)
        torch.testing.assert_close(pi, torch.softmax(z, 0))  # π: softmax of the z-scored query norms
        rank = pi.view(Hkv, G).sum(1).repeat_interleave(G) if by_group else pi
        n_full = int((roles == FULL).sum())
        assert n_full == (math.ceil(round(0.25 * H) / G) * G if by_group else round(0.25 * H))
        for hi in (FULL, SPARSE):  # every full head outranks every sparse one, every sparse every dropped
            lo = [r for r in (SPARSE, DROPPED) if r > hi]
            higher, lower = rank[roles == hi], rank[torch.isin(roles, torch.tensor(lo, dtype=roles.dtype))]
            if higher.numel() and lower.numel():
                assert higher.min() >= lower.max(), (layer, roles.tolist(), rank.tolist())
        # the tokens: the fewest most relevant visual tokens reaching η of the relevance
        r = stats.relevance.sum(0)[vis]
        tokens = sel.info["tokens"]
        idx = torch.searchsorted(vis, tokens)
        kept_r, rest = r[idx], r[torch.ones(len(vis), dtype=torch.bool).index_fill_(0, idx, False)]
        assert kept_r.sum() >= 0.6 * r.sum() - 1e-6
        assert kept_r.sum() - kept_r.min() < 0.6 * r.sum()  # one fewer would not reach η
        if rest.numel():
            assert kept_r.min() >= rest.max()
        # the routing: a group with a full head keeps everything, a sparse one text + the tokens
        for g, keep in enumerate(sel.keep):
            group_roles = roles[g * G:(g + 1) * G]
            keep = set(keep.tolist())
            if (group_roles == FULL).any():
                assert keep == set(range(m))
            elif (group_roles == SPARSE).any():
                assert keep == text | set(tokens.tolist())
            else:
                assert keep == text


# =============================================================================================
# Speculative sampling over several rounds (sparse draft, top_p < 1)
# =============================================================================================

TOP_P = Sampling(temperature=1.0, top_p=0.9, ignore_eos=True)


@pytest.fixture(scope="module")
def peaked(tmp_path_factory, frames):
    """A tiny Qwen2-VL with larger random weights (initializer_range 0.5): its next-token
    distributions hold a dozen tokens, not a hundred, and dropping 90% of the visual tokens changes
    them (the draft's q differs from dense's p), so a sampling test on it has power."""
    from sparsevid.models import load_model
    from sparsevid.tiny import make_tiny_model

    folder = make_tiny_model("qwen2_vl", str(tmp_path_factory.mktemp("peaked")), initializer_range=0.5)
    loaded = load_model(folder, device="cpu", dtype="float32")
    return loaded, loaded.adapter.build_inputs(frames, "what colour is the moving object ?")


def test_sampling_runs_several_rounds_deterministically(peaked):
    loaded, inputs = peaked
    s = dataclasses.replace(TOP_P, seed=7)
    fixed = {"k": "0.1", "gamma": "2", "adaptive_gamma": "off"}  # adaptive γ follows timings: so would the draws
    a = runs.run_method(loaded, inputs, "std", fixed, max_new_tokens=10, sampling=s)
    b = runs.run_method(loaded, inputs, "std", fixed, max_new_tokens=10, sampling=s)
    assert len(a.rounds) >= 3 and len(a.token_ids) == 10
    assert a.token_ids == b.token_ids and [r.accepted for r in a.rounds] == [r.accepted for r in b.rounds]
    assert a.layers  # a sparse draft


def test_speculative_sampling_over_rounds_matches_dense_distribution(peaked):
    """Chi-square two-sample test per position on the first 7 tokens, std draft (k 0.1, γ 1: at least
    3 rounds a run), temperature 1, top_p 0.9: tokens past the first round come from later rounds.
    Measured power: accepting every draft token (the draft's distribution at odd positions) gives
    p < 1e-4 at four of the six positions."""
    from scipy.stats import chi2_contingency

    from sparsevid.methods.std import TopK

    loaded, inputs = peaked
    # the draft's distribution really differs from dense's (else the test could not tell them apart)
    run = engine.new_run(loaded, inputs, 4, TopK(0.1))
    tok = int(engine.prefill(loaded, inputs, run).argmax())
    p = engine.probs_from_logits(engine.step(loaded, run, [tok], mode="dense")[-1], TOP_P)
    q = engine.probs_from_logits(engine.step(loaded, run, [tok], mode="sparse")[-1], TOP_P)
    assert float((p - q).abs().sum() / 2) > 0.2 and 2 < int((p > 0).sum()) < 40

    n, length = 300, 7
    dense, spec = [], []
    for seed in range(n):
        s = dataclasses.replace(TOP_P, seed=seed)
        dense.append(engine.decode(loaded, inputs, max_new_tokens=length, sampling=s).token_ids)
        t = runs.run_method(loaded, inputs, "std", {"k": "0.1", "gamma": "1"}, max_new_tokens=length,
                            sampling=dataclasses.replace(s, seed=seed + 10_000))
        assert len(t.rounds) >= 3
        spec.append(t.token_ids)
    for pos in range(1, length):
        a, b = [t[pos] for t in dense], [t[pos] for t in spec]
        keys = sorted(set(a) | set(b))
        table = np.array([[a.count(k) for k in keys], [b.count(k) for k in keys]])
        big = table.sum(0) >= 10  # pool rare tokens into one bin
        table = np.concatenate([table[:, big], table[:, ~big].sum(1, keepdims=True)], axis=1)
        table = table[:, table.sum(0) > 0]
        assert table.shape[1] >= 2, "degenerate: one token only"
        p = chi2_contingency(table)[1]
        assert p > 0.001, (pos, p, table)


# =============================================================================================
# No state shared between runs
# =============================================================================================


def _model_state(loaded):
    inner = loaded.model.model
    deltas = {name: (None if getattr(obj, "rope_deltas", None) is None else obj.rope_deltas.clone())
              for name, obj in (("model", loaded.model), ("model.model", inner)) if hasattr(obj, "rope_deltas")}
    return ({k: v.detach().clone() for k, v in loaded.model.state_dict().items()},
            len(inner.language_model.layers), deltas, loaded.model.config.to_dict())


@pytest.mark.filterwarnings("ignore:SparseMM")
@pytest.mark.parametrize("model", MODELS)
def test_runs_leave_the_model_as_they_found_it(model, model_inputs, frames):
    loaded, inputs = model_inputs(model)
    other = loaded.adapter.build_inputs(frames[::-1].copy()[:4], "which direction ?")  # another prompt
    before = engine.decode(loaded, inputs, max_new_tokens=N_NEW, sampling=GREEDY).token_ids
    params, n_layers, deltas, config = _model_state(loaded)
    for name, settings in list(LOSSLESS.items()) + [("htsparse", {}), ("sparsemm", {"budget": "0.3"})]:
        for x in (other, inputs):
            runs.run_method(loaded, x, name, settings, max_new_tokens=4, sampling=GREEDY)
    runs.run_method(loaded, other, "dense", {}, max_new_tokens=4, sampling=GREEDY)
    p2, n2, d2, c2 = _model_state(loaded)
    assert n2 == n_layers == loaded.num_layers
    assert p2.keys() == params.keys() and all(torch.equal(p2[k], params[k]) for k in params)
    assert d2.keys() == deltas.keys()
    for k in deltas:
        assert (d2[k] is None and deltas[k] is None) or torch.equal(d2[k], deltas[k]), k
    assert c2 == config
    assert loaded.model.config.get_text_config()._attn_implementation == attention.NAME
    assert engine.decode(loaded, inputs, max_new_tokens=N_NEW, sampling=GREEDY).token_ids == before


# =============================================================================================
# KV bytes honest; statistics only as asked
# =============================================================================================


def test_a_draft_keeping_everything_holds_no_copy(tiny_loaded, video_inputs):
    loaded, inputs = tiny_loaded("qwen2_vl"), video_inputs("qwen2_vl")
    assert 1024 >= inputs.m  # k blank: K + m_t = 1024 covers the whole prompt
    dense = runs.run_method(loaded, inputs, "dense", {}, max_new_tokens=N_NEW, sampling=GREEDY)
    for settings in ({}, {"k": "1.0"}, {"k": str(inputs.m_v)}):
        t = runs.run_method(loaded, inputs, "std", settings, max_new_tokens=N_NEW, sampling=GREEDY)
        assert t.token_ids == dense.token_ids and t.layers == {}
        assert t.kv_bytes == dense.kv_bytes, settings
        assert t.draft_entries == inputs.m
    # refresh off: the draft keeps its own KV of accepted tokens, a real copy, reported as such
    t = runs.run_method(loaded, inputs, "std", {"refresh": "off"}, max_new_tokens=N_NEW, sampling=GREEDY)
    assert t.token_ids == dense.token_ids and t.kv_bytes > dense.kv_bytes
    # a sparse draft's copy is what it keeps beside the dense cache
    t = runs.run_method(loaded, inputs, "std", {"k": "0.25"}, max_new_tokens=N_NEW, sampling=GREEDY)
    assert dense.kv_bytes < t.kv_bytes < 2 * dense.kv_bytes


@pytest.mark.parametrize("policy_name, want", [("streaming", set()), ("std", {"relevance"}),
                                                ("std/all", set()),  # K >= the visual tokens: a dense draft
                                                ("htsparse", {"relevance", "query_norms"}),
                                                ("sparsemm", {"relevance"}),  # the question's rows (< w)
                                                ("sparsemm/window", {"window"})])  # observe="window": last w
def test_prefill_computes_only_the_statistics_the_policy_asks(policy_name, want, tiny_loaded, video_inputs,
                                                             monkeypatch):
    loaded, inputs = tiny_loaded("qwen2_vl"), video_inputs("qwen2_vl")
    asked = []
    real = attention.layer_stats

    def spy(query, key, scale, query_start, window=0, wanted=("relevance", "window", "query_norms")):
        asked.append((set(wanted), window))
        return real(query, key, scale, query_start, window, wanted)

    monkeypatch.setattr(attention, "layer_stats", spy)
    settings = {"std": {"k": "0.25"}, "std/all": {}, "streaming": {"k": "0.25"},
                "sparsemm/window": {"observe": "window"}}
    config, _ = methods.configure(policy_name.split("/")[0], settings.get(policy_name, {}))
    run = engine.new_run(loaded, inputs, 2, config, keep_stats=False)
    engine.prefill(loaded, inputs, run)
    assert run.stats == {}  # nothing kept without keep_stats
    assert len(asked) == loaded.num_layers
    assert all(w == want for w, _ in asked), asked
    assert all((window > 0) == ("window" in want) for _, window in asked)
    # keep_stats adds the relevance, and keeps it
    asked.clear()
    run = engine.new_run(loaded, inputs, 2, config, keep_stats=True)
    engine.prefill(loaded, inputs, run)
    assert all(w == want | {"relevance"} for w, _ in asked)
    assert set(run.stats) == set(range(loaded.num_layers))
    assert all(s.relevance is not None for s in run.stats.values())
