"""Speculative decoding is lossless: greedy tokens equal dense, sampling matches dense's distribution."""

import numpy as np
import pytest

from sparsevid import metrics
from sparsevid.engine import LayerSkipDraft, PolicyDraft, Sampling, decode, speculative_decode
from sparsevid.methods.std import TopK
from sparsevid.runs import compare, run_method

ARCHS = ("qwen2_vl", "qwen2_5_vl", "llava_onevision")


def clip(n=8, size=112, seed=0):
    return (np.random.RandomState(seed).rand(n, size, size, 3) * 255).astype(np.uint8)


@pytest.fixture(scope="module")
def inputs_for(tiny_loaded):
    cache = {}

    def get(arch):
        if arch not in cache:
            loaded = tiny_loaded(arch)
            cache[arch] = (loaded, loaded.adapter.build_inputs(clip(), "what colour is the object ?"))
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_drafts_equal_dense(inputs_for, arch):
    loaded, inputs = inputs_for(arch)
    dense = decode(loaded, inputs, max_new_tokens=24)
    for gamma in (1, 4, 9):
        for k in (1, 0.25, 1.0):
            res = speculative_decode(loaded, inputs, PolicyDraft(TopK(k)), gamma=gamma, max_new_tokens=24)
            assert res.token_ids == dense.token_ids, (arch, gamma, k)
            if isinstance(k, float) and k == 1.0:  # every visual token kept: the draft is dense, all accepted
                assert metrics.acceptance(res) == 1.0
    for name in ("streaming", "layerskip"):
        res = run_method(loaded, inputs, name, {"gamma": "4", "k": "0.25"}, max_new_tokens=24)
        assert res.token_ids == dense.token_ids, name


def test_refresh_on_and_off_both_exact(inputs_for):
    loaded, inputs = inputs_for("qwen2_vl")
    dense = decode(loaded, inputs, max_new_tokens=24)
    for refresh in (True, False):
        for gamma in (1, 3, 9):
            res = speculative_decode(loaded, inputs, PolicyDraft(TopK(0.25), refresh=refresh), gamma=gamma,
                                     max_new_tokens=24)
            assert res.token_ids == dense.token_ids, (refresh, gamma)
    # the same through the settings path
    res = run_method(loaded, inputs, "std", {"k": "0.25", "gamma": "3", "refresh": "off"}, max_new_tokens=24)
    assert res.token_ids == dense.token_ids and res.config["refresh"] is False


class ContraryDraft(PolicyDraft):
    """A draft that proposes the token its logits like least: dense rejects (almost) everything."""

    def scores(self, logits):
        return -logits


def test_every_draft_rejected_still_exact(inputs_for):
    loaded, inputs = inputs_for("qwen2_vl")
    dense = decode(loaded, inputs, max_new_tokens=16)
    res = speculative_decode(loaded, inputs, ContraryDraft(TopK(0.25)), gamma=4, max_new_tokens=16)
    assert res.token_ids == dense.token_ids
    assert metrics.acceptance(res) < 0.1
    accepted = sum(r.accepted for r in res.rounds)
    assert len(res.rounds) >= len(dense.token_ids) - 1 - accepted


def test_eos_inside_a_draft(inputs_for, monkeypatch):
    loaded, inputs = inputs_for("qwen2_vl")
    free = decode(loaded, inputs, max_new_tokens=16).token_ids
    eos = free[6]  # make the 7th generated token the end of the answer
    monkeypatch.setattr(type(loaded.adapter), "eos_token_ids", property(lambda self: [eos]))
    dense = decode(loaded, inputs, max_new_tokens=16)
    assert dense.token_ids[-1] == eos and len(dense.token_ids) <= 7
    for gamma in (4, 9):
        res = speculative_decode(loaded, inputs, PolicyDraft(TopK(1.0)), gamma=gamma, max_new_tokens=16)
        assert res.token_ids == dense.token_ids


@pytest.mark.parametrize("max_new", [1, 2, 5, 11])
def test_max_new_tokens_inside_a_round(inputs_for, max_new):
    loaded, inputs = inputs_for("qwen2_vl")
    dense = decode(loaded, inputs, max_new_tokens=max_new)
    for draft in (PolicyDraft(TopK(1.0)), PolicyDraft(TopK(2)), LayerSkipDraft(1)):
        res = speculative_decode(loaded, inputs, draft, gamma=9, max_new_tokens=max_new)
        assert res.token_ids == dense.token_ids
        assert len(res.token_ids) == len(dense.token_ids) <= max_new


