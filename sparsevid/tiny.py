"""Tiny random-weight models of each supported architecture, saved as ordinary model folders.

Tests and the mechanical benchmark build these from configs (nothing is downloaded) and load them
back through `models.load_model`, the same path a user's checkpoint takes.
"""

from __future__ import annotations

import json
import os

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
           "<|video_pad|>", "<|image_pad|>", "<video>", "<image>", "[UNK]"]
WORDS = ("system user assistant you are a helpful what colour shape is the object moving which direction how "
         "many objects when does it appear ? . , describe video red green blue yellow circle square triangle "
         "left right up down beginning middle end one two three").split()


def make_tokenizer(extra_words=(), vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    """Word-level tokenizer with the chat and vision special tokens; optional filler words up to vocab_size."""
    words = list(dict.fromkeys(WORDS + list(extra_words)))
    if vocab_size:
        words += [f"w{i}" for i in range(vocab_size - len(words) - len(SPECIAL))]
    vocab = {t: i for i, t in enumerate(SPECIAL + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.decoder = decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": SPECIAL[:-1]})
    return fast


def token_ids(tok) -> dict:
    """bos / eos / pad ids of a `make_tokenizer` vocabulary, as a model config and generation config take them."""
    return dict(bos_token_id=tok.convert_tokens_to_ids("<|im_start|>"), eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id)


# One user turn with a video and a question, rendered as the llava-hf LLaVA-OneVision checkpoints'
# shipped template renders it: "<|im_start|>user <video>\n{question}<|im_end|><|im_start|>assistant\n".
LLAVA_OV_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + ' ' }}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}"
    "{% for content in message['content'] %}{% if content['type'] == 'video' %}{{ '<video>' }}{% endif %}{% endfor %}"
    "{% for content in message['content'] %}{% if content['type'] == 'text' %}{{ '\n' + content['text'] }}"
    "{% endif %}{% endfor %}{{ '<|im_end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _mrope_section(head_dim: int) -> list[int]:
    """Qwen2-VL's (t, h, w) split of the rotary half-dimension, scaled from [16, 24, 24] at 128."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def tiny_config(arch: str, vocab_size: int, token_ids: dict | None = None, **over):
    """A small config of `arch` ("qwen2_vl", "qwen2_5_vl", "llava_onevision").

    `over` overrides text-model fields (hidden_size, num_hidden_layers, num_attention_heads,
    num_key_value_heads, ...); `token_ids` sets bos/eos/pad ids on the config and its text config.
    Vision special-token ids follow `make_tokenizer`'s vocabulary.
    """
    token_ids = token_ids or {}
    text = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,
                initializer_range=0.2, tie_word_embeddings=False, **token_ids)
    text.update(over)
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    if arch in ("qwen2_vl", "qwen2_5_vl"):
        if arch == "qwen2_vl":
            vision = dict(depth=1, embed_dim=32, hidden_size=text["hidden_size"], num_heads=2, patch_size=14,
                          spatial_merge_size=2, temporal_patch_size=2, in_channels=3, mlp_ratio=2)
            cls = transformers.Qwen2VLConfig
        else:
            vision = dict(depth=1, hidden_size=32, out_hidden_size=text["hidden_size"], intermediate_size=64,
                          num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                          fullatt_block_indexes=[0], tokens_per_second=2)
            cls = transformers.Qwen2_5_VLConfig
        text["rope_parameters"] = {"rope_type": "default", "mrope_section": _mrope_section(head_dim),
                                   "rope_theta": 10000.0}
        return cls(text_config=text, vision_config=vision, vision_start_token_id=SPECIAL.index("<|vision_start|>"),
                   vision_end_token_id=SPECIAL.index("<|vision_end|>"), video_token_id=SPECIAL.index("<|video_pad|>"),
                   image_token_id=SPECIAL.index("<|image_pad|>"), **token_ids)
    if arch == "llava_onevision":
        # SigLIP tower at 70 px, patch 14: a 5 x 5 patch grid, pooled to 3 x 3 tokens per frame
        # (the odd size exercises the ceil in the model's pooling), + one newline token per video.
        vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, image_size=70, patch_size=14, vision_use_head=False)
        text.update(model_type="qwen2", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        return transformers.LlavaOnevisionConfig(
            text_config=text, vision_config=vision, image_token_index=SPECIAL.index("<image>"),
            video_token_index=SPECIAL.index("<video>"), vision_feature_select_strategy="full",
            vision_feature_layer=-1, **token_ids)
    raise ValueError(f"no tiny config for {arch}")


def make_tiny_model(arch: str, out_dir: str, seed: int = 0, preprocessor: dict | None = None, **over) -> str:
    """Build, randomly initialise and save a tiny `arch` model folder with its tokenizer; returns out_dir.

    `preprocessor` overrides fields of the saved preprocessor json (e.g. {"max_pixels": ...} for
    Qwen2-VL to get more visual tokens per frame); `over` goes to `tiny_config`.
    """
    from .models import MODEL_CLASSES

    tok = make_tokenizer(vocab_size=256)
    ids = token_ids(tok)
    config = tiny_config(arch, len(tok), token_ids=ids, **over)
    for c in (config, config.get_text_config()):
        for k, v in ids.items():
            setattr(c, k, v)
    torch.manual_seed(seed)
    model = getattr(transformers, MODEL_CLASSES[arch])(config)
    model.generation_config.update(**ids)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    if arch in ("qwen2_vl", "qwen2_5_vl"):
        pre = dict(patch_size=14, temporal_patch_size=2, merge_size=2, min_pixels=56 * 56, max_pixels=112 * 112)
        pre.update(preprocessor or {})
        with open(os.path.join(out_dir, "preprocessor_config.json"), "w") as f:
            json.dump(pre, f)
    elif arch == "llava_onevision":
        side = config.vision_config.image_size
        pre = dict(video_processor_type="LlavaOnevisionVideoProcessor", size={"height": side, "width": side},
                   resample=3, do_resize=True, do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
                   image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], do_convert_rgb=True)
        pre.update(preprocessor or {})
        with open(os.path.join(out_dir, "video_preprocessor_config.json"), "w") as f:
            json.dump(pre, f)
        with open(os.path.join(out_dir, "chat_template.json"), "w") as f:
            json.dump({"chat_template": LLAVA_OV_CHAT_TEMPLATE}, f)
    return out_dir
