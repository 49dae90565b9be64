"""HT-Sparse (SPEC §3.2): pure functions on hand-computed cases, the routed prefill against a float64
reference, exactness when nothing is dropped, losslessness as a draft, KV and FLOPs savings."""

import json
import math

import numpy as np
import pytest
import torch

from sparsevid import attention, methods
from sparsevid.adapters import VideoInputs
from sparsevid.cache import LayerSelection
from sparsevid.engine import Sampling, decode, new_run, prefill, step
from sparsevid.errors import InputError
from sparsevid.methods.htsparse import (DROPPED, FULL, SPARSE, HTSparse, coverage_count, low_rank_keys, partition,
                                        route, routed_layers, saliency, select_tokens)
from sparsevid.metrics import efficiency, head_keys, prefill_attended
from sparsevid.routing import masked_reference, routed_attention
from sparsevid.runs import compare, run_method
from sparsevid.traces import LayerRecord, ModelShape

GREEDY = Sampling(ignore_eos=True)  # exactly max_new_tokens tokens, however early the model would stop

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
    assert list(routed_layers("all", 28)) == list(range(28))
    assert [list(routed_layers(s, 4)) for s in ("early", "mid", "late", "mid+late")] == [[0], [1, 2], [3], [1, 2, 3]]
    assert [list(routed_layers(s, 3)) for s in ("early", "mid", "late")] == [[0], [1], [2]]
    with pytest.raises((KeyError, ValueError)):
        routed_layers("middle", 4)
    # an unknown strategy or variant typed by a user is refused before any run
    for key, bad in (("ht_layers", "middle"), ("ht_variant", "both"), ("drop_mode", "half")):
        with pytest.raises(InputError):
            methods.configure("htsparse", {key: bad})


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


# m = 6, one KV head, two query heads; head 1 may see positions {0, 1, 4, 5}
QMASK = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 1, 1]], dtype=bool)


def test_attended_pairs_hand_case():
    rec = LayerRecord([np.arange(6, dtype=np.int32)], QMASK)
    assert head_keys(rec, 6, 2).tolist() == [6, 4]
    assert head_keys(None, 6, 2).tolist() == [6, 6]
    # head 0: rows see 1..6 keys (21); head 1: rows 0-5 see 1, 2, 2, 2, 3, 4 keys (14)
    assert prefill_attended(rec, 6, 2, routed=True) == 21 + 14
    assert prefill_attended(None, 6, 2, routed=True) == 2 * 21
    assert prefill_attended(rec, 6, 2, routed=False) == 2 * 21  # not routed: dense
    zeroed = LayerRecord([np.arange(6, dtype=np.int32)], QMASK, np.array([1.0, 0.0]))
    assert head_keys(zeroed, 6, 2).tolist() == [6, 0] and prefill_attended(zeroed, 6, 2, routed=True) == 21