def test_compare_reports_figures(inputs_for):
    loaded, inputs = inputs_for("qwen2_vl")
    traces, figures = compare(loaded, inputs, "std,streaming,layerskip", {"k": "0.5", "gamma": "4",
                                                                          "adaptive_gamma": "off"}, max_new_tokens=16)
    assert list(traces) == ["dense", "std", "streaming", "layerskip"]
    assert list(figures) == ["std", "streaming", "layerskip"]
    for name in ("std", "streaming", "layerskip"):
        e = figures[name]
        assert e["identical_to_dense"] and e["lossless"]
        assert 0 <= e["acceptance"] <= 1 and e["rounds"] >= 1 and e["tokens_per_round"] >= 1
        assert e["predicted_speedup"] is None if e["acceptance"] == 0 else e["predicted_speedup"] > 0
        assert e["gamma"] == 4 and traces[name].config["gamma"] == 4
        # the run's own step costs, in ms and in dense steps, and the bound from them
        assert e["dense_step_ms"] > 0 and e["draft_step_ms"] > 0 and e["verify_ms"] > 0
        assert e["draft_step_cost"] == pytest.approx(e["draft_step_ms"] / e["dense_step_ms"])
        assert e["bound_speedup"] > 0 and e["bound_speedup_full_acceptance"] >= e["bound_speedup"]
    # the draft's compact cache is extra memory held beside the full one; LayerSkip shares dense's
    assert traces["std"].kv_bytes > traces["dense"].kv_bytes
    assert traces["layerskip"].kv_bytes == traces["dense"].kv_bytes


def test_compare_repeats_times_every_method_again_and_takes_medians(inputs_for):
    """`repeats`: more passes, each method's run between two dense runs; the same tokens, each
    method's times the median over its passes (so not the first pass's, unless it was the median),
    its decode speedup the median of its runs against the dense runs around them."""
    loaded, inputs = inputs_for("qwen2_vl")
    passes, results = [], []
    traces, figures = compare(loaded, inputs, "std,layerskip", {"k": "0.5"}, max_new_tokens=12, repeats=3,
                              on_pass=passes.append, on_result=results.append)
    assert passes == [2, 3] and [t.method for t in results] == ["dense", "std", "layerskip"]  # streamed once
    assert traces["std"].token_ids == traces["dense"].token_ids == results[1].token_ids
    # dense ran before and after the streamed methods, then after each method of each extra pass
    d = traces["dense"].decode_runs_s
    assert len(d) == 2 + 2 * 2 and len(traces["dense"].step_s) == 6 * len(results[0].step_s) > 0
    assert figures["std"]["identical_to_dense"]
    # run order: d0 std layerskip d1 | std d2 layerskip d3 | std d4 layerskip d5
    around = {"std": [(d[0], d[1]), (d[1], d[2]), (d[3], d[4])],
              "layerskip": [(d[0], d[1]), (d[2], d[3]), (d[4], d[5])]}
    for name in ("std", "layerskip"):
        t = traces[name]
        assert len(t.decode_runs_s) == 3 and t.dense_pair_s == pytest.approx([(a + b) / 2 for a, b in around[name]])
        per_token = t.decode_tokens / traces["dense"].decode_tokens
        paired = [p / r * per_token for p, r in zip(t.dense_pair_s, t.decode_runs_s)]
        lo, hi = figures[name]["speedup_range"]
        assert (lo, hi) == pytest.approx((min(paired), max(paired))) and lo > 0
        # the headline figure is bench's statistic: the median of the paired ratios, inside the range
        assert figures[name]["speedup"] == pytest.approx(sorted(paired)[1])


def test_compare_times_more_passes_while_they_fit_in_the_budget(inputs_for):
    """`max_repeats` and `budget_s`: at least `repeats` passes, more up to `max_repeats` while they fit."""
    loaded, inputs = inputs_for("qwen2_vl")
    for budget, want in ((0.0, 2), (600.0, 4)):
        passes = []
        traces, figures = compare(loaded, inputs, "std", {"k": "0.5"}, max_new_tokens=8, repeats=2, max_repeats=4,
                                  budget_s=budget, on_pass=passes.append)
        assert passes == list(range(2, want + 1)) and len(traces["std"].decode_runs_s) == want
        assert len(traces["std"].dense_pair_s) == want and len(traces["dense"].decode_runs_s) == want + 1


