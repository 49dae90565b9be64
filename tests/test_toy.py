"""Embedded toy model: clip generator, questions, the shipped checkpoint, a training smoke run."""
import json
import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from sparsevid.toy import DEFAULT_MODEL_DIR
from sparsevid.toy.clips import BAR_H, COLOURS, RGB, SHAPES, make_clip
from sparsevid.toy.questions import NUMBERS, QTYPES, make_sample, normalise

EXAMPLES_DIR = os.path.join(os.path.dirname(DEFAULT_MODEL_DIR), "examples")


@pytest.mark.parametrize("frames", [8, 16, 256])
def test_generator_is_deterministic(frames):
    a, b = make_clip(123, frames), make_clip(123, frames)
    assert a.frames.dtype == np.uint8 and a.frames.shape == (frames, 96, 96, 3)
    assert np.array_equal(a.frames, b.frames)
    assert [o.to_dict() for o in a.objects] == [o.to_dict() for o in b.objects]
    for oa, ob in zip(a.objects, b.objects):
        assert np.array_equal(oa.boxes, ob.boxes)
    assert not np.array_equal(a.frames, make_clip(124, frames).frames)


@pytest.mark.parametrize("seed,frames", [(s, f) for s in range(6) for f in (8, 16, 32)] + [(0, 256), (1, 256)])
def test_boxes_cover_the_drawn_object(seed, frames):
    clip = make_clip(seed, frames)
    T, H, W = clip.frames.shape[:3]
    assert clip.objects
    assert len({o.colour for o in clip.objects}) == len(clip.objects)
    assert len({o.shape for o in clip.objects}) == len(clip.objects)
    for o in clip.objects:
        for t in range(T):
            mask = clip.idmap[t] == o.id
            x0, y0, x1, y1 = o.boxes[t]
            if not mask.any():
                assert x0 == -1
                continue
            ys, xs = np.nonzero(mask)
            # tight: the box is exactly the extent of the drawn pixels
            assert (x0, y0, x1, y1) == (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1)
            assert 0 <= x0 < x1 <= W and 0 <= y0 < y1 <= H - BAR_H
            # and those pixels carry the object's colour
            px = clip.frames[t][mask].astype(int)
            assert np.abs(px - np.array(RGB[o.colour])).max() <= 13
        vis = np.nonzero(o.boxes[:, 0] >= 0)[0]
        assert vis[0] == o.start and vis[-1] + 1 == o.end and len(vis) == o.end - o.start
        if frames > 32:
            assert o.end - o.start <= 32  # long clips: each object only in a short segment


def _centre(box):
    return ((box[0] + box[2]) / 2, (box[1] + box[3]) / 2)


@pytest.mark.parametrize("qtype", QTYPES)
def test_answers_match_clip_metadata(qtype):
    for seed in range(12):
        for frames in (16, 64):
            s = make_sample(seed, frames, qtype)
            assert s.qtype == qtype
            if qtype == "count":
                assert s.obj_id is None and s.answer == NUMBERS[len(s.clip.objects)]
                continue
            o = s.clip.obj(s.obj_id)
            q = s.question.lower()
            assert o.colour in q or o.shape in q  # the question names the asked object
            if qtype == "colour":
                assert s.answer == o.colour and o.shape in q and not any(c in q for c in COLOURS)
            elif qtype == "shape":
                assert s.answer == o.shape and o.colour in q and not any(sh in q for sh in SHAPES)
            elif qtype == "direction":
                (ax, ay), (bx, by) = _centre(o.boxes[o.start]), _centre(o.boxes[o.end - 1])
                dx, dy = bx - ax, by - ay
                want = ("right" if dx > 0 else "left") if abs(dx) > abs(dy) else ("down" if dy > 0 else "up")
                assert s.answer == want
            elif qtype == "when":
                assert not o.full
                mid = (o.start + o.end) / 2 / frames
                assert s.answer == ["beginning", "middle", "end"][min(2, int(mid * 3))]
                # the whole segment lies inside that third
                assert int(3 * (o.start + 0.5) / frames) == int(3 * (o.end - 0.5) / frames)
            elif qtype == "describe":
                assert s.answer.startswith(f"The {o.colour} {o.shape} moves ")
                assert len(s.answer.split()) >= 12
            boxes = s.boxes(normalised=True)
            assert len(boxes) == frames
            assert all(b is None or (0 <= b[0] < b[2] <= 1 and 0 <= b[1] < b[3] <= 1) for b in boxes)


def _shipped():
    if not os.path.exists(os.path.join(DEFAULT_MODEL_DIR, "model.safetensors")):
        pytest.skip("the toy model has not been trained into assets/ yet")


def test_shipped_model_folder_is_a_standard_checkpoint():
    _shipped()
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    assert os.path.getsize(os.path.join(DEFAULT_MODEL_DIR, "model.safetensors")) < 25 * 2**20
    cfg = AutoConfig.from_pretrained(DEFAULT_MODEL_DIR)
    assert cfg.model_type == "qwen2_vl"
    with safe_open(os.path.join(DEFAULT_MODEL_DIR, "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert not [k for k in keys if "aux" in k]
    with open(os.path.join(DEFAULT_MODEL_DIR, "preprocessor_config.json")) as f:
        pre = json.load(f)
    for k in ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std", "min_pixels", "max_pixels"):
        assert k in pre
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|vision_start|>", "<|vision_end|>",
              "<|video_pad|>", "<|image_pad|>"):
        assert tok.convert_tokens_to_ids(t) != tok.unk_token_id
        assert len(tok(t, add_special_tokens=False)["input_ids"]) == 1
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Hi"}]}],
                                   tokenize=False, add_generation_prompt=True)
    assert "<|vision_start|><|video_pad|><|vision_end|>Hi<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_shipped_model_answers_a_bundled_example():
    _shipped()
    path = os.path.join(EXAMPLES_DIR, "examples.json")
    if not os.path.exists(path):
        pytest.skip("no bundled examples yet")
    import torch

    from sparsevid.toy.evaluate import load_toy
    from sparsevid.toy.examples import answer, read_video

    with open(path) as f:
        ex = json.load(f)[0]
    frames = read_video(os.path.join(EXAMPLES_DIR, ex["file"]))
    assert len(frames) == ex["frames"] == len(ex["boxes"])
    torch.set_num_threads(1)
    tok, model, special = load_toy(DEFAULT_MODEL_DIR, attn="sdpa")
    assert normalise(answer(model, tok, special, frames, ex["question"])) == normalise(ex["answer"])


