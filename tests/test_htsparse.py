"""HT-Sparse (SPEC §3.2): pure functions on hand-computed cases, exactness, losslessness, KV savings."""

import math

import numpy as np
import pytest
import torch

from sparsevid.attention import _route_prefill_rows
from sparsevid.cache import LayerSelection
from sparsevid.engine import decode, new_run, prefill, step
from sparsevid.htsparse import (DROPPED, FULL, SPARSE, HTSelection, HTSparse, coverage_count, head_keys, partition,
                                prefill_attended, route, routed_layers, saliency, select_tokens)
from sparsevid.methods import METHODS, Settings, compare, run_method

# --- pure functions -----------------------------------------------------------------------------


def test_saliency_zscore_softmax():
    norms = torch.tensor([1.0, 2.0, 3.0, 4.0])
    sd = math.sqrt(1.25)  # population std of 1..4
    z = torch.tensor([-1.5, -0.5, 0.5, 1.5]) / sd
    assert torch.allclose(saliency(norms, 1.0), torch.softmax(z, 0))
    assert torch.allclose(saliency(norms, 0.5), torch.softmax(z / 0.5, 0))
    assert torch.allclose(saliency(norms * 10 + 3, 1.0), saliency(norms, 1.0), atol=1e-6)  # z-score: scale-free
    assert torch.allclose(saliency(torch.full((4,), 2.0)), torch.full((4,), 0.25))  # all equal: uniform


def test_partition_hand_case():
    pi = torch.tensor([0.1, 0.4, 0.2, 0.3])
    assert partition(pi, 1, 2).tolist() == [DROPPED, FULL, SPARSE, SPARSE]
    assert partition(pi, 2, 1).tolist() == [DROPPED, FULL, SPARSE, FULL]
    assert partition(pi, 4, 0).tolist() == [FULL] * 4
    assert partition(torch.full((3,), 1 / 3), 1, 1).tolist() == [FULL, SPARSE, DROPPED]  # ties: lower index


def test_partition_by_variant_and_fractions():
    pi = torch.tensor([0.05, 0.4, 0.15, 0.3, 0.02, 0.03, 0.03, 0.02])
    assert HTSparse(heads_full=0.25, heads_sparse=0.5, by_group=False).roles(pi).tolist() == [1, 0, 1, 0, 2, 1, 1, 2]
    assert HTSparse(heads_full=0, heads_sparse=0, by_group=False).roles(pi).tolist() == [2, 0, 2, 2, 2, 2, 2, 2]  # >= 1 full
    assert HTSparse(heads_full=1, heads_sparse=2, variant="head", by_group=False).roles(pi).tolist() == [2, 0, 0, 0, 2, 2, 2, 2]
    assert HTSparse(variant="token").roles(pi).tolist() == [SPARSE] * 8
    # by_group: whole GQA groups ranked by their summed π (groups of 2: 0.45, 0.45, 0.05, 0.05)
    assert HTSparse(heads_sparse=0.5, by_group=True).roles(pi, 4).tolist() == [0, 0, 1, 1, 1, 1, 2, 2]  # ties: lower group
    g = torch.tensor([0.05, 0.15, 0.4, 0.4])  # two groups of 2: 0.2, 0.8
    assert HTSparse(by_group=True).roles(g, 2).tolist() == [SPARSE, SPARSE, FULL, FULL]
    assert HTSparse(by_group=True, heads_sparse=0).roles(g, 2).tolist() == [DROPPED, DROPPED, FULL, FULL]


def test_coverage_rule_hand_case():
    r = torch.tensor([5.0, 1.0, 3.0, 1.0])  # sorted 5, 3, 1, 1: prefix sums 5, 8, 9, 10 of 10
    assert coverage_count(r, 0.5) == 1
    assert coverage_count(r, 0.75) == 2
    assert coverage_count(r, 0.81) == 3
    assert coverage_count(r, 0.95) == 4
    assert coverage_count(r, 1.0) == 4
    assert select_tokens(r, eta=0.75).tolist() == [0, 2]
    assert select_tokens(torch.tensor([5.0, 1.0, 3.0, 2.0]), l_v=3).tolist() == [0, 2, 3]
    assert select_tokens(r, l_v=0.5).tolist() == [0, 2]
    assert select_tokens(r, eta=None).tolist() == [0, 1, 2, 3]