def test_compare_extra_passes_decode_from_the_first_runs_prefills(inputs_for, monkeypatch):
    """The passes beyond `repeats` time decoding only: each run starts from the state its method's
    first run kept after its prefill (no prefill, the same tokens); the prefill figures are the
    medians of the runs that prefilled. Not where the model's buffers are pooled (CUDA: graphs are
    tied to them) and not beyond `runs.KEEP_PREFILL_BYTES` of kept caches, where every pass prefills."""
    import dataclasses

    from sparsevid import engine, runs
    from sparsevid.cache import BufferPool

    loaded, inputs = inputs_for("qwen2_vl")
    calls = []
    real = engine.prefill
    monkeypatch.setattr(engine, "prefill", lambda *a: calls.append(1) or real(*a))
    pooled = dataclasses.replace(loaded, pool=BufferPool())
    for model, cap, prefills in ((loaded, runs.KEEP_PREFILL_BYTES, 3 + 2), (pooled, runs.KEEP_PREFILL_BYTES, 3 + 2 * 3),
                                 (loaded, 1, 3 + 2 * 3)):  # past the cap on kept caches' bytes: every pass prefills
        monkeypatch.setattr(runs, "KEEP_PREFILL_BYTES", cap)
        calls.clear()
        traces, figures = compare(model, inputs, "std", {"k": "0.5"}, max_new_tokens=8, repeats=2, max_repeats=4,
                                  budget_s=600.0, warmup=False)
        assert len(calls) == prefills  # pass 1: dense, std, dense; pass 2: std, dense; passes 3-4: none (CPU)
        assert len(traces["std"].decode_runs_s) == 4 and len(traces["dense"].decode_runs_s) == 5
        assert traces["std"].token_ids == traces["dense"].token_ids and figures["std"]["identical_to_dense"]
        assert not traces["std"].prefill_reused and traces["std"].prefill_s > 0


@pytest.mark.parametrize("name", ["dense", "std", "layerskip", "htsparse", "sparsemm", "htsparse-draft"])
def test_a_run_from_a_kept_prefill_decodes_as_a_fresh_run(inputs_for, name, monkeypatch):
    """`run_method(keep=...)` keeps the run's state after its prefill; runs from it (`prefilled=`)
    do not prefill and give the fresh run's tokens, greedy and sampling, again and again."""
    from sparsevid import engine

    loaded, inputs = inputs_for("qwen2_vl")
    # a fixed γ: adaptive γ's rounds follow measured times, and with them the draws from the generator
    settings = {"k": "0.5", "budget": "0.5", "gamma": "3", "adaptive_gamma": "off"} if name != "dense" else None
    for sampling in (Sampling(), Sampling(temperature=1.0, seed=5)):
        keep = []
        first = run_method(loaded, inputs, name, settings, 16, sampling, keep=keep)
        calls = []
        real = engine.prefill
        monkeypatch.setattr(engine, "prefill", lambda *a: calls.append(1) or real(*a))
        try:
            again = [run_method(loaded, inputs, name, settings, 16, sampling, prefilled=keep[0]) for _ in range(2)]
        finally:
            monkeypatch.setattr(engine, "prefill", real)
            keep[0].release()
        assert calls == []
        fresh = run_method(loaded, inputs, name, settings, 16, sampling)
        assert len(first.token_ids) > 2
        for t in again:
            assert t.token_ids == first.token_ids == fresh.token_ids, (name, sampling)
            assert t.prefill_reused and t.prefill_s == first.prefill_s


def first_tokens(n, runner):
    return [tuple(runner(Sampling(temperature=1.0, seed=seed)).token_ids[:3]) for seed in range(n)]


