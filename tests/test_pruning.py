"""HT-Sparse `prune_after` (FastV-style pruning of the unselected visual rows from later layers'
prefill): identity when nothing is pruned, an explicit float64 reference, the FLOPs count, and a
model left as it was."""

import numpy as np
import pytest
import torch

from sparsevid.attention import _ACTIVE
from sparsevid.cache import LayerSelection
from sparsevid.engine import decode, new_run, prefill, step
from sparsevid.methods.htsparse import HTSparse
from sparsevid.metrics import efficiency, prefill_attended
from sparsevid.models import load_model
from sparsevid.runs import run_method
from sparsevid.traces import LayerRecord, ModelShape

N_NEW = 6


def greedy(loaded, inputs, policy, n=N_NEW):
    """A direct run by hand (as `engine.decode`): tokens, the logits of each step, the run."""
    run = new_run(loaded, inputs, n + 1, policy, store_dense=policy is None)
    logits = [prefill(loaded, inputs, run)]
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < n:
        logits.append(step(loaded, run, tokens[-1:])[-1])
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits), run


class Replay:
    """A policy that replays a run's recorded selections (prompt positions), with no pruning:
    a layer whose record keeps only some rows reads only those, so the pruned rows' states in
    that layer are computed but never read, which is what pruning them must be equivalent to."""

    stats = ()
    window = 0
    route_prefill = True

    def __init__(self, records: dict[int, LayerRecord]):
        self.records = records

    def selects(self, layer, prompt):
        return layer in self.records

    def select(self, layer, stats, prompt):
        r = self.records[layer]
        t = torch.as_tensor
        return LayerSelection([t(k, dtype=torch.long) for k in r.kept],
                              None if r.query_mask is None else t(r.query_mask),
                              None if r.head_scale is None else t(r.head_scale))


@pytest.mark.parametrize("arch", ["qwen2_vl", "llava_onevision"])
def test_pruning_that_keeps_everything_is_bit_exact(model_inputs, arch):
    loaded, inputs = model_inputs(arch)
    base_tokens, base_logits, _ = greedy(loaded, inputs, HTSparse(eta=1.0))
    tokens, logits, run = greedy(loaded, inputs, HTSparse(eta=1.0, prune_after=0))
    assert sorted(run.rows) == list(range(1, loaded.num_layers))  # every later layer went through the hook
    assert all(torch.equal(r.cpu(), torch.arange(inputs.m)) for r in run.rows.values())
    assert tokens == base_tokens
    assert torch.equal(logits, base_logits)


@pytest.fixture(scope="module")
def tiny64(tiny_model_dir):
    """tiny64(arch) -> the tiny model in float64 (the reference's precision)."""
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = load_model(tiny_model_dir(arch), device="cpu", dtype=torch.float64)
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "llava_onevision"])
def test_pruned_run_matches_float64_reference(tiny64, video_inputs, arch):
    """The pruned run (later layers on m_t + k rows, pruned coordinates, sliced rotary embeddings)
    equals the unpruned model in float64 at every prompt position, with each layer replaying the
    pruned run's selections mapped back to prompt positions: same tokens, same logits."""
    loaded, inputs = tiny64(arch), video_inputs(arch)
    policy = HTSparse(eta=0.5, prune_after=0)
    tokens, logits, run = greedy(loaded, inputs, policy)
    trace = decode(loaded, inputs, policy=policy, max_new_tokens=N_NEW, sampling=_ignore_eos())
    rows = trace.layers[1].rows
    assert rows is not None and len(rows) < inputs.m  # something was pruned
    tokens_vis = set(trace.layers[0].info["tokens"].tolist())
    vis = set(inputs.visual_positions.tolist())
    assert set(rows.tolist()) == (set(range(inputs.m)) - vis) | tokens_vis
    for layer in range(1, loaded.num_layers):  # records in prompt positions, within the processed rows
        rec = trace.layers[layer]
        assert np.array_equal(rec.rows, rows)
        assert all(set(k.tolist()) <= set(rows.tolist()) for k in rec.kept)
    ref_tokens, ref_logits, ref_run = greedy(loaded, inputs, Replay(trace.layers))
    assert not ref_run.rows  # the reference prunes nothing
    assert trace.token_ids[:len(tokens)] == tokens
    assert ref_tokens == tokens
    torch.testing.assert_close(logits, ref_logits, rtol=1e-9, atol=1e-9)