def test_routed_layers():
    assert list(routed_layers("mid+late", 28)) == list(range(9, 28))
    assert list(routed_layers("early", 28)) == list(range(9))
    assert list(routed_layers("mid", 28)) == list(range(9, 19))
    assert list(routed_layers("late", 28)) == list(range(19, 28))
    assert [list(routed_layers(s, 4)) for s in ("early", "mid", "late", "mid+late")] == [[0], [1, 2], [3], [1, 2, 3]]
    assert [list(routed_layers(s, 3)) for s in ("early", "mid", "late")] == [[0], [1], [2]]
    with pytest.raises(ValueError):
        routed_layers("middle", 4)


TEXT, SEL = torch.tensor([0, 1, 8, 9]), torch.tensor([3, 5])


def test_route_kv_head_keeps_most_demanding():
    # group 0 = heads 0 (full), 1 (sparse); group 1 = heads 2, 3 (sparse)
    keep, qmask, scale = route(torch.tensor([FULL, SPARSE, SPARSE, SPARSE], dtype=torch.int8), 2, 10, TEXT, SEL)
    assert keep[0].tolist() == list(range(10))
    assert keep[1].tolist() == [0, 1, 3, 5, 8, 9]
    assert qmask is not None and qmask[0].all() and qmask[1].nonzero().squeeze(1).tolist() == [0, 1, 3, 5, 8, 9]
    assert qmask[2:].equal(qmask[1:2].expand(2, -1))
    assert scale is None
    # zero mode: sparse group keeps text + selection, all-dropped group keeps only the text
    keep, qmask, scale = route(torch.tensor([SPARSE, SPARSE, DROPPED, DROPPED], dtype=torch.int8), 2, 10, TEXT, SEL)
    assert keep[0].tolist() == [0, 1, 3, 5, 8, 9] and keep[1].tolist() == [0, 1, 8, 9]
    assert qmask is None and scale.tolist() == [1, 1, 0, 0]
    # text_only: a dropped head next to a full one sees the text positions only, nothing is scaled
    keep, qmask, scale = route(torch.tensor([DROPPED, FULL, SPARSE, DROPPED], dtype=torch.int8), 2, 10, TEXT, SEL,
                               drop_mode="text_only")
    assert keep[0].tolist() == list(range(10)) and keep[1].tolist() == [0, 1, 3, 5, 8, 9]
    assert qmask[0].nonzero().squeeze(1).tolist() == [0, 1, 8, 9] and qmask[3].equal(qmask[0])
    assert scale is None


def test_attended_pairs_hand_case():
    """m = 6, one KV head, two query heads; head 1 may see positions {0, 1, 4, 5}; rows >= 4 routed."""
    qmask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 1, 1]], dtype=torch.bool)
    sel = LayerSelection([torch.arange(6)], qmask, route_prefill=True)
    assert head_keys(sel, 6, 2).tolist() == [6, 4]
    # rows 0-3 dense: 2 heads x (1+2+3+4); row 4: 5 + 3, row 5: 6 + 4
    assert prefill_attended(sel, 6, 2, 4) == 20 + 8 + 10
    assert prefill_attended(None, 6, 2, 4) == 2 * 21
    zeroed = LayerSelection([torch.arange(6)], qmask, torch.tensor([1.0, 0.0]), route_prefill=True)
    assert head_keys(zeroed, 6, 2).tolist() == [6, 0] and prefill_attended(zeroed, 6, 2, 4) == 20 + 5 + 6