def test_speculative_sampling_matches_dense_distribution(inputs_for):
    """Chi-square two-sample test on the (2nd, 3rd) generated tokens with a crude LayerSkip draft.

    A wrong acceptance rule (e.g. always accepting) yields the draft's distribution and fails.
    (Several rounds with a sparse draft and top_p < 1: tests/test_house.py.)
    """
    from scipy.stats import chi2_contingency

    loaded, inputs = inputs_for("qwen2_vl")
    n = 400
    dense = first_tokens(n, lambda s: decode(loaded, inputs, max_new_tokens=3, sampling=s))
    spec = first_tokens(n, lambda s: speculative_decode(
        loaded, inputs, LayerSkipDraft(1), gamma=2, max_new_tokens=3,
        sampling=Sampling(s.temperature, s.top_p, s.seed + 10_000)))
    for pos in (1, 2):
        a = [t[pos] for t in dense if len(t) > pos]
        b = [t[pos] for t in spec if len(t) > pos]
        keys = sorted(set(a) | set(b))
        table = np.array([[a.count(k) for k in keys], [b.count(k) for k in keys]])
        big = table.sum(0) >= 10  # pool rare tokens into one bin
        table = np.concatenate([table[:, big], table[:, ~big].sum(1, keepdims=True)], axis=1)
        table = table[:, table.sum(0) > 0]
        p = chi2_contingency(table)[1]
        assert p > 0.001, (pos, p)


# --- adaptive γ --------------------------------------------------------------------------------------


def test_best_gamma_is_zero_when_the_draft_costs_a_dense_step_and_large_when_it_is_cheap():
    from sparsevid.metrics import best_gamma

    # a draft step as dear as a dense step, verification rows as dear too: speculation cannot pay
    assert best_gamma(alpha=0.9, gamma_max=9, t_draft=1.0, t_dense=1.0, t_row=1.0) == 0
    assert best_gamma(alpha=0.99, gamma_max=9, t_draft=0.9, t_dense=1.0, t_row=0.5) == 0
    # a draft step at 0.96 of a dense step, all accepted, verification rows free: 1.04x, within the
    # 5 % margin the measured costs need, so dense; at 0.7: 1.37x, speculate
    assert best_gamma(alpha=1.0, gamma_max=9, t_draft=0.96, t_dense=1.0, t_row=0.0) == 0
    assert best_gamma(alpha=1.0, gamma_max=9, t_draft=0.7, t_dense=1.0, t_row=0.0) == 9
    # a cheap draft and cheap verification rows at high acceptance: the longest draft
    assert best_gamma(alpha=0.95, gamma_max=9, t_draft=0.1, t_dense=1.0, t_row=0.02) == 9
    # low acceptance: short drafts
    assert 0 < best_gamma(alpha=0.5, gamma_max=9, t_draft=0.1, t_dense=1.0, t_row=0.02) < 5


def test_a_batch_bound_shares_one_gamma_across_rows():
    """`bench --batch`: rows decoded together share each round's γ and passes, so the batch's bound
    is the best γ for the rows' mean tokens per round; it equals a row's own bound when every row
    accepts alike and is below the median of the rows' own bounds when they differ."""
    from sparsevid.metrics import batch_bound, speculative_bound

    def row(alpha):
        return dict(draft_step_cost=0.3, verify_cost=1.5, verify_base=1.5, verify_row_cost=0.0, gamma=9,
                    position_acceptance=alpha)

    def own(alpha):
        return max([1.0] + [speculative_bound(alpha, g, 0.3, 1.5) for g in range(1, 10)])

    assert batch_bound([row(0.8)] * 4, adaptive=True) == pytest.approx(own(0.8))
    assert batch_bound([row(0.8)] * 4, adaptive=False) == pytest.approx(speculative_bound(0.8, 9, 0.3, 1.5))
    mixed = [row(1.0), row(1.0), row(1.0), row(0.3), row(0.3)]
    assert 1.0 < batch_bound(mixed, adaptive=True) < own(1.0)  # the median row's own bound
    # no row speculated (no costs): no bound; a batch whose best is under dense: 1x with adaptive γ
    assert batch_bound([dict(gamma=9)], adaptive=True) is None
    assert batch_bound([dict(row(0.0), draft_step_cost=1.0)], adaptive=True) == 1.0