def test_training_runs_end_to_end_on_tiny_settings(tmp_path):
    from dataclasses import replace

    import torch
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

    from sparsevid.toy.train import TINY, TrainConfig, train

    cfg = replace(TrainConfig(seed=1, threads=1, hidden=64, vision_embed=32, vision_depth=1, layers=2,
                              questions_per_clip=2), **TINY)  # (the worker test below covers one question)
    info = train(cfg, str(tmp_path / "m"), progress=False)
    assert np.isfinite(info["final_loss"]["lm"])
    model = Qwen2VLForConditionalGeneration.from_pretrained(str(tmp_path / "m"))
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "m"))
    assert model.config.text_config.num_hidden_layers == 2
    assert tok.convert_tokens_to_ids("<|video_pad|>") == model.config.video_token_id
    torch.set_num_threads(1)
    s = make_sample(3, 8, "colour")
    from sparsevid.toy.examples import answer

    special = {t: tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|video_pad|>", "<|vision_end|>",
                                                         "<|im_end|>", "<|endoftext|>")}
    assert isinstance(answer(model, tok, special, s.clip.frames, s.question, max_new_tokens=3), str)


def test_drawing_batches_in_a_worker_process_changes_no_weight(tmp_path):
    """Training draws its clips in a worker process ahead of the steps (`data_workers`); a batch
    depends on its seed alone, so the weights must be bitwise those of drawing in the step. Covers a
    tower pass through a shallower throwaway language model (`tower_layers`) too: the saved model
    has all its layers."""
    from dataclasses import replace

    import torch
    from safetensors.torch import load_file

    from sparsevid.toy.train import TINY, TrainConfig, train

    base = replace(TrainConfig(seed=2, threads=1, hidden=64, vision_embed=32, vision_depth=1, layers=2), **TINY)
    weights = []
    for workers in (0, 1):
        out = tmp_path / f"w{workers}"
        train(replace(base, data_workers=workers, tower_layers=1), str(out), progress=False)
        weights.append(load_file(str(out / "model.safetensors")))
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert any(k.startswith("model.layers.1.") for k in weights[0])


def test_a_fresh_language_model_keeps_its_grounding_loss_through_a_checkpoint_save(tmp_path):
    """The two-pass recipe re-initialises the language model mid-training; the checkpoint save that
    follows (it switches the attention implementation to sdpa and back) must leave the training
    attention, and with it the grounding loss, on."""
    from dataclasses import replace

    import torch

    from sparsevid.toy.data import collate, encode
    from sparsevid.toy.train import (TINY, TrainConfig, build_tokenizer_and_model, forward_with_grounding,
                                     fresh_language_model, save_model)

    cfg = replace(TrainConfig(seed=1, threads=1, hidden=64, vision_embed=32, vision_depth=1, layers=2), **TINY)
    tok_obj, tok, special, model = build_tokenizer_and_model(cfg)
    before = model.model.language_model.layers[0].self_attn.q_proj.weight.clone()
    vision = model.model.visual.merger.ln_q.weight.clone()
    fresh_language_model(model, 2)
    assert not torch.equal(before, model.model.language_model.layers[0].self_attn.q_proj.weight)
    assert torch.equal(vision, model.model.visual.merger.ln_q.weight)
    save_model(model, tok_obj, str(tmp_path / "ck"), cfg)
    encs = [encode(make_sample(s, 8, "shape"), tok, special) for s in range(3)]
    _, lg = forward_with_grounding(model, collate(encs, special["<|endoftext|>"], special["<|video_pad|>"]),
                                   encs, cfg.grounded_heads)
    assert lg.item() > 0


def test_questions_packed_after_one_clip_score_as_if_each_were_asked_alone():
    """`questions_per_clip`: several questions about one clip share its prefix in one training
    sequence; each must see the prefix and itself only, at its own positions, so its logits and its
    grounding loss are those of the question asked alone."""
    import torch
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

    from sparsevid.toy.data import collate, encode, encode_many
    from sparsevid.toy.questions import make_samples
    from sparsevid.toy.tokenizer import SPECIAL_TOKENS
    from sparsevid.toy.train import forward_with_grounding, register_train_attention

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    special = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    model = Qwen2VLForConditionalGeneration.from_pretrained(
        DEFAULT_MODEL_DIR, attn_implementation={"text_config": register_train_attention(), "": "sdpa"}).eval()
    pad, vid = special["<|endoftext|>"], special["<|video_pad|>"]
    groups = [make_samples(5, 8, ["shape", "describe", "count"]), make_samples(7, 8, ["colour", "when"])]
    assert len({id(s.clip) for s in groups[0]}) == 1 and len({s.qtype for s in groups[0]}) == 3
    packed = [encode_many(g, tok, special) for g in groups]
    heads = (0, 1, 2, 3)
    with torch.no_grad():
        out, _ = forward_with_grounding(model, collate(packed, pad, vid), packed, heads)
        for b, (e, group) in enumerate(zip(packed, groups)):
            losses = []
            for q, s in zip(e.questions, group):
                one = encode(s, tok, special)
                alone, lg = forward_with_grounding(model, collate([one], pad, vid), [one], heads)
                a, r = out.logits[b, q.start:q.end], alone.logits[0, one.questions[0].start:]
                assert torch.allclose(a, r, atol=1e-4), s.question
                losses.append(lg)
            _, lg_packed = forward_with_grounding(model, collate([e], pad, vid), [e], heads)
            assert torch.allclose(lg_packed, torch.stack(losses).mean(), atol=1e-5)