def test_flops_and_kv_hand_count():
    """One layer, H = 2, Hkv = 1, D = 4, d = 8, I = 16, V = 10, m = 6, query tokens from 4, the
    record above: every term of `efficiency`'s FLOPs and KV bytes counted by hand."""
    shape = ModelShape(L=1, H=2, Hkv=1, D=4, d=8, I=16, V=10, bytes=4)
    rec = {0: LayerRecord([np.arange(6, dtype=np.int32)], QMASK)}
    lm_head = 2 * 8 * 10
    per_row = 8 * 2 * 4 + 2 * 8 * 1 * 4 + 2 * 4 * 8 + 3 * 8 * 16  # q, k + v, o, MLP (3 matrices)
    proj = 2 * 6 * per_row
    relevance = 2 * 4 * 2 * (6 - 4) * 6  # query rows 4, 5 x 6 keys, 2 heads
    routed = efficiency(rec, shape, 6, 4, 1, routed_prefill=True)
    assert routed["prefill_flops"] == lm_head + proj + 4 * 4 * 35 + relevance
    assert efficiency(rec, shape, 6, 4, 1)["prefill_flops"] == lm_head + proj + 4 * 4 * 42 + relevance
    dense = efficiency({}, shape, 6, 4, 1)
    assert dense["prefill_flops"] == lm_head + proj + 4 * 4 * 42
    # one decode step (mean generated length (1 + 1) / 2 = 1): heads read 6 + 4 prompt keys, 2 active heads
    assert routed["decode_flops"] == lm_head + 2 * per_row + (2 * 4 + 2 * 4) * 10 + 4 * 4 * 2 * 1
    assert dense["decode_flops"] == lm_head + 2 * per_row + (2 * 4 + 2 * 4) * 12 + 4 * 4 * 2 * 1
    # a dropped head costs nothing at decode
    zeroed = {0: LayerRecord([np.arange(6, dtype=np.int32)], QMASK, np.array([1.0, 0.0]))}
    assert efficiency(zeroed, shape, 6, 4, 1)["decode_flops"] == lm_head + 2 * per_row + 16 * 6 + 4 * 4 * 1 * 1
    # low rank r = 2: 2·D + 2·r per prompt pair at decode; the prefill pays the SVD and the projection
    low = efficiency(rec, shape, 6, 4, 1, routed_prefill=True, low_rank=2)
    assert low["decode_flops"] == lm_head + 2 * per_row + (2 * 4 + 2 * 2) * 10 + 4 * 4 * 2 * 1
    assert low["prefill_flops"] == routed["prefill_flops"] + 1 * (4 * 6 * 4 * 4 + 4 * 6 * 4 * 2)
    # KV: 2 (K, V) x D x 4 bytes per entry; 6 prompt entries kept, + 1 generated on average
    assert routed["prefill_kv_bytes"] == dense["prefill_kv_bytes"] == 6 * 2 * 4 * 4
    assert routed["decode_kv_bytes"] == (6 + 1) * 2 * 4 * 4
    half = {0: LayerRecord([np.array([0, 1, 4, 5], dtype=np.int32)])}
    assert efficiency(half, shape, 6, 4, 1)["prefill_kv_bytes"] == 4 * 2 * 4 * 4