def test_the_bound_prices_each_gamma_by_its_own_verification():
    """A verification of γ + 1 tokens costs more at a longer γ (compute-bound at batch 8 on a CPU).
    The bound over γ of an adaptive run prices each γ from a line through its passes at each γ
    (`step_costs`), not from one γ's pass: probes at γ = 3 whose pass costs 1.6 dense steps, and
    passes at γ = 1 of 1.2, give v(γ) = 1 + 0.2·γ, so γ = 9 costs 2.8, not 1.6; one γ: through a
    dense step (v0 = 1)."""
    from sparsevid.metrics import ratios, speculative_bound, step_costs
    from sparsevid.traces import PromptInfo, Round, Trace

    step = 0.01
    dense = Trace("dense", "dense", [1] * 30, "", 0.1, 29 * step, 1, step_s=[step] * 29)
    rounds = ([Round([5, 6, 7], 3, 8, 3 * 0.5 * step, 1.6 * step, gamma=3, why="probe")] * 4
              + [Round([5], 1, 6, 0.5 * step, 1.2 * step, gamma=1, why="best")] * 4)
    t = Trace("std", "speculative", [1] * 25, "", 0.1, 0.2, 1, rounds=rounds, gamma=9, draft_entries=10)
    c, v, v0, r = step_costs(t, dense)
    assert (c, v0, r) == (pytest.approx(0.5), pytest.approx(1.0), pytest.approx(0.2))
    f = ratios(t, dense, PromptInfo(100, 95, np.arange(90), np.zeros((90, 3), dtype=int), (1, 9, 10)))
    alpha = f["position_acceptance"]
    assert alpha == 1.0 and f["verify_base"] == pytest.approx(1.0) and f["verify_row_cost"] == pytest.approx(0.2)
    best = max(speculative_bound(alpha, g, 0.5, 1.0 + 0.2 * g) for g in range(1, 10))
    assert f["bound_speedup"] == pytest.approx(best) and f["bound_speedup"] < speculative_bound(alpha, 9, 0.5, 1.6)
    one = Trace("std", "speculative", [1] * 25, "", 0.1, 0.2, 1, rounds=rounds[:4], gamma=3, draft_entries=10)
    assert step_costs(one, dense)[2:] == (pytest.approx(1.0), pytest.approx(0.6 / 3))


def test_gamma_plan_of_a_batch_chooses_for_each_rows_acceptance_not_the_pooled_one():
    """Rows decoded together share a round's γ: one row accepting every draft token beside one
    accepting none gets more from a longer γ (6: their mean Ω over each row's own α, 37/38 and 1/6 by
    Laplace's rule) than the pooled α = 37/42 suggests (4); a row left alone takes its own α."""
    from sparsevid.engine import GammaPlan
    from sparsevid.metrics import best_gamma

    plan = GammaPlan(gamma=9, adaptive=True, draft_is_dense=False)
    for _ in range(4):
        plan.observe(0, 0.0, 1.0, 0)  # dense steps: t_dense 1
    for _ in range(4):  # draft steps 0.3, each verified token 0.02; row 0 accepts all, row 1 none
        plan.observe(9, 9 * 0.3, 1.0 + 9 * 0.02, 9, 10, rows={0: (9, 9), 1: (0, 1)})
    assert plan.alphas([0, 1]) == pytest.approx([37 / 38, 1 / 6])
    assert plan.alpha == pytest.approx(37 / 42) and best_gamma(plan.alpha, 9, 0.3, 1.0, 0.02) == 4
    assert plan.choose(40, [0, 1]) == (6, "best")
    assert plan.choose(40) == (4, "best")  # without rows: the pooled α
    assert plan.choose(40, [1]) == (best_gamma(1 / 6, 9, 0.3, 1.0, 0.02), "best")  # row 1 left alone: its own