def test_copy_loss_is_minus_log_the_answer_rows_layer0_attention_on_the_words_naming_the_object():
    """`copy_heads`: the loss must be what it claims (measured against eager attention weights), on
    the words that name the asked object and on nothing else."""
    import copy

    import torch
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

    from sparsevid.toy.data import collate, encode, encode_many
    from sparsevid.toy.questions import make_samples, normalise
    from sparsevid.toy.tokenizer import SPECIAL_TOKENS
    from sparsevid.toy.train import forward_with_grounding, register_train_attention

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    special = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    samples = [make_sample(s, 8, q) for s, q in [(1, "shape"), (2, "colour"), (3, "describe"), (4, "count")]]
    encs = [encode(s, tok, special) for s in samples]
    for s, e in zip(samples, encs):
        words = [tok.decode([e.input_ids[i]]).strip() for i in e.questions[0].names]
        o = s.clip.obj(s.obj_id) if s.obj_id is not None else None
        assert set(words) == ({w for w in (o.colour, o.shape) if w in normalise(s.question).split()}
                              if o else set()), (s.question, words)
    batch = collate(encs, special["<|endoftext|>"], special["<|video_pad|>"])
    heads = (0, 1, 2)
    # a freshly initialised model of the shipped architecture: its layer-0 attention is spread, so the
    # shares compared below are not so small that the eager weights underflow (the shipped model's do)
    config = Qwen2VLForConditionalGeneration.from_pretrained(DEFAULT_MODEL_DIR).config
    torch.manual_seed(0)
    eager = Qwen2VLForConditionalGeneration._from_config(
        copy.deepcopy(config), attn_implementation={"text_config": "eager", "": "sdpa"}).eval()
    train = Qwen2VLForConditionalGeneration._from_config(
        copy.deepcopy(config), attn_implementation={"text_config": register_train_attention(), "": "sdpa"}).eval()
    train.load_state_dict(eager.state_dict())
    with torch.no_grad():
        _, loss = forward_with_grounding(train, dict(batch), encs, (), heads)
        att = eager(**{k: v for k, v in batch.items() if k != "labels"}, output_attentions=True).attentions[0]
    want = [-torch.log(att[b, list(heads)][:, torch.arange(q.prompt_len - 3, q.end - 1)][:, :, q.names].sum(-1)).mean()
            for b, e in enumerate(encs) for q in e.questions if q.names]
    assert len(want) == 3  # the count question names no object
    assert torch.allclose(loss, torch.stack(want).mean(), atol=1e-4)
    # packed questions (block mask): each one's copy loss is the one it has alone
    group = make_samples(5, 8, ["shape", "describe", "direction"])
    packed = encode_many(group, tok, special)
    alone = [encode(s, tok, special) for s in group]
    with torch.no_grad():
        _, lp = forward_with_grounding(train, collate([packed], special["<|endoftext|>"], special["<|video_pad|>"]),
                                       [packed], (), heads)
        la = [forward_with_grounding(train, collate([a], special["<|endoftext|>"], special["<|video_pad|>"]),
                                     [a], (), heads)[1] for a in alone]
    assert torch.allclose(lp, torch.stack(la).mean(), atol=1e-4)


def test_toy_eval_reports_accuracy_by_type_and_by_how_the_object_is_named():
    _shipped()
    from sparsevid.toy.evaluate import evaluate, format_report, ref_kind

    assert ref_kind(make_sample(1, 8, "shape")) == "colour"  # "What shape is the red object?"
    assert ref_kind(make_sample(1, 8, "colour")) == "shape"  # "What colour is the circle?"
    assert ref_kind(make_sample(1, 8, "count")) is None
    res = evaluate(DEFAULT_MODEL_DIR, n=12, frames=[8], methods=["dense"], threads=1, progress=False)
    dense = res["accuracy"]["dense"]
    assert dense["n"] == 12 and set(dense["by_type"]) == set(QTYPES)
    assert set(dense["by_ref"]) <= {"colour", "shape", "both"} and {"colour", "shape"} <= set(dense["by_ref"])
    assert 0.5 <= dense["overall"] <= 1.0  # the shipped model answers most held-out questions
    assert 0.0 < res["attention"]["top10_mass"] <= 1.0 and 0.0 <= res["attention"]["box_hit_rate"] <= 1.0
    # "when" split by how close the object's segment comes to the next third: every "when" counted once
    assert sum(c for _, c in dense["when_by_margin"].values()) == 2  # 12 questions over 6 types
    assert "'when' by the segment's distance" in format_report(res)


def test_boundary_margin_is_the_nearest_edge_to_a_thirds_boundary():
    from types import SimpleNamespace

    from sparsevid.toy.evaluate import boundary_margin, margin_band

    # 256 frames: cuts at 85.33 and 170.67; a segment ending at frame 84 is 1.33 frames from the first
    assert boundary_margin(SimpleNamespace(start=72, end=84), 256) == pytest.approx(4 / 3 / 256)
    assert margin_band(boundary_margin(SimpleNamespace(start=72, end=84), 256)) == "< 3 %"
    assert margin_band(boundary_margin(SimpleNamespace(start=110, end=125), 256)) == ">= 6 %"  # 24.7 frames
    assert margin_band(boundary_margin(SimpleNamespace(start=95, end=110), 256)) == "3-6 %"  # 9.67 frames
    assert margin_band(boundary_margin(SimpleNamespace(start=0, end=4), 16)) == ">= 6 %"  # 1.33 of 16 frames


# ---- issue 22: domain randomisation, narration, degenerate answers (all opt-in)

import hashlib  # noqa: E402


def _clip_fp(clip) -> str:
    h = hashlib.sha256()
    h.update(clip.frames.tobytes())
    h.update(clip.idmap.tobytes())
    for o in clip.objects:
        h.update(repr(sorted(o.to_dict().items())).encode())
        h.update(o.boxes.tobytes())
    return h.hexdigest()[:16]


# Fingerprints computed with the generator as it was before styles existed (commit 553c1f0's
# clips.py and questions.py): the default renderer and question sampling must not move a bit.
_CLIP_FP = {(0, 8): "4782ef1f5af192e2", (1, 16): "4862058571970937", (2, 32): "6a4be3e90ab8fa38",
            (3, 48): "b1872e2be911399e", (4, 16): "d722f6ad05d70417", (5, 8): "46d0ffd8913d3b8b",
            (6, 256): "6db6e6bdb16c8c78", (7, 9): "c55b10c1d68d2574"}
