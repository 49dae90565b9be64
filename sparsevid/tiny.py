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


def tiny_config(arch: str, vocab_size: int, **over):
    """A small config of `arch` ("qwen2_vl", "qwen2_5_vl", "llava_onevision")."""
    text = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,
                initializer_range=0.2, tie_word_embeddings=False)
    text.update(over)
    if arch in ("qwen2_vl", "qwen2_5_vl"):
        vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=14, spatial_merge_size=2,
                      temporal_patch_size=2, in_channels=3)
        if arch == "qwen2_vl":
            vision.update(mlp_ratio=2)
            cls = transformers.Qwen2VLConfig
        else:
            vision = dict(depth=1, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2,
                          patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                          fullatt_block_indexes=[0], tokens_per_second=2)
            cls = transformers.Qwen2_5_VLConfig
        text["rope_parameters"] = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
        return cls(text_config=text, vision_config=vision, vision_start_token_id=3, vision_end_token_id=4,
                   video_token_id=5, image_token_id=6)
    raise ValueError(f"no tiny config for {arch}")


def make_tiny_model(arch: str, out_dir: str, seed: int = 0, **over) -> str:
    """Build, randomly initialise and save a tiny `arch` model folder with its tokenizer; returns out_dir."""
    from .models import MODEL_CLASSES

    tok = make_tokenizer(vocab_size=256)
    config = tiny_config(arch, len(tok), **over)
    ids = dict(bos_token_id=tok.convert_tokens_to_ids("<|im_start|>"), eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id)
    for c in (config, config.get_text_config()):
        for k, v in ids.items():
            setattr(c, k, v)
    torch.manual_seed(seed)
    model = getattr(transformers, MODEL_CLASSES[arch])(config)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    if arch in ("qwen2_vl", "qwen2_5_vl"):
        with open(os.path.join(out_dir, "preprocessor_config.json"), "w") as f:
            json.dump(dict(patch_size=14, temporal_patch_size=2, merge_size=2, min_pixels=56 * 56,
                           max_pixels=112 * 112), f)
    return out_dir