def test_text_only_prefill_rows_attend_text():
    """A text_only dropped head's routed prefill rows = attention over the text positions <= t."""
    torch.manual_seed(0)
    H, Hkv, m, D, start = 4, 2, 10, 8, 8
    q, k, v = torch.randn(1, H, m, D), torch.randn(1, Hkv, m, D), torch.randn(1, Hkv, m, D)
    roles = torch.tensor([DROPPED, FULL, SPARSE, DROPPED], dtype=torch.int8)
    keep, qmask, scale = route(roles, Hkv, m, TEXT, SEL, drop_mode="text_only")
    sel = LayerSelection(keep, qmask, scale, route_prefill=True)
    out = _route_prefill_rows(torch.zeros(1, m, H, D), q, k, v, D ** -0.5, sel, start)
    for h, g, allowed in ((0, 0, TEXT), (1, 0, torch.arange(m)), (2, 1, torch.tensor([0, 1, 3, 5, 8, 9]))):
        for t in range(start, m):
            a = allowed[allowed <= t]
            w = torch.softmax(q[0, h, t] @ k[0, g, a].T * D ** -0.5, 0)
            assert torch.allclose(out[0, t, h], w @ v[0, g, a], atol=1e-5)


# --- on the tiny model ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_loaded):
    """The shared tiny Qwen2-VL and a prompt with 64 visual tokens (8 random 112 x 112 frames)."""
    loaded = tiny_loaded("qwen2_vl")
    frames = np.random.default_rng(0).integers(0, 255, (8, 112, 112, 3), dtype=np.uint8)
    return loaded, loaded.adapter.build_inputs(frames, "what colour is the object ?")


def logits_along(loaded, inputs, tokens, policy=None):
    """Prefill + one step per token (dense cache, or compact caches only with a policy) -> logits [n+1, V]."""
    run = new_run(loaded, inputs, len(tokens) + 1, policy, store_dense=policy is None)
    out = [prefill(loaded, inputs, run)]
    for t in tokens:
        out.append(step(loaded, run, [t])[-1])
    return torch.stack(out), run


@pytest.mark.parametrize("policy", [
    HTSparse(heads_full=1.0, eta=1.0, layers="all"),
    HTSparse(heads_full=1, heads_sparse=3, eta=1.0, layers="all"),
    HTSparse(variant="token", eta=1.0, layers="all"),
])
def test_everything_kept_equals_dense_exactly(tiny, policy):
    loaded, inputs = tiny
    dense = decode(loaded, inputs, max_new_tokens=12)
    ht = decode(loaded, inputs, policy=policy, max_new_tokens=12)
    assert ht.token_ids == dense.token_ids
    ref, _ = logits_along(loaded, inputs, dense.token_ids[:-1])
    got, run = logits_along(loaded, inputs, dense.token_ids[:-1], policy)
    assert torch.equal(got, ref)
    assert len(run.selections) == loaded.num_layers
    assert all(isinstance(s, HTSelection) and not s.route_prefill for s in run.selections.values())


@pytest.mark.parametrize("gamma", [2, 5])
def test_draft_token_identical_to_dense(tiny, gamma):
    loaded, inputs = tiny
    s = Settings(gamma=gamma, heads_full=1, heads_sparse=1, eta=0.5)
    _check_draft(loaded, inputs, s)


@pytest.mark.parametrize("arch_name", ["qwen2_5_vl", "llava_onevision"])
def test_draft_token_identical_other_archs(tiny_loaded, video_inputs, arch_name):
    s = Settings(gamma=3, heads_full=1, heads_sparse=1, eta=0.5, ht_layers="all", drop_mode="text_only")
    _check_draft(tiny_loaded(arch_name), video_inputs(arch_name), s)


def _check_draft(loaded, inputs, s):
    dense = run_method(loaded, inputs, "dense", s, max_new_tokens=24)
    draft = run_method(loaded, inputs, "htsparse-draft", s, max_new_tokens=24)
    assert draft.token_ids == dense.token_ids
    assert draft.extra["proposed"] > 0
    assert any(sel.route_prefill for sel in draft.trace["selections"].values())