_SAMPLE_FP = {(10, 16, None): "57728456472fe50d", (10, 16, "count"): "1508a8a64b7cb234",
              (10, 16, "describe"): "b97baabc25218ae3", (11, 8, None): "4833f407e977ba67",
              (11, 8, "count"): "b20fb01141ac2d97", (11, 8, "describe"): "1a2630e2da210616",
              (12, 64, None): "ec7d073b4ee6b80d", (12, 64, "count"): "a20b5012b795236c",
              (12, 64, "describe"): "57e8eafa4a98b513", (13, 16, None): "0721764e54d39030",
              (13, 16, "count"): "fe24167590e833d2", (13, 16, "describe"): "e48942cb34bf7d87"}
# `_Draws` batches of TrainConfig() (and with questions_per_clip=3) before the issue-22 options
_BATCH_PLAN = [(1, 0, 1, 0.0), (2, 3, 2, 0.1), (3, 5, 3, 0.5), (3, 6, 3, 0.5), (7, 2, 2, 1.0)]
_BATCH_FP = {1: ["f03df1ed449b49de", "9aa6a378e05289aa", "3b59f37c79aa36dd", "fd288419e6c9d1cf", "d9c08de11322eddf"],
             3: ["f03df1ed449b49de", "272923f4f417a1c4", "e16b5c46c8c765f3", "0681f0699b00416a", "eb1d3cbd64aa6c91"]}


def test_default_clips_and_questions_are_bit_identical_to_the_original_generator():
    from sparsevid.toy.clips import LEGACY

    for (seed, frames), want in _CLIP_FP.items():
        assert _clip_fp(make_clip(seed, frames, glimpses=True)) == want, (seed, frames)
        assert _clip_fp(make_clip(seed, frames, style=LEGACY, glimpses=True)) == want, (seed, frames)
    for (seed, frames, q), want in _SAMPLE_FP.items():
        s = make_sample(seed, frames, q, glimpses=True)
        got = hashlib.sha256(f"{_clip_fp(s.clip)}|{s.qtype}|{s.question}|{s.answer}|{s.obj_id}".encode())
        assert got.hexdigest()[:16] == want, (seed, frames, q)