def test_pruned_run_matches_reference_embedded(model_inputs):
    loaded, inputs = model_inputs("embedded")
    policy = HTSparse(prune_after=0)
    tokens, logits, run = greedy(loaded, inputs, policy)
    assert 1 in run.rows and run.rows[1].numel() < inputs.m
    trace = decode(loaded, inputs, policy=policy, max_new_tokens=N_NEW, sampling=_ignore_eos())
    ref_tokens, ref_logits, _ = greedy(loaded, inputs, Replay(trace.layers))
    assert ref_tokens == tokens
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)


def _ignore_eos():
    from sparsevid.engine import Sampling

    return Sampling(ignore_eos=True)


def test_pruned_flops_hand_count():
    s = ModelShape(L=1, H=1, Hkv=1, D=2, d=4, I=8, V=10, bytes=4)
    m, query_start = 4, 3
    rec = LayerRecord([np.array([0, 3], dtype=np.int32)], rows=np.array([0, 2, 3], dtype=np.int32))
    # allowed positions <= t: rows 0, 2, 3 read 1, 1, 2 keys
    assert prefill_attended(rec, m, 1, routed=True) == 4
    assert prefill_attended(rec, m, 1, routed=False) == 6  # 3 rows, causal among themselves
    eff = efficiency({0: rec}, s, m, query_start, n_steps=1, routed_prefill=True)
    lm_head = 2 * 4 * 10
    proj_mlp = 3 * 2 * (4 * 2 + 2 * 4 * 2 + 2 * 4 + 3 * 4 * 8)  # 3 processed rows
    attention = 4 * 2 * 4  # 4 (query, key) pairs
    scores = 2 * 2 * 1 * (m - query_start) * 3  # the query row scores the layer's 3 keys
    assert eff["prefill_flops"] == lm_head + proj_mlp + attention + scores
    assert eff["prefill_kv_bytes"] == 2 * (2 * 2 * 4)  # what is stored: 2 entries
    unpruned = efficiency({0: LayerRecord(rec.kept)}, s, m, query_start, n_steps=1, routed_prefill=True)
    assert unpruned["prefill_flops"] == lm_head + 4 * proj_mlp // 3 + 4 * 2 * (1 + 1 + 1 + 2) + 2 * 2 * 1 * 4


def test_model_unchanged_and_draft_never_prunes(model_inputs):
    loaded, inputs = model_inputs("qwen2_vl")
    before = run_method(loaded, inputs, "dense", {}, 8)
    pruned = run_method(loaded, inputs, "htsparse", {"ht_prune_after": 0, "eta": 0.5}, 8)
    assert pruned.layers[1].rows is not None
    assert _ACTIVE.get() is None
    after = run_method(loaded, inputs, "dense", {}, 8)
    assert after.token_ids == before.token_ids
    with torch.inference_mode():  # the hooks do nothing outside a pruning prefill
        out = loaded.model(**inputs.model_kwargs)
    assert out.logits.shape[1] == inputs.m
    hooks = [len(layer._forward_pre_hooks) for layer in loaded.model.model.language_model.layers]
    load_model(loaded.model.config._name_or_path, device="cpu", dtype="float32")  # a second load: its own hooks
    assert [len(layer._forward_pre_hooks) for layer in loaded.model.model.language_model.layers] == hooks == \
        [1] * loaded.num_layers
    draft = run_method(loaded, inputs, "htsparse-draft", {"ht_prune_after": 0, "eta": 0.5}, 8)
    assert all(rec.rows is None for rec in draft.layers.values())
    assert draft.token_ids == before.token_ids  # lossless