def test_gamma_plan_measures_settled_dense_steps_probes_then_falls_back_to_dense():
    """The first dense steps after a prefill run slower and speed up over a few steps: the plan
    measures until they settle and keeps only the settled readings, so a draft is weighed against
    what a dense step really costs. A draft that does not pay is tried again later, ever more rarely;
    one that cannot pay even if every token were accepted is not tried again."""
    from sparsevid.engine import GammaPlan

    plan = GammaPlan(gamma=9, adaptive=True, draft_is_dense=False, reprobe=3, probe=3)
    for t in (1.5, 1.5, 1.2, 1.0, 1.01, 0.99):  # warming up: the fastest of the last three still 5 % below
        assert plan.choose(40) == (0, "dense step")
        plan.observe(0, 0.0, t, 0)
    assert plan.t_dense == 1.0  # the last three
    assert plan.choose(40) == (0, "dense step")  # 1.0 of the last three against 1.2 before them
    plan.observe(0, 0.0, 1.02, 0)  # settled: 0.99 against 1.0 before
    assert plan.t_dense == pytest.approx(1.01)
    assert plan.choose(40) == (3, "probe")  # a short probe first
    plan.observe(3, 3 * 0.6, 1.0 + 3 * 0.1, 0)  # a dear draft (0.6 of a dense step), its first token rejected
    assert plan.choose(40) == (0, "best")
    for _ in range(3):
        plan.observe(0, 0.0, 1.0, 0)
        assert plan.choose(40) == (0, "best")
    for _ in range(3):  # a probe that did not pay doubles the wait: 2 x `reprobe` dense steps
        plan.observe(0, 0.0, 1.0, 0)
    assert plan.choose(40) == (3, "probe")  # then it tries the draft again
    plan.observe(3, 3 * 0.6, 1.0 + 3 * 0.1, 0)
    assert plan.choose(40) == (0, "best") and plan.wait == 12  # and waits twice as long again
    assert plan.choose(2)[0] <= 2  # never more than the room left
    dear = GammaPlan(gamma=9, adaptive=True, draft_is_dense=False)
    for _ in range(4):
        dear.observe(0, 0.0, 1.0, 0)
    assert dear.choose(40) == (3, "probe")
    dear.observe(3, 3 * 1.0, 1.0 + 3 * 0.2, 3)  # draft steps as dear as dense steps, all accepted
    assert dear.choose(40) == (3, "probe")  # one reading decides nothing (a run's first draft steps are slower)
    dear.observe(3, 3 * 1.0, 1.0 + 3 * 0.2, 3)
    assert dear.choose(40) == (0, "best") and dear.wait == dear.max_wait  # hopeless: never again
    dearer = GammaPlan(gamma=9, adaptive=True, draft_is_dense=False)
    for _ in range(4):
        dearer.observe(0, 0.0, 1.0, 0)
    assert dearer.choose(40) == (3, "probe")
    dearer.observe(3, 3 * 1.2, 1.0 + 3 * 0.45, 3)  # draft steps dearer than dense ones (the embedded model, 64 frames)
    # even at `first_read` (0.7) of what the first probe read, a draft accepted in full could not pay: one probe decides
    assert dearer.choose(40) == (0, "best") and dearer.wait == dearer.max_wait
    cold = GammaPlan(gamma=9, adaptive=True, draft_is_dense=False)
    for _ in range(4):
        cold.observe(0, 0.0, 1.0, 0)
    cold.observe(3, 3 * 1.0, 1.0 + 3 * 0.2, 3)  # a run's first probe, slow as dense steps
    assert cold.choose(40) == (3, "probe")
    for _ in range(2):
        cold.observe(3, 3 * 0.1, 1.0 + 3 * 0.02, 3)  # then the draft's own cost
    assert cold.choose(40)[0] > 0  # it drafts
    cheap = GammaPlan(gamma=9, adaptive=True, draft_is_dense=False)
    for _ in range(4):
        cheap.observe(0, 0.0, 1.0, 0)
    cheap.observe(3, 3 * 0.1, 1.0 + 3 * 0.02, 3)  # a cheap draft, all accepted (α 4/5 by Laplace's rule)
    assert cheap.choose(40) == (5, "best")  # a long draft next
    assert GammaPlan(9, adaptive=False, draft_is_dense=True).choose(40) == (9, "fixed")
    assert GammaPlan(9, adaptive=True, draft_is_dense=True).choose(40) == (0, "draft = dense")


def test_gamma_plan_probes_again_at_once_while_the_draft_is_accepted_in_full():
    """A probe accepted in full leaves α at 4/5 by Laplace's rule: too short, with these costs, to
    pay. Rather than wait (and on a 48-token answer never draft), the plan probes again at once while
    nothing is rejected, until α pays; a probe that rejects a token doubles the wait as before."""
    from sparsevid.engine import GammaPlan

    plan = GammaPlan(gamma=9, adaptive=True, draft_is_dense=False, reprobe=3, probe=3)
    for _ in range(4):
        plan.observe(0, 0.0, 1.0, 0)
    assert plan.choose(40) == (3, "probe")
    full = (3, 3 * 0.5, 1.0 + 3 * 0.3, 3)  # draft steps half a dense step, every token accepted
    plan.observe(*full)
    assert plan.alpha == pytest.approx(0.8) and plan.choose(40) == (3, "probe")  # again, at once
    plan.observe(*full)
    assert plan.choose(40) == (3, "probe")  # α 7/8: not yet
    plan.observe(*full)
    assert plan.choose(40) == (1, "best")  # α 10/11 pays
    plan.observe(3, 3 * 0.5, 1.0 + 3 * 0.3, 1)  # a rejection (α 11/15): dense steps, the wait doubles
    assert plan.choose(40) == (0, "best") and plan.wait == 6
    batch = GammaPlan(gamma=9, adaptive=True, draft_is_dense=False, reprobe=3, probe=3)
    for _ in range(4):
        batch.observe(0, 0.0, 1.0, 0)
    batch.observe(3, 3 * 0.5, 1.0 + 3 * 0.3, 5, 6, rows={0: (3, 3), 1: (2, 3)})  # one row rejected
    assert batch.choose(40, [0, 1]) == (0, "best") and batch.wait == 6