def _allowed(keep, qmask, H, m):
    G = H // len(keep)
    allowed = torch.zeros(H, m, dtype=torch.bool)
    for h in range(H):
        allowed[h, keep[h // G]] = True
    return allowed if qmask is None else allowed & qmask


def test_routed_attention_every_head_full_is_dense_bitwise():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 8, 50, 16), torch.randn(1, 4, 50, 16), torch.randn(1, 4, 50, 16)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
    assert torch.equal(routed_attention(q, k, v, 0.3, [torch.arange(50)] * 4), dense.transpose(1, 2))


def test_routed_attention_matches_hand_softmax():
    """Roles from `route` (text_only, a mixed group): row t of head h = softmax over its positions <= t,
    written out row by row; a group whose first kept position is 3 gives rows 0-2 zero."""
    torch.manual_seed(0)
    H, Hkv, m, D = 4, 2, 10, 8
    q, k, v = torch.randn(1, H, m, D), torch.randn(1, Hkv, m, D), torch.randn(1, Hkv, m, D)
    roles = torch.tensor([DROPPED, FULL, SPARSE, DROPPED], dtype=torch.int8)
    keep, qmask, scale = route(roles, Hkv, m, TEXT, SEL, drop_mode="text_only")
    out = routed_attention(q, k, v, D ** -0.5, keep, qmask, scale)
    for h, g, allowed in ((0, 0, TEXT), (1, 0, torch.arange(m)), (2, 1, torch.tensor([0, 1, 3, 5, 8, 9])),
                          (3, 1, TEXT)):
        for t in range(m):
            a = allowed[allowed <= t]
            w = torch.softmax(q[0, h, t] @ k[0, g, a].T * D ** -0.5, 0)
            assert torch.allclose(out[0, t, h], w @ v[0, g, a], atol=1e-5)
    late = routed_attention(q, k, v, D ** -0.5, [torch.arange(m), torch.tensor([3, 6, 9])])
    assert late[0, :3, 2:].eq(0).all() and late[0, 3:, 2:].ne(0).any()


def test_routed_attention_over_several_row_blocks_matches_the_reference():
    """Kept rows (causal over the gathered keys) and unselected rows (masked, several ROW_BLOCKs of
    them) of a sparse group both equal the float64 mask over all keys; rows before its first kept
    position stay 0."""
    from sparsevid.routing import ROW_BLOCK

    torch.manual_seed(1)
    H, Hkv, m, D = 4, 2, 3 * ROW_BLOCK + 37, 8
    q, k, v = torch.randn(1, H, m, D), torch.randn(1, Hkv, m, D), torch.randn(1, Hkv, m, D)
    sel = (torch.randperm(m - 7)[: m // 3] + 7).sort().values  # a third of the positions, none before 7
    keep = [torch.arange(m), sel]
    out = routed_attention(q, k, v, D ** -0.5, keep)
    ref = masked_reference(q, k, v, D ** -0.5, keep)
    assert torch.allclose(out.double(), ref, atol=1e-5)
    assert out[0, : int(sel[0]), 2:].eq(0).all()


def test_routed_attention_of_groups_that_are_not_neighbours_matches_the_reference():
    """Two sparse groups with the same positions around a full one (query heads 0-1 and 4-5 read the
    same subset): they are computed as two runs of heads, and every row of every head equals the
    float64 reference, in the layout transformers gives (positions major, heads a stride)."""
    from sparsevid.routing import ROW_BLOCK

    torch.manual_seed(2)
    H, Hkv, m, D = 6, 3, ROW_BLOCK + 61, 8
    q = torch.randn(1, m, H, D).transpose(1, 2)  # [1, H, m, D] with the strides of a projection's output
    k, v = torch.randn(1, m, Hkv, D).transpose(1, 2), torch.randn(1, m, Hkv, D).transpose(1, 2)
    sel = torch.cat([torch.arange(5), (torch.randperm(m - 5)[: m // 2] + 5).sort().values])
    keep = [sel, torch.arange(m), sel]
    out = routed_attention(q, k, v, D ** -0.5, keep)
    assert torch.allclose(out.double(), masked_reference(q, k, v, D ** -0.5, keep), atol=1e-5)


# --- on the tiny model ----------------------------------------------------------------------------


class Spy:
    """Records each call of the real `routed_attention` made by the attention hook."""

    def __init__(self):
        self.calls = []

    def __call__(self, query, key, value, scale, keep, query_mask=None, head_scale=None):
        out = routed_attention(query, key, value, scale, keep, query_mask, head_scale)
        self.calls.append((query, key, value, scale, keep, query_mask, head_scale, out))
        return out


@pytest.fixture
def spy(monkeypatch):
    s = Spy()
    monkeypatch.setattr(attention, "routed_attention", s)
    return s


@pytest.mark.parametrize("by_group", [True, False])
def test_routed_prefill_matches_float64_reference(tiny_loaded, video_inputs, arch, spy, by_group):
    """Each architecture: every routed layer's whole prefill attention equals the explicit float64
    masked computation, with whole-group roles (one full, one sparse group) and per-head roles
    (full, sparse and dropped heads in mixed groups); dropped heads output exactly 0."""
    loaded, inputs = tiny_loaded(arch), video_inputs(arch)
    m = inputs.m
    pol = HTSparse(heads_full=1, heads_sparse=1 if by_group else 2, eta=0.5, layers="all", by_group=by_group)
    res = decode(loaded, inputs, policy=pol, max_new_tokens=3)
    assert len(spy.calls) == loaded.num_layers and sorted(res.layers) == list(range(loaded.num_layers))
    for layer, (q, k, v, scale, keep, qmask, hs, out) in enumerate(spy.calls):
        assert q.shape[2] == m and out.shape == (1, m, loaded.num_heads, loaded.head_dim)
        ref = masked_reference(q, k, v, scale, keep, qmask, hs)
        assert torch.allclose(out.double(), ref, atol=1e-5), (arch, layer, (out.double() - ref).abs().max())
        roles = torch.as_tensor(res.layers[layer].info["roles"])
        dropped = (roles == DROPPED).nonzero().squeeze(1)
        assert len(dropped) == (0 if by_group else 1) and out[0, :, dropped].eq(0).all()
        allowed = _allowed(keep, qmask, loaded.num_heads, m)
        assert allowed[roles == SPARSE].sum(1).lt(m).all()  # sparse heads really see fewer keys
        assert allowed[roles == FULL].all()


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


class RoutedAlways(HTSparse):
    """The real HT-Sparse selection, with its keys copied: the prefill is routed even when the
    selection keeps everything (the hook routes whenever the kept keys are not the layer's own)."""

    def score_keys(self, layer, key):
        return key.clone()


def test_routed_prefill_every_head_full_equals_dense_bitwise(tiny, spy):
    """A routed prefill that keeps every head full and every token (η = 1) gives dense's logits
    bit for bit, prefill and decode steps."""
    loaded, inputs = tiny
    dense = decode(loaded, inputs, max_new_tokens=6, sampling=GREEDY)
    ref, _ = logits_along(loaded, inputs, dense.token_ids[:-1])
    assert spy.calls == []
    got, run = logits_along(loaded, inputs, dense.token_ids[:-1], RoutedAlways(heads_full=1.0, eta=1.0, layers="all"))
    assert len(spy.calls) == loaded.num_layers  # every layer's prefill went through the routed path
    assert all((s.info["roles"] == FULL).all() and s.lengths == [inputs.m] * loaded.num_kv_heads
               for s in run.selections.values())
    assert torch.equal(got, ref)


@pytest.mark.parametrize("policy", [
    HTSparse(heads_full=1.0, eta=1.0, layers="all"),
    HTSparse(heads_full=1, heads_sparse=3, eta=1.0, layers="all"),
    HTSparse(variant="token", eta=1.0, layers="all"),
], ids=["all-full", "full+sparse-eta1", "token-eta1"])
def test_everything_kept_equals_dense_exactly(tiny, spy, policy):
    loaded, inputs = tiny
    dense = decode(loaded, inputs, max_new_tokens=12, sampling=GREEDY)
    ht = decode(loaded, inputs, policy=policy, max_new_tokens=12, sampling=GREEDY)
    assert ht.token_ids == dense.token_ids
    ref, _ = logits_along(loaded, inputs, dense.token_ids[:-1])
    got, run = logits_along(loaded, inputs, dense.token_ids[:-1], policy)
    assert torch.equal(got, ref)
    assert len(run.selections) == loaded.num_layers
    assert all(s.query_mask is None and s.head_scale is None and s.lengths == [inputs.m] * loaded.num_kv_heads
               for s in run.selections.values())
    assert spy.calls == []  # nothing restricted: the prefill stays dense


@pytest.mark.parametrize("gamma", [2, 5])
def test_draft_token_identical_to_dense(tiny, spy, gamma):
    loaded, inputs = tiny
    _check_draft(loaded, inputs, {"gamma": str(gamma), "heads_full": "1", "heads_sparse": "1", "eta": "0.5"}, spy)


@pytest.mark.parametrize("arch_name", ["qwen2_5_vl", "llava_onevision"])
def test_draft_token_identical_other_archs(tiny_loaded, video_inputs, spy, arch_name):
    s = {"gamma": "3", "heads_full": "1", "heads_sparse": "1", "eta": "0.5", "ht_layers": "all",
         "drop_mode": "text_only"}
    _check_draft(tiny_loaded(arch_name), video_inputs(arch_name), s, spy)


def _check_draft(loaded, inputs, s, spy):
    dense = run_method(loaded, inputs, "dense", s, max_new_tokens=24, sampling=GREEDY)
    draft = run_method(loaded, inputs, "htsparse-draft", s, max_new_tokens=24, sampling=GREEDY)
    assert draft.token_ids == dense.token_ids and len(draft.token_ids) == 24
    assert sum(len(r.proposed) for r in draft.rounds) > 0
    assert any(n < inputs.m for rec in draft.layers.values() for n in rec.lengths)  # the draft is sparse
    assert draft.draft_entries < inputs.m
    assert spy.calls == []  # as a draft the prefill stays dense (it gives the first token)


def test_kv_shrinks_and_figures(tiny):
    loaded, inputs = tiny
    m, L, H, Hkv, D = inputs.m, loaded.num_layers, loaded.num_heads, loaded.num_kv_heads, loaded.head_dim
    s = {"heads_full": "1", "heads_sparse": "1", "eta": "0.5", "ht_by_group": False, "ht_layers": "mid+late"}
    traces, figs = compare(loaded, inputs, ["htsparse"], s, max_new_tokens=8, sampling=GREEDY)
    dense, ht, e = traces["dense"], traces["htsparse"], figs["htsparse"]
    assert ht.kv_bytes < dense.kv_bytes
    entry = 2 * D * 4  # K and V, float32
    assert dense.kv_bytes == L * Hkv * (m + dense.decode_tokens) * entry
    assert sorted(ht.layers) == [1, 2]  # L = 3: mid+late; layer 0 keeps everything and records nothing
    for layer, rec in ht.layers.items():
        roles, pi, tokens = rec.info["roles"], rec.info["saliency"], rec.info["tokens"]
        assert roles.shape == (H,) and pi.shape == (H,)
        assert (roles == FULL).sum() == 1 and (roles == SPARSE).sum() == 1
        assert np.isclose(pi.sum(), 1.0)
        assert 0 < len(tokens) < inputs.m_v and np.isin(tokens, inputs.visual_positions.numpy()).all()
        assert min(rec.lengths) < m  # a group without a full head shrank
    # KV held: the kept prompt entries of routed layers, layer 0 whole, the generated tokens everywhere
    kept = sum(sum(rec.lengths) for rec in ht.layers.values()) + Hkv * m * (L - len(ht.layers))
    assert ht.kv_bytes == (kept + L * Hkv * ht.decode_tokens) * entry
    for k in ("peak_memory_pct", "prefill_kv_pct", "decode_kv_pct", "latency_pct", "prefill_flops_pct",
              "decode_flops_pct", "prefill_wall_pct"):
        assert e[k] is not None and e[k] > 0, k
    assert e["prefill_kv_pct"] < 100 and e["decode_kv_pct"] < 100 and e["decode_flops_pct"] < 100
    assert e["prefill_flops_pct"] < 100  # routed prefill: fewer attended pairs outweigh the relevance scores
    assert math.isclose(e["prefill_kv_pct"], 100 * kept / (L * Hkv * m))


def test_text_only_mode_runs(tiny):
    loaded, inputs = tiny
    pol = HTSparse(heads_full=1, heads_sparse=1, eta=0.5, drop_mode="text_only", layers="all", by_group=False)
    res = decode(loaded, inputs, policy=pol, max_new_tokens=8)
    text = np.ones(inputs.m, dtype=bool)
    text[inputs.visual_positions.numpy()] = False
    assert len(res.layers) == loaded.num_layers
    for rec in res.layers.values():
        assert rec.head_scale is None
        dropped = np.flatnonzero(rec.info["roles"] == DROPPED)
        assert len(dropped) == 2
        if rec.query_mask is not None:  # a dropped head sharing its group with a full or sparse head
            assert (rec.query_mask[dropped] == text).all()
    assert 0 < len(res.token_ids) <= 8 and all(0 <= t < len(loaded.tokenizer) for t in res.token_ids)


def test_prefill_routing_matches_decode_routing(tiny, spy):
    """The last prompt token routed inside prefill gives the same logits as the same token fed as a
    decode step over the compact cache (same selections): one routing, two code paths."""
    loaded, inputs = tiny
    pol = HTSparse(heads_full=1, heads_sparse=2, eta=0.5, layers="all", by_group=False)
    full, run_a = logits_along(loaded, inputs, [], pol)
    assert len(spy.calls) == loaded.num_layers
    assert all(s.head_scale is not None for s in run_a.selections.values())  # zero mode: a dropped head
    m1 = inputs.m - 1
    kw = dict(inputs.model_kwargs, input_ids=inputs.input_ids[:, :m1],
              mm_token_type_ids=inputs.model_kwargs["mm_token_type_ids"][:, :m1])
    short = VideoInputs(kw, inputs.visual_positions, inputs.token_grid, inputs.grid, inputs.frames)

    class Fixed:  # run A's selections, cut to the first m - 1 positions
        stats = ()
        window = 0
        route_prefill = True

        def select(self, layer, stats, prompt):
            s = run_a.selections[layer]
            return LayerSelection([k[k < m1] for k in s.keep], None if s.query_mask is None else s.query_mask[:, :m1],
                                  s.head_scale)

    run_b = new_run(loaded, short, 2, Fixed(), store_dense=False)
    prefill(loaded, short, run_b)
    last = step(loaded, run_b, [int(inputs.input_ids[0, -1])])[-1]
    assert torch.allclose(last, full[0], atol=1e-4), (last - full[0]).abs().max()


def test_low_rank_keys_are_the_best_rank_r_approximation():
    keys = torch.randn(1, 2, 40, 16, dtype=torch.float64)
    for r in (1, 4, 16):
        lr = low_rank_keys(keys, r)
        assert lr.shape == keys.shape and lr.dtype == keys.dtype
        for g in range(2):
            assert torch.linalg.matrix_rank(lr[0, g]) == r
            s = torch.linalg.svdvals(keys[0, g])
            # Eckart–Young: the residual's Frobenius norm is the norm of the dropped singular values
            assert torch.allclose((keys[0, g] - lr[0, g]).norm(), s[r:].norm(), atol=1e-9)
    assert torch.allclose(low_rank_keys(keys, 16), keys, atol=1e-9)


def test_low_rank_scoring_full_rank_matches_and_low_rank_costs_less(tiny, spy):
    loaded, inputs = tiny
    D, L = loaded.head_dim, loaded.num_layers
    kw = dict(heads_full=1, heads_sparse=1, eta=0.5, by_group=False, layers="all")
    ref, _ = logits_along(loaded, inputs, [5, 9, 11], HTSparse(**kw))
    spy.calls.clear()
    full, run = logits_along(loaded, inputs, [5, 9, 11], HTSparse(low_rank=D, **kw))
    assert sorted(run.selections) == list(range(L)) and len(spy.calls) == L
    assert torch.allclose(full, ref, atol=1e-4)  # rank D: the keys themselves, up to rounding
    spy.calls.clear()
    low, _ = logits_along(loaded, inputs, [5, 9, 11], HTSparse(low_rank=2, **kw))
    assert not torch.allclose(low, ref, atol=1e-4)  # rank 2 of D really changes the scores
    # the routed prefill attends the rank-2 keys
    assert len(spy.calls) == L and all(torch.linalg.matrix_rank(c[1][0, g]) <= 2 for c in spy.calls
                                       for g in range(loaded.num_kv_heads))
    # one routed layer (the last): low-rank keys there cannot change any layer's selection
    s_full = {"heads_full": "1", "heads_sparse": "1", "eta": "0.5", "ht_by_group": False, "ht_layers": "late"}
    s_low = dict(s_full, low_rank=D // 4)
    _, fa = compare(loaded, inputs, ["htsparse"], s_full, max_new_tokens=4, sampling=GREEDY, warmup=False)
    _, fb = compare(loaded, inputs, ["htsparse"], s_low, max_new_tokens=4, sampling=GREEDY, warmup=False)
    a, b = fa["htsparse"], fb["htsparse"]
    assert b["decode_flops_pct"] < a["decode_flops_pct"]
    assert b["decode_kv_pct"] == a["decode_kv_pct"]  # keys are still stored at full width


def test_cli_run_json_reports_htsparse_figures(tiny_model_dir, frames, tmp_path, capsys):
    from sparsevid.cli import main
    from sparsevid.video import write_video

    path = str(tmp_path / "clip.mp4")
    write_video(path, frames, fps=4)
    rc = main(["run", path, "What colour is the object?", "--model", tiny_model_dir("qwen2_vl"), "--frames", "8",
               "--methods", "dense,htsparse", "--max-new-tokens", "6", "--heads-full", "1", "--heads-sparse", "1",
               "--ht-variant", "ht", "--ht-layers", "all", "--no-ht-by-group", "--eta", "0.5", "--low-rank", "8",
               "--json", "--quiet"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    ht = out["methods"]["htsparse"]
    for k in ("decode_kv_pct", "prefill_kv_pct", "latency_pct", "prefill_flops_pct", "decode_flops_pct",
              "peak_memory_pct", "prefill_wall_pct", "kv_ratio", "e2e_speedup"):
        assert isinstance(ht[k], (int, float)) and not isinstance(ht[k], bool), k
    assert ht["decode_kv_pct"] < 100 and ht["kv_ratio"] < 1
    # the flags reached the policy
    c = ht["config"]
    assert (c["heads_full"], c["heads_sparse"], c["eta"], c["layers"], c["by_group"], c["low_rank"]) == \
        (1, 1, 0.5, "all", False, 8)
    assert c["route_prefill"] is True and ht["kind"] == "direct"


def test_default_partitions_whole_groups_so_kv_shrinks(tiny):
    """Default (by_group): with h_f = 25 % one whole GQA group is full and the other sparse, so in
    every routed layer one KV head keeps only text + selected tokens."""
    loaded, inputs = tiny
    traces, _ = compare(loaded, inputs, ["htsparse"], {}, max_new_tokens=4, sampling=GREEDY, warmup=False)
    res = traces["htsparse"]
    G = loaded.num_heads // loaded.num_kv_heads
    assert sorted(res.layers) == list(range(loaded.num_layers))  # default: every layer routed
    for rec in res.layers.values():
        roles = rec.info["roles"].reshape(loaded.num_kv_heads, G)
        assert all(len(set(r.tolist())) == 1 for r in roles)  # one role per group
        assert max(rec.lengths) == inputs.m and min(rec.lengths) < inputs.m
