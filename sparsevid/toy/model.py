"""Config, preprocessing and prompt building for the embedded toy Qwen2-VL model.

`preprocess_frames` is the project's Qwen2-VL preprocessing (`adapters.qwen2vl_preprocess`) with
the toy model's processor config, so training sees exactly what inference sees; `prompt_ids`
builds the same chat prompt as the adapter.
"""
from __future__ import annotations

import json
import os

import numpy as np

PATCH = 8
TEMPORAL_PATCH = 2
MERGE = 2
FRAME_SIZE = 96
IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]
IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]
MIN_PIXELS = 64 * 64
MAX_PIXELS = 96 * 96
SYSTEM = "You are a helpful assistant."

PROCESSOR_CONFIG = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "do_convert_rgb": True,
    "resample": 3,
    "patch_size": PATCH,
    "temporal_patch_size": TEMPORAL_PATCH,
    "merge_size": MERGE,
    "image_mean": IMAGE_MEAN,
    "image_std": IMAGE_STD,
    "min_pixels": MIN_PIXELS,
    "max_pixels": MAX_PIXELS,
    "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
}


def toy_config(vocab_size: int, special_ids: dict, hidden: int = 192, layers: int = 4,
               vision_embed: int = 96, vision_depth: int = 3, heads: int = 4, kv_heads: int = 2,
               rope_theta: float = 10000.0):
    from transformers import Qwen2VLConfig

    head_dim = hidden // heads
    half = head_dim // 2
    sec = [half // 3, half // 3, half - 2 * (half // 3)]
    return Qwen2VLConfig(
        text_config=dict(
            vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 32 * 32,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
            max_position_embeddings=32768, rms_norm_eps=1e-6,
            rope_parameters=dict(rope_type="default", rope_theta=rope_theta, mrope_section=sec),
            bos_token_id=special_ids["<|endoftext|>"], eos_token_id=special_ids["<|im_end|>"],
            pad_token_id=special_ids["<|endoftext|>"], tie_word_embeddings=False,
        ),
        vision_config=dict(
            depth=vision_depth, embed_dim=vision_embed, hidden_size=hidden, num_heads=4,
            patch_size=PATCH, temporal_patch_size=TEMPORAL_PATCH, spatial_merge_size=MERGE,
            mlp_ratio=4, in_channels=3,
        ),
        image_token_id=special_ids["<|image_pad|>"],
        video_token_id=special_ids["<|video_pad|>"],
        vision_start_token_id=special_ids["<|vision_start|>"],
        vision_end_token_id=special_ids["<|vision_end|>"],
        bos_token_id=special_ids["<|endoftext|>"],
        eos_token_id=special_ids["<|im_end|>"],
        pad_token_id=special_ids["<|endoftext|>"],
        tie_word_embeddings=False,
    )


def preprocess_frames(frames: np.ndarray, cfg: dict = PROCESSOR_CONFIG):
    """uint8 [T, H, W, 3] -> (pixel_values_videos [N, C*tp*p*p], video_grid_thw [[t, h, w]]),
    through the project's Qwen2-VL preprocessing (the same the adapter applies at inference)."""
    from ..adapters import qwen2vl_preprocess

    keys = ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels", "image_mean", "image_std")
    return qwen2vl_preprocess(frames, **{k: cfg[k] for k in keys})


def prompt_ids(tok, question: str, n_visual: int, special: dict) -> list[int]:
    """Token ids of the Qwen2-VL chat prompt with the video placeholder expanded to n_visual."""
    head = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
    ids = tok.encode(head, add_special_tokens=False)
    ids += [special["<|vision_start|>"]] + [special["<|video_pad|>"]] * n_visual + [special["<|vision_end|>"]]
    ids += tok.encode(f"{question}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    return ids


def save_processor_config(out_dir: str) -> None:
    with open(os.path.join(out_dir, "preprocessor_config.json"), "w") as f:
        json.dump(PROCESSOR_CONFIG, f, indent=2)