def test_kv_shrinks_and_figures(tiny):
    loaded, inputs = tiny
    m, L, H, Hkv = inputs.m, loaded.num_layers, loaded.num_heads, loaded.num_kv_heads
    s = Settings(heads_full=1, heads_sparse=1, eta=0.5, ht_by_group=False)
    res = compare(loaded, inputs, ["htsparse"], s, max_new_tokens=8)
    dense, ht = res["dense"], res["htsparse"]
    assert ht.kv_bytes < dense.kv_bytes
    t = ht.trace
    assert t["roles"].shape == (L, H) and t["saliency"].shape == (L, H) and t["kv_lengths"].shape == (L, Hkv)
    assert t["routed_layers"] == [1, 2] and t["saliency"][0].isnan().all()
    for layer in t["routed_layers"]:
        assert (t["roles"][layer] == FULL).sum() == 1 and (t["roles"][layer] == SPARSE).sum() == 1
        assert torch.allclose(t["saliency"][layer].sum(), torch.tensor(1.0))
        assert 0 < len(t["tokens"][layer]) < inputs.m_v
        assert t["kv_lengths"][layer].min() < m  # a group without a full head shrank
    e = ht.extra
    for k in ("peak_memory_pct", "prefill_kv_pct", "decode_kv_pct", "latency_pct", "prefill_flops_pct",
              "decode_flops_pct"):
        assert e[k] is not None and e[k] > 0, k
    assert e["prefill_kv_pct"] < 100 and e["decode_kv_pct"] < 100 and e["decode_flops_pct"] < 100
    assert e["prefill_kv_bytes"] == sum(sum(sel.lengths) for sel in t["selections"].values()) * 2 * loaded.head_dim * 4


def test_text_only_mode_runs(tiny):
    loaded, inputs = tiny
    pol = HTSparse(heads_full=1, heads_sparse=1, eta=0.5, drop_mode="text_only", layers="all", by_group=False)
    res = decode(loaded, inputs, policy=pol, max_new_tokens=8)
    text = torch.ones(inputs.m, dtype=torch.bool)
    text[inputs.visual_positions] = False
    for sel in res.trace["selections"].values():
        assert sel.head_scale is None
        dropped = (sel.roles == DROPPED).nonzero().squeeze(1)
        assert len(dropped) == 2
        if sel.query_mask is not None:  # a dropped head sharing its group with a full or sparse head
            assert sel.query_mask[dropped].eq(text).all()
    assert len(res.token_ids) == 8 and all(0 <= t < len(loaded.tokenizer) for t in res.token_ids)


def test_methods_registered():
    assert METHODS["htsparse"].kind == "direct" and not METHODS["htsparse"].lossless
    assert METHODS["htsparse-draft"].kind == "speculative" and METHODS["htsparse-draft"].lossless
    with pytest.raises(ValueError):
        HTSparse(variant="both")


def test_prefill_routing_matches_decode_routing(tiny):
    """The last prompt token routed inside prefill gives the same logits as the same token fed as a
    decode step over the compact cache (same selections): one routing, two code paths."""
    from sparsevid.adapters import VideoInputs

    loaded, inputs = tiny
    pol = HTSparse(heads_full=1, heads_sparse=2, eta=0.5, layers="all", by_group=False)
    full, run_a = logits_along(loaded, inputs, [], pol)
    assert all(s.route_prefill and s.head_scale is not None for s in run_a.selections.values())
    m1 = inputs.m - 1
    kw = dict(inputs.model_kwargs, input_ids=inputs.input_ids[:, :m1],
              mm_token_type_ids=inputs.model_kwargs["mm_token_type_ids"][:, :m1])
    short = VideoInputs(kw, inputs.visual_positions, inputs.token_grid, inputs.grid, inputs.frames)

    class Fixed:  # run A's selections, cut to the first m - 1 positions
        window = 0

        def select(self, layer, stats, run):
            s = run_a.selections[layer]
            return LayerSelection([k[k < m1] for k in s.keep], None if s.query_mask is None else s.query_mask[:, :m1],
                                  s.head_scale, route_prefill=True)

    run_b = new_run(loaded, short, 2, Fixed(), store_dense=False)
    prefill(loaded, short, run_b)
    last = step(loaded, run_b, [int(inputs.input_ids[0, -1])])[-1]
    assert torch.allclose(last, full[0], atol=1e-4), (last - full[0]).abs().max()