@pytest.mark.parametrize("qpc", [1, 3])
def test_default_training_batches_are_the_original_ones(qpc):
    """TrainConfig() with the issue-22 options off draws exactly the original batches (tokenizer
    included), so it trains exactly as before."""
    from transformers import PreTrainedTokenizerFast

    from sparsevid.toy.questions import corpus
    from sparsevid.toy.tokenizer import SPECIAL_TOKENS, train_tokenizer
    from sparsevid.toy.train import TrainConfig, _Draws, build_tokenizer_and_model

    cfg = TrainConfig(questions_per_clip=qpc)
    assert cfg.style_prob == 0 and cfg.narration_prob == 0
    tok_obj = train_tokenizer(corpus())
    assert tok_obj.to_str() == build_tokenizer_and_model(replace_cfg_small(cfg))[0].to_str()
    special = {t: tok_obj.token_to_id(t) for t in SPECIAL_TOKENS}
    tok = PreTrainedTokenizerFast(tokenizer_object=tok_obj, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    draws = _Draws(cfg, tok, special, _BATCH_PLAN)
    for i, want in enumerate(_BATCH_FP[qpc]):
        T, encs, _ = draws[i]
        h = hashlib.sha256(str(T).encode())
        for e in encs:
            h.update(repr((e.input_ids, e.labels, e.vis_start, e.n_visual)).encode())
            h.update(e.pixel_values.numpy().tobytes())
            h.update(e.aux.tobytes())
            for q in e.questions:
                h.update(repr((q.start, q.prompt_len, q.end, q.names)).encode())
                h.update(q.target.tobytes())
                h.update(q.readout.tobytes())
        assert h.hexdigest()[:16] == want, _BATCH_PLAN[i]


def replace_cfg_small(cfg):
    from dataclasses import replace

    return replace(cfg, hidden=64, vision_embed=32, layers=1)


def test_random_styles_keep_boxes_exact_and_answers_right():
    from sparsevid.toy.clips import HELD_OUT_BACKGROUNDS, HELD_OUT_BANDS, held_out_family, sample_style

    seen = set()
    for seed in range(40):
        st = sample_style(seed, train=True)
        assert not held_out_family(st)
        ho = sample_style(seed, held_out=True)
        assert held_out_family(ho) and (ho.background in HELD_OUT_BACKGROUNDS or ho.size_band in HELD_OUT_BANDS)
        assert sample_style(seed) == st  # deterministic
        seen.update({st.background, st.distractors, st.bar, st.crf is None, (st.height, st.width)})
        if seed >= 12:
            continue
        frames = (8, 16, 48)[seed % 3]
        clip = make_clip(seed, frames, style=replace_style_cheap(st) if seed % 2 else st)
        T, H, W = clip.frames.shape[:3]
        assert (T, H, W) == (frames, st.height, st.width) and clip.meta["held_out"] is False
        assert np.array_equal(clip.frames, make_clip(seed, frames, style=replace_style_cheap(st) if seed % 2 else st).frames)
        for o in clip.objects:
            for t in range(T):
                mask = clip.idmap[t] == o.id
                if not mask.any():
                    assert o.boxes[t, 0] == -1
                    continue
                ys, xs = np.nonzero(mask)
                assert tuple(o.boxes[t]) == (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1)
        s = make_sample(seed, frames, "direction", style=st)
        o = s.clip.obj(s.obj_id)
        (ax, ay), (bx, by) = _centre(o.boxes[o.start]), _centre(o.boxes[o.end - 1])
        if o.end - o.start > 1:
            dx, dy = bx - ax, by - ay
            assert s.answer == (("right" if dx > 0 else "left") if abs(dx) > abs(dy) else ("down" if dy > 0 else "up"))
    assert {"plain", "noise", "gradient", "stripes", "checker", "none", "top", "bottom", True, False} <= seen
    assert len([x for x in seen if isinstance(x, tuple)]) >= 5  # frame sizes / aspect ratios


def replace_style_cheap(st):
    from dataclasses import replace

    return replace(st, crf=None)


def test_no_bar_and_other_bar_clips_differ_only_in_the_bar():
    from dataclasses import replace

    from sparsevid.toy.clips import LEGACY

    base = make_clip(3, 16)
    nobar = make_clip(3, 16, style=replace(LEGACY, bar="none"))
    assert np.array_equal(base.frames[:, : 96 - BAR_H], nobar.frames[:, : 96 - BAR_H])
    assert not np.array_equal(base.frames[:, 96 - BAR_H:], nobar.frames[:, 96 - BAR_H:])
    assert [o.to_dict() for o in base.objects] == [o.to_dict() for o in nobar.objects]
    top = make_clip(3, 16, style=replace(LEGACY, bar="top", bar_colours=((200, 30, 30), (30, 200, 200))))
    assert (top.frames[-1, :BAR_H] == (30, 200, 200)).all()  # the full bar, coloured, at the top
    assert all((o.boxes[o.boxes[:, 0] >= 0, 1] >= BAR_H + 2).all() for o in top.objects)
    assert [(o.colour, o.shape, o.direction, o.start, o.end) for o in base.objects] == \
        [(o.colour, o.shape, o.direction, o.start, o.end) for o in top.objects]


def test_codec_artefacts_are_cheap_and_deterministic():
    import time
    from dataclasses import replace

    from sparsevid.toy.clips import LEGACY

    t0 = time.time()
    a = make_clip(4, 16, style=replace(LEGACY, crf=35))
    assert time.time() - t0 < 2.0
    b = make_clip(4, 16, style=replace(LEGACY, crf=35))
    plain = make_clip(4, 16)
    assert np.array_equal(a.frames, b.frames) and a.frames.shape == plain.frames.shape
    diff = np.abs(a.frames.astype(int) - plain.frames.astype(int))
    assert 0 < diff.mean() < 12  # artefacts, not a different picture


def test_narration_answers_and_scores():
    from sparsevid.toy.clips import sample_style
    from sparsevid.toy.questions import (NARRATE, NARRATE_TEMPLATES, corpus, narration_order, parse_sentence,
                                         repeats_3gram_3x, score_narration, sentences)
    from sparsevid.toy.tokenizer import train_tokenizer

    tok = train_tokenizer(corpus(narration=True))
    lengths, ties = [], 0
    for seed in range(40):
        frames = (8, 16, 32, 64, 96)[seed % 5]
        s = make_sample(seed, frames, NARRATE, style=sample_style(seed) if seed % 2 else None)
        assert s.question in NARRATE_TEMPLATES and s.obj_id is None
        objs = narration_order(s.clip)
        sents = sentences(s.answer)
        assert len(sents) == 1 + len(objs) and sents[0].startswith("there")
        assert sents[0].split()[2] == NUMBERS[len(objs)]
        for i, (o, x) in enumerate(zip(objs, sents[1:])):
            assert x.startswith("then ") == (i > 0)
            assert parse_sentence(x) == (o.colour, o.shape, o.direction, "throughout" if o.full else o.phase.split()[-1])
        assert [o.start // 2 for o in objs] == sorted(o.start // 2 for o in objs)  # order of appearance
        lengths.append(len(tok.encode(s.answer).ids))
        assert not repeats_3gram_3x(s.answer)
        sc = score_narration(s.answer, s.answer)
        assert sc["whole"] and sc["sentences"] == 1 and sc["objects"] == 1 and sc["count_ok"]
        # objects first seen in the same frame pair appear together: any order of them is correct
        assert s.answers[0] == s.answer and len(set(s.answers)) == len(s.answers)
        for alt in s.answers[1:]:
            assert {parse_sentence(x) for x in sentences(alt)[1:]} == {parse_sentence(x) for x in sents[1:]}
            assert sentences(alt)[1].startswith("a") and all(x.startswith("then ") for x in sentences(alt)[2:])
            sc = score_narration(alt, s.answers)
            assert sc["whole"] and not sc["whole_strict"] and sc["sentences"] == 1
            assert not score_narration(alt, s.answer)["whole"]
        ties += len(s.answers) > 1
    assert ties >= 5
    assert 15 <= min(lengths) and max(lengths) <= 70
    ref = ("There are two objects. A red circle moves to the right at the beginning of the video. "
           "Then a blue square moves to the top in the middle of the video.")
    swapped = ("There are two objects. A blue square moves to the top in the middle of the video. "
               "Then a red circle moves to the right at the beginning of the video.")
    sc = score_narration(swapped, ref)
    assert not sc["whole"] and sc["sentences"] == pytest.approx(1 / 3) and sc["objects"] == 1
    sc = score_narration("There are two objects. A red circle moves to the left at the beginning of the video.", ref)
    assert sc["objects"] == 0 and sc["count_ok"] and sc["n_pred"] == 2
    assert sc["at_place"] == [True, False, False]


def test_every_short_lived_object_fills_a_frame_pair_unless_glimpses_are_asked_for():
    """Today's world: every object of a short clip is seen moving by some visual token, in its
    third of the clip; the original world (glimpses=True) has objects that are not, and a clip
    without them is (almost always) drawn the same in both worlds."""
    from sparsevid.toy.clips import PHASES, frame_phase
    from sparsevid.toy.questions import seen_moving

    glimpsed = same = unglimpsed = 0
    for T in (6, 7, 8, 9, 12, 16, 24, 32):
        for seed in range(40):
            clip, old = make_clip(seed, T), make_clip(seed, T, glimpses=True)
            for o in clip.objects:
                assert seen_moving(o, T), (T, seed, o.start, o.end)
                if not o.full:  # its "when" label is the third its frames lie in (or are centred in)
                    assert PHASES.index(o.phase) in {frame_phase(t, T) for t in range(o.start, o.end)} \
                        or T in (7, 8), (T, seed)
            glimpsed += sum(not seen_moving(o, T) for o in old.objects)
            if not any(not seen_moving(o, T) for o in old.objects):  # the same clip, unless a
                unglimpsed += 1  # placement tried and rejected on the way drew a glimpse
                same += np.array_equal(clip.frames, old.frames)
    assert glimpsed > 20 and same >= 0.8 * unglimpsed > 100


def test_seen_moving_is_whether_a_frame_pair_holds_two_frames_of_the_object():
    """The eval splits narration sentences by it: an object visible in frames 7 and 8 only lies in
    two frame pairs (the temporal patch), one frame in each, so no visual token sees it move."""
    from sparsevid.toy.clips import ToyObject
    from sparsevid.toy.questions import seen_moving

    def obj(frames, T=16):
        boxes = np.full((T, 4), -1, dtype=np.int32)
        boxes[list(frames)] = (10, 10, 30, 30)
        return ToyObject(0, "red", "circle", "left", 20, min(frames), max(frames) + 1, boxes, len(frames) == T)

    assert not seen_moving(obj([7, 8]), 16) and not seen_moving(obj([1, 2]), 16)
    assert seen_moving(obj([8, 9]), 16) and seen_moving(obj([7, 8, 9]), 16) and seen_moving(obj(range(16)), 16)
    assert not seen_moving(obj([15]), 16)  # one frame: nothing moves
    assert not seen_moving(obj([14]), 15)  # the last frame of an odd clip pairs with a copy of itself


def test_narration_grounding_by_sentence():
    """Training grounds the rows writing each narration sentence on that sentence's object (the
    count sentence on every object), and a one-object answer on its object as before."""
    from dataclasses import replace

    import torch

    from sparsevid.toy.data import encode_many, target_cells
    from sparsevid.toy.questions import NARRATE, corpus, narration_order
    from sparsevid.toy.tokenizer import SPECIAL_TOKENS, train_tokenizer
    from sparsevid.toy.train import grounding_items
    from transformers import PreTrainedTokenizerFast

    tok_obj = train_tokenizer(corpus(narration=True))
    tok = PreTrainedTokenizerFast(tokenizer_object=tok_obj, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    special = {t: tok_obj.token_to_id(t) for t in SPECIAL_TOKENS}
    s = next(x for x in (make_sample(seed, 16, NARRATE) for seed in range(50)) if len(x.clip.objects) >= 3)
    e = encode_many([s], tok, special)
    q = e.questions[0]
    items = grounding_items([e])
    objs = narration_order(s.clip)
    assert len(items) == 1 + len(objs)
    rows = torch.cat([it.rows for it in items])
    assert rows.tolist() == list(range(q.prompt_len - 3, q.end - 1))  # every answer row, once, in order
    gt, mh, mw = (int(v) for v in e.grid_thw[0]); mh, mw = mh // 2, mw // 2
    for it, o in zip(items[1:], objs):
        text = tok.decode([e.input_ids[r + 1] for r in it.rows])
        assert f"{o.colour} {o.shape}" in text, text
        assert torch.equal(it.target, torch.from_numpy(target_cells(replace(s, obj_id=o.id), gt, mh, mw)))
    assert items[0].target.sum() >= max(int(it.target.sum()) for it in items[1:])  # the count sentence: all
    one = encode_many([make_sample(3, 16, "describe")], tok, special)
    [it] = grounding_items([one])
    assert it.rows.tolist() == list(range(one.questions[0].prompt_len - 3, one.questions[0].end - 1))


def test_degenerate_answer_detector():
    from sparsevid.toy.questions import repeats_3gram_3x

    for loop in ["red red red", "to the right to the right to the right",
                 "A red circle moves up. A red circle moves up. A red circle moves up.",
                 "The green triangle triangle triangle moves", "The yellowThe yellowThe yellowThe", "crosscrosscross"]:
        assert repeats_3gram_3x(loop), loop
    for ok in ["red", "to the right to the right", "The red circle moves to the right at the end of the video.",
               "There are three objects. A red circle moves to the right at the end of the video. Then a blue "
               "square moves to the right at the end of the video. Then a green cross moves to the right at the "
               "end of the video."]:
        assert not repeats_3gram_3x(ok), ok
    assert repeats_3gram_3x("of the video x of the video y of the video", consecutive=False)


def test_default_question_sampling_never_asks_for_a_narration():
    from sparsevid.toy.questions import NARRATE

    assert NARRATE not in QTYPES
    assert all(make_sample(s, 8).qtype in QTYPES for s in range(30))


def test_token_labels_follow_the_resize_of_other_frame_sizes():
    """Frames of other sizes are resized by the preprocessing: the per-token labels and the asked
    object's cells must follow."""
    from dataclasses import replace

    from sparsevid.toy.clips import sample_style
    from sparsevid.toy.data import target_cells, token_labels
    from sparsevid.toy.model import MERGE, PATCH, preprocess_frames

    st = replace(sample_style(5), height=72, width=128, crf=None, distractors="none", background="plain")
    s = make_sample(9, 8, "colour", style=st)
    _, thw = preprocess_frames(s.clip.frames)
    gt, gh, gw = (int(v) for v in thw[0])
    assert (gh * PATCH, gw * PATCH) == (64, 128)
    lab = token_labels(s.clip, gt, gh // MERGE, gw // MERGE)
    cells = target_cells(s, gt, gh // MERGE, gw // MERGE)
    from sparsevid.toy.clips import COLOURS

    mine = lab[:, 0] == COLOURS.index(s.clip.obj(s.obj_id).colour) + 1
    assert mine.any() and cells[mine].all()  # every token labelled with the object lies in its box cells


def test_training_runs_with_random_styles_and_narration(tmp_path):
    from dataclasses import replace

    from sparsevid.toy.train import RANDOMISED, TINY, TrainConfig, _Draws, build_tokenizer_and_model, train

    cfg = replace(TrainConfig(seed=3, threads=1, hidden=64, vision_embed=32, vision_depth=1, layers=2,
                              data_workers=0), **TINY)
    cfg = replace(cfg, **{**RANDOMISED, "short_frames": (8, 12), "short_probs": (0.5, 0.5), "long_frames": (40,),
                          "narration_prob": 0.5})
    tok_obj, tok, special, _ = build_tokenizer_and_model(cfg)
    items = [_Draws(cfg, tok, special, [(2, k, 2, 0.5)])[0] for k in range(4)]
    texts = [tok.decode(e.input_ids) for _, encs, _ in items for e in encs]
    assert any("Narrate the video" in t or "What happens in the video" in t or "Describe the video" in t for t in texts)
    sizes = {tuple(e.grid_thw[0].tolist()[1:]) for _, encs, _ in items for e in encs}
    assert len(sizes) > 1  # frames of several sizes
    info = train(cfg, str(tmp_path / "m"), progress=False)
    assert np.isfinite(info["final_loss"]["lm"])


def test_shipped_model_narrates_and_ends_cleanly_on_any_rendering():
    """Held-out clips in random styles, in the held-out style family and without a progress bar:
    every answer ends with end-of-text, none loops, and narrations get sentences right."""
    _shipped()
    from sparsevid.toy.evaluate import evaluate_styles
    from sparsevid.toy.questions import NARRATE

    res = evaluate_styles(DEFAULT_MODEL_DIR, styles=("random", "held-out", "no-bar"), n=8, frames=[16],
                          qtypes=[NARRATE, "colour", "when", "describe"], threads=1, progress=False)
    for st, r in res.items():
        d = r["degenerate"]
        assert d["n"] == 8 and d["loops"] == 0 and d["no_end"] == 0, (st, r["loops"], r["errors"])
        assert r["narration"]["n"] == 2 and r["narration"]["count_ok"] > 0, st
    # a floor, not the model card's figures (0.56-0.76 of sentences on 8 narrations per set)
    assert sum(r["narration"]["sentences"] for r in res.values()) / len(res) >= 0.4
    assert sum(r["accuracy"]["dense"]["overall"] for r in res.values()) / len(res) >= 0.6
    # the object sentences, split by whether a frame pair shows their object moving, are all there
    assert all(r["narration"]["n_moving"] + r["narration"]["n_glimpsed"] >= 2 for r in res.values())
    from sparsevid.toy.evaluate import format_report

    assert "== summary (dense)" in format_report(res)


def test_report_of_narrations_alone():
    """`toy eval --types narrate` with several style sets: the summary has no short answers to report."""
    _shipped()
    from sparsevid.toy.evaluate import evaluate_styles, format_report
    from sparsevid.toy.questions import NARRATE

    res = evaluate_styles(DEFAULT_MODEL_DIR, styles=("default", "held-out"), n=2, frames=[16], qtypes=[NARRATE],
                          threads=1, progress=False)
    text = format_report(res)
    assert "narration whole" in text and "without narrations" not in text


@pytest.mark.parametrize("narration", [False, True])
def test_finetune_starts_from_the_checkpoint_with_rows_moved_by_token_string(narration):
    _shipped()
    import torch
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

    from sparsevid.toy.train import TrainConfig, build_tokenizer_and_model, init_from_checkpoint

    parent = Qwen2VLForConditionalGeneration.from_pretrained(DEFAULT_MODEL_DIR)
    old = parent.state_dict()
    _, tok, _, model = build_tokenizer_and_model(TrainConfig(narration_prob=0.15 if narration else 0.0,
                                                             layers=parent.config.text_config.num_hidden_layers))
    counts = init_from_checkpoint(model, tok, DEFAULT_MODEL_DIR)
    old_vocab = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR).get_vocab()
    new = model.state_dict()
    assert counts["copied"] + counts["composed"] == len(tok.get_vocab()) and counts["copied"] > 400
    for k in new:
        if "embed_tokens" not in k and k != "lm_head.weight":
            assert torch.equal(new[k], old[k]), k
    emb = next(k for k in new if k.endswith("embed_tokens.weight"))
    for text, i in list(tok.get_vocab().items())[:200]:
        if text in old_vocab:
            assert torch.equal(new[emb][i], old[emb][old_vocab[text]]) and \
                torch.equal(new["lm_head.weight"][i], old["lm_head.weight"][old_vocab[text]])


def test_a_grown_model_answers_exactly_as_its_parent_before_training():
    """A deepening fine-tune (`TrainConfig.grow_at`) inserts identity layers: before its first step
    the grown model's logits are its parent's, and the parent's layers sit around the new ones."""
    _shipped()
    from dataclasses import replace

    import torch
    from transformers import Qwen2VLForConditionalGeneration

    from sparsevid.toy.data import collate, encode
    from sparsevid.toy.train import DEEPER, TrainConfig, build_tokenizer_and_model, init_from_checkpoint

    old = Qwen2VLForConditionalGeneration.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()
    n = old.config.text_config.num_hidden_layers
    cfg = replace(TrainConfig(), **{**DEEPER, "layers": n + 2, "grow_at": (2, n + 1)})
    _, tok, special, model = build_tokenizer_and_model(cfg)
    init_from_checkpoint(model, tok, DEFAULT_MODEL_DIR, cfg.grow_at)
    model.set_attn_implementation({"text_config": "sdpa", "vision_config": "sdpa"})
    model.eval()
    old_layers, new_layers = old.model.language_model.layers, model.model.language_model.layers
    assert len(new_layers) == n + 2
    assert torch.equal(new_layers[3].mlp.up_proj.weight, old_layers[2].mlp.up_proj.weight)
    assert not new_layers[2].mlp.down_proj.weight.any() and new_layers[2].mlp.up_proj.weight.any()
    torch.set_num_threads(1)
    batch = collate([encode(make_sample(1_700_000_001, 16, "when"), tok, special)], special["<|endoftext|>"],
                    special["<|video_pad|>"])
    batch.pop("labels")
    with torch.no_grad():
        assert torch.allclose(model(**batch).logits, old(**batch).logits, atol=1e-5)
    with pytest.raises(ValueError, match="not the same architecture"):
        init_from_checkpoint(model, tok, DEFAULT_MODEL_DIR)  # grown sizes without grow_at


def test_attribute_weighted_answer_loss():
    """`--attr-weight`: the attribute words' tokens of the shipped tokenizer, and a CE that is the
    model's own at weight 1 and counts those targets `weight` times otherwise."""
    import torch
    from transformers import AutoTokenizer

    from sparsevid.toy.train import attribute_token_ids, weighted_answer_loss

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    ids = set(attribute_token_ids(tok).tolist())
    assert {tok.convert_tokens_to_ids(t) for t in ("Ġtop", "Ġred", "Ġcircle", "Ġthroughout")} <= ids
    assert tok.convert_tokens_to_ids("Ġthe") not in ids and tok.convert_tokens_to_ids("Ġmoves") not in ids
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, len(tok), generator=g)
    labels = torch.tensor([[-100, -100, 5, 7, 9, -100], [-100, 3, 4, 5, 6, 7]])
    plain = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, len(tok)), labels[:, 1:].reshape(-1))
    attr = torch.tensor([5])
    assert torch.allclose(weighted_answer_loss(logits, labels, attr, 1.0), plain)
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, len(tok)), labels[:, 1:].reshape(-1),
                                           reduction="none")
    y = labels[:, 1:].reshape(-1)
    w = (y != -100).float() + 2.0 * (y == 5)
    assert torch.allclose(weighted_answer_loss(logits, labels, attr, 3.0), (ce * w).sum() / w.sum())