def test_gamma_plan_with_padded_verifications_reads_the_cost_per_padded_row(tiny_loaded):
    """Captured CUDA graphs pad every verification to γ_max + 1 = 10 rows: a 3-token probe's pass
    costs 1.0 + 9 x 0.1 dense steps. A plan told so reads t_row 0.1 (not 0.3, the pass over the three
    tokens drafted) and, a pass costing the same for every γ, drafts longer: γ 5 at α 4/5, where the
    per-token reading gives 1. On the CPU nothing is padded."""
    from sparsevid.engine import GammaPlan, padded_rows

    plans = {}
    for padded in (10, None):
        plan = plans[padded] = GammaPlan(gamma=9, adaptive=True, draft_is_dense=False, padded=padded)
        for _ in range(4):
            plan.observe(0, 0.0, 1.0, 0)
        plan.observe(3, 3 * 0.3, 1.0 + 9 * 0.1, 3)
    assert plans[10].t_row == pytest.approx(0.1) and plans[None].t_row == pytest.approx(0.3)
    assert plans[10].choose(40) == (5, "best") and plans[None].choose(40) == (1, "best")
    assert padded_rows(tiny_loaded("qwen2_vl"), 10) is None


def test_gamma_plan_estimates_the_per_position_acceptance_of_a_simulated_draft():
    """A draft whose every token is accepted with probability 0.8 (independently), drafting 9 per
    round: the plan's α converges to 0.8 (accepted / positions tested), not to accepted / proposed
    (~0.39: the tokens after a rejection are never tested), and so it keeps speculating."""
    import random

    from sparsevid.engine import GammaPlan
    from sparsevid.metrics import best_gamma, expected_tokens_per_round

    rng = random.Random(0)
    plan = GammaPlan(gamma=9, adaptive=True, draft_is_dense=False)
    for _ in range(4):
        plan.observe(0, 0.0, 1.0, 0)
    proposed = accepted = 0
    for _ in range(400):
        a = 0
        while a < 9 and rng.random() < 0.8:
            a += 1
        plan.observe(9, 9 * 0.2, 1.0 + 9 * 0.02, a)
        proposed, accepted = proposed + 9, accepted + a
    assert abs(plan.alpha - 0.8) < 0.03
    assert accepted / proposed < 0.45  # the old estimate, biased low
    # the γ that is best at the true 0.8 (4: Ω = 3.4 tokens for 1.9 dense steps), not the biased one's
    assert plan.choose(40) == (best_gamma(0.8, 9, 0.2, 1.0, 0.02), "best") == (4, "best")
    assert best_gamma(accepted / proposed, 9, 0.2, 1.0, 0.02) < 4
    assert expected_tokens_per_round(plan.alpha, 4) > 3


def test_gamma_plan_costs_hold_against_one_slow_reading():
    """On a noisy machine one slow draft step (2.7x the others) must not switch a run to dense steps:
    the costs are medians of recent readings."""
    from sparsevid.engine import GammaPlan
    from sparsevid.metrics import best_gamma

    plan = GammaPlan(gamma=9, adaptive=True, draft_is_dense=False)
    for t in (3.0, 1.0, 1.0, 1.0, 1.0):  # the cold first dense step, then four dense steps
        plan.observe(0, 0.0, t, 0)
    assert plan.t_dense == 1.0
    for draft in (0.3, 0.3, 0.81, 0.3):  # one reading 2.7x the others
        plan.observe(9, 9 * draft, 1.1, 9)
        g = best_gamma(plan.alpha, 9, 0.3, 1.0, 0.1 / 9)  # as if every draft step took 0.3
        assert g > 0 and plan.choose(40) == (g, "best"), draft
    assert plan.t_draft == 0.3