def test_low_rank_keys_are_the_best_rank_r_approximation():
    from sparsevid.cache import low_rank_keys

    keys = torch.randn(1, 2, 40, 16, dtype=torch.float64)
    for r in (1, 4, 16):
        lr = low_rank_keys(keys, r)
        for g in range(2):
            assert torch.linalg.matrix_rank(lr[0, g]) == r
            s = torch.linalg.svdvals(keys[0, g])
            # Eckart–Young: the residual's Frobenius norm is the norm of the dropped singular values
            assert torch.allclose((keys[0, g] - lr[0, g]).norm(), s[r:].norm(), atol=1e-9)
    assert torch.allclose(low_rank_keys(keys, 16), keys, atol=1e-9)


def test_low_rank_scoring_full_rank_matches_and_low_rank_costs_less(tiny):
    loaded, inputs = tiny
    D = loaded.head_dim
    base = HTSparse(heads_full=1, heads_sparse=1, eta=0.5, by_group=False)
    ref, _ = logits_along(loaded, inputs, [5, 9, 11], base)
    full, run = logits_along(loaded, inputs, [5, 9, 11], HTSparse(heads_full=1, heads_sparse=1, eta=0.5, low_rank=D, by_group=False))
    assert [l for l, s in run.selections.items() if s.low_rank == D] == [1, 2]  # the routed layers
    assert torch.allclose(full, ref, atol=1e-4)
    low, _ = logits_along(loaded, inputs, [5, 9, 11], HTSparse(heads_full=1, heads_sparse=1, eta=0.5, low_rank=2, by_group=False))
    assert not torch.allclose(low, ref, atol=1e-4)  # rank 2 of 32 really changes the scores
    s_full = Settings(heads_full=1, heads_sparse=1, eta=0.5, ht_by_group=False)
    s_low = Settings(heads_full=1, heads_sparse=1, eta=0.5, low_rank=D // 4, ht_by_group=False)
    a = compare(loaded, inputs, ["htsparse"], s_full, max_new_tokens=4)["htsparse"].extra
    b = compare(loaded, inputs, ["htsparse"], s_low, max_new_tokens=4)["htsparse"].extra
    assert b["decode_flops_pct"] < a["decode_flops_pct"]
    assert b["decode_kv_pct"] == a["decode_kv_pct"]  # keys are still stored at full width


def test_cli_run_json_reports_htsparse_figures(tiny_model_dir, frames, tmp_path, capsys):
    import json

    from sparsevid.cli import main
    from sparsevid.video import write_video

    path = str(tmp_path / "clip.mp4")
    write_video(path, frames, fps=4)
    rc = main(["run", path, "What colour is the object?", "--model", tiny_model_dir("qwen2_vl"), "--frames", "8",
               "--methods", "dense,htsparse", "--max-new-tokens", "6", "--heads-full", "1", "--heads-sparse", "1",
               "--ht-variant", "ht", "--ht-layers", "all", "--eta", "0.5", "--low-rank", "8", "--json", "--quiet"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    ht = out["methods"]["htsparse"]
    for k in ("decode_kv_pct", "prefill_kv_pct", "latency_pct", "prefill_flops_pct", "decode_flops_pct",
              "peak_memory_pct", "kv_ratio", "speedup"):
        assert isinstance(ht[k], (int, float)), k
    assert ht["decode_kv_pct"] < 100 and ht["kv_ratio"] < 1


def test_default_partitions_whole_groups_so_kv_shrinks(tiny):
    """Default (by_group): with h_f = 25 % one whole GQA group is full and the other sparse, so in
    every routed layer one KV head keeps only text + selected tokens."""
    loaded, inputs = tiny
    res = compare(loaded, inputs, ["htsparse"], Settings(), max_new_tokens=4)["htsparse"]
    G = loaded.num_heads // loaded.num_kv_heads
    for layer in res.trace["routed_layers"]:
        roles = res.trace["roles"][layer].view(loaded.num_kv_heads, G)
        assert all(len(set(r.tolist())) == 1 for r in roles)  # one role per group
        lengths = res.trace["kv_lengths"][layer]
        assert lengths.max() == inputs.m and lengths.min() < inputs.m