def test_direction_probe_reads_motion_from_tokens_that_see_it(capsys):
    """`python -m sparsevid.toy probe`: a linear probe on the shipped tower's tokens reads the
    direction of objects the token sees in both its frames (what every short direction question
    relies on), and reports the other groups beside it."""
    from sparsevid.toy.__main__ import main

    assert main(["probe", "--n", "200", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(res) <= {"two_frame_tokens", "one_frame_tokens", "glimpsed_objects"}
    assert res["two_frame_tokens"]["accuracy"] > 0.8 and res["two_frame_tokens"]["n_test"] > 500
    assert 0.0 <= res["one_frame_tokens"]["accuracy"] <= 1.0 and res["one_frame_tokens"]["n_test"] > 50


def test_time_probe_reads_each_visual_tokens_frame_pair(capsys):
    """`python -m sparsevid.toy probe --time`: in clips without a bar the shipped model's visual rows
    tell their frame pair from the second layer on (what "when" builds on), and the clip-length probe
    of the rows after the video is reported beside it, one figure per hidden state."""
    from sparsevid.toy.__main__ import main

    assert main(["probe", "--time", "--n", "30", "--frames", "64,128", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    layers = 1 + json.load(open(os.path.join(DEFAULT_MODEL_DIR, "config.json")))["text_config"]["num_hidden_layers"]
    assert set(res) == {"visual_pair", "clip_length"} and all(len(r) == layers for r in res.values())
    assert res["visual_pair"][0]["r2"] < 0.3  # the embeddings know no position
    assert all(r["r2"] > 0.8 for r in res["visual_pair"][2:])
    assert all(np.isfinite(r["mae"]) for r in res["clip_length"])


def test_no_bar_share_draws_training_clips_without_the_progress_bar():
    """`TrainConfig.no_bar_prob` (the fifth fine-tune's 0.3): at 1 every training clip, default
    renderer or random style, comes without its progress bar; at 0 the bar stays where the style
    has one (the default renderer's clips always do)."""
    from sparsevid.toy.train import _samples

    def bars(no_bar_prob, style_prob):
        out = _samples(np.random.default_rng(7), 16, 12, 0.3, style_prob=style_prob, glimpses=False,
                       no_bar_prob=no_bar_prob)
        return [qs[0].clip.meta.get("style", {}).get("bar", "bottom") for qs in out]

    assert set(bars(1.0, 0.0)) == {"none"} and set(bars(1.0, 0.5)) == {"none"}
    assert set(bars(0.0, 0.0)) == {"bottom"}


def test_crowded_share_draws_four_object_clips_and_weights_the_count_words():
    """`TrainConfig.crowded_prob` and `attr_extra` (the eighth fine-tune's): at 1 every training clip
    not forced to one object has four; at 0 the clips are the earlier recipes' (objects of every
    number); the count words and the time phrase's "at" / "in" join the weighted tokens."""
    from transformers import AutoTokenizer

    from sparsevid.toy.train import CROWDED, _samples, attribute_token_ids

    def objects(crowded_prob, T=16, p1=0.3):  # long clips: no single-object share (`_batch_spec`)
        out = _samples(np.random.default_rng(3), T, 24, p1, glimpses=False, crowded_prob=crowded_prob)
        return [len(qs[0].clip.objects) for qs in out]

    assert set(objects(1.0)) == {1, 4} and set(objects(1.0, 64, 0.0)) == {4}
    assert set(objects(0.0)) == {1, 2, 3, 4}
    assert objects(0.0) == [len(qs[0].clip.objects)
                            for qs in _samples(np.random.default_rng(3), 16, 24, 0.3, glimpses=False)]
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    ids = set(attribute_token_ids(tok, CROWDED["attr_extra"]).tolist())
    assert {tok.convert_tokens_to_ids(t) for t in ("Ġfour", "Ġin", "Ġat", "Ġred")} <= ids
    assert tok.convert_tokens_to_ids("Ġfour") not in set(attribute_token_ids(tok).tolist())


def test_the_time_loss_asks_each_row_for_the_frame_pairs_up_to_it(tmp_path):
    """`time_rows`: a visual token of frame pair p is asked for log(p + 1), every row after the video
    (the question, the answer) for the log of the clip's pairs, at any clip length; a tiny run with
    the loss on trains and saves a plain checkpoint (the head dropped)."""
    from dataclasses import replace

    import torch
    from safetensors.torch import load_file

    from sparsevid.toy.data import encode
    from sparsevid.toy.train import TIMED, TINY, TrainConfig, build_tokenizer_and_model, time_rows, train

    cfg = replace(TrainConfig(seed=4, threads=1, hidden=64, vision_embed=32, vision_depth=1, layers=2,
                              data_workers=0), **TIMED)
    cfg = replace(cfg, **TINY, init_from="")
    _, tok, special, _ = build_tokenizer_and_model(cfg)
    encs = [encode(make_sample(5, 16, "when"), tok, special), encode(make_sample(6, 40, "colour"), tok, special)]
    b, rows, y, vis = time_rows(encs)
    for i, (e, pairs) in enumerate(zip(encs, (8, 20))):
        mine = b == i
        cells = e.n_visual // pairs
        assert int((mine & vis).sum()) == e.n_visual
        assert int((mine & ~vis).sum()) == len(e.input_ids) - e.vis_start - e.n_visual
        first, last = rows[mine & vis].min().item(), rows[mine & vis].max().item()
        assert (first, last) == (e.vis_start, e.vis_start + e.n_visual - 1)
        visual_y = y[mine & vis]
        assert torch.allclose(visual_y[:cells], torch.zeros(cells))  # the first pair: log 1
        assert torch.allclose(visual_y[-1], torch.tensor(np.log(pairs), dtype=torch.float32))
        assert torch.allclose(y[mine & ~vis], torch.full((int((mine & ~vis).sum()),), float(np.log(pairs))))
    info = train(cfg, str(tmp_path / "m"), progress=False)
    assert np.isfinite(info["final_loss"]["time"]) and info["final_loss"]["time"] > 0
    assert not any("time" in k or "readout" in k for k in load_file(str(tmp_path / "m" / "model.safetensors")))