def test_adaptive_gamma_is_token_identical_and_never_runs_a_draft_that_keeps_everything(model_inputs):
    from sparsevid.engine import Sampling
    from sparsevid.runs import run_method

    loaded, inputs = model_inputs("qwen2_vl")
    dense = run_method(loaded, inputs, "dense", {}, 24, Sampling(ignore_eos=True))
    sparse = run_method(loaded, inputs, "std", {"k": "0.25"}, 24, Sampling(ignore_eos=True))
    assert sparse.token_ids == dense.token_ids
    assert sparse.rounds[0].why == "dense step" and any(r.proposed for r in sparse.rounds)
    whole = run_method(loaded, inputs, "std", {}, 24, Sampling(ignore_eos=True))  # K + m_t >= m: keeps all
    assert whole.token_ids == dense.token_ids
    assert whole.layers == {} and all(r.why == "draft = dense" and not r.proposed for r in whole.rounds)
    fixed = run_method(loaded, inputs, "std", {"adaptive_gamma": "off"}, 24, Sampling(ignore_eos=True))
    assert fixed.token_ids == dense.token_ids and all(r.why == "fixed" for r in fixed.rounds)


def test_a_shape_where_the_draft_was_found_hopeless_runs_dense_steps_without_probes_for_two_runs(model_inputs):
    """Adaptive γ remembers, per model, where a run found that not even a draft accepted in full could
    pay (`engine.HopelessShapes`): the next two adaptive runs of that method, γ, prompt length and draft
    settings run dense steps from the start (the probes a hopeless draft costs: 3-5 % of a 48-token
    answer at 4,608 visual tokens on a 2-core Xeon), with dense's tokens; the run after them probes
    again, and a run that drafts without finding it hopeless drops the verdict."""
    from sparsevid.engine import GammaPlan, HopelessShapes

    loaded, inputs = model_inputs("qwen2_vl")
    dense = decode(loaded, inputs, max_new_tokens=24, sampling=Sampling(ignore_eos=True))
    draft = PolicyDraft(TopK(0.25))
    shapes, key = HopelessShapes(loaded), HopelessShapes.key("std", 9, [inputs], draft)
    assert key != HopelessShapes.key("std", 9, [inputs], PolicyDraft(TopK(0.5)))  # the draft's settings count

    def run():
        return speculative_decode(loaded, inputs, PolicyDraft(TopK(0.25)), gamma=9, adaptive=True, max_new_tokens=24,
                                  sampling=Sampling(ignore_eos=True))

    dear = GammaPlan(gamma=9, adaptive=True, draft_is_dense=False)  # a draft step as dear as a dense step
    for _ in range(4):
        dear.observe(0, 0.0, 1.0, 0)
    for _ in range(2):
        assert dear.choose(40) == (3, "probe")
        dear.observe(3, 3 * 1.0, 1.0 + 3 * 0.2, 3)
    assert dear.choose(40) == (0, "best") and dear.found_hopeless
    short = GammaPlan(gamma=9, adaptive=True, draft_is_dense=False)  # an answer that ends right after its probes
    for _ in range(4):
        short.observe(0, 0.0, 1.0, 0)
    for _ in range(2):
        assert short.choose(40) == (3, "probe")
        short.observe(3, 3 * 1.0, 1.0 + 3 * 0.2, 3)
    assert not short.found_hopeless  # no round asked after the second probe
    short.conclude()  # the run's end asks
    assert short.found_hopeless
    shapes.update(key, dear)
    for _ in range(2):
        carried = run()
        assert carried.token_ids == dense.token_ids
        assert not any(r.proposed for r in carried.rounds)
        assert carried.rounds[-1].why == "hopeless here before" and carried.rounds[0].why == "dense step"
    probing = run()  # the verdict served two runs: this one probes again
    assert probing.token_ids == dense.token_ids and any(r.why == "probe" for r in probing.rounds)
    assert shapes.left.get(key) in (None, 2)  # renewed where it found the draft hopeless again, else dropped
    shapes.left[key] = 2
    shapes.forget()
    assert not shapes.carried(key)
    cheap = GammaPlan(gamma=9, adaptive=True, draft_is_dense=False, carried=True)
    assert cheap.wait == cheap.max_wait
    cheap.observe(3, 3 * 0.1, 1.0 + 3 * 0.02, 3)  # it drafted (after max_wait dense steps) and could pay
    cheap.observe(0, 0.0, 1.0, 0)
    cheap.conclude()
    assert not cheap.found_hopeless
    shapes.left[key] = 1
    shapes.update(key, cheap)
    assert not shapes.carried(key)
