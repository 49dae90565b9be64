"""Model adapters: the little each architecture needs beyond transformers' own model classes.

An adapter turns sampled frames and a question into the prefill inputs of its architecture,
without torchvision (PIL + numpy reproduce the resize, normalisation and patch layout of the
transformers processors), and says where the visual span is and which (frame, row, column) each
visual position shows, for the plots.
"""

from __future__ import annotations

import inspect
import json
import math
import os
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image

from .errors import InputError, ModelError

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass
class VideoInputs:
    """Prefill inputs of one (video, question) pair, batch size 1.

    model_kwargs: everything the prefill forward takes (input_ids [1, m], pixel values, grids...).
    visual_positions: LongTensor [m_v], sorted prompt positions of the visual tokens.
    token_grid: LongTensor [m_v, 3], (sampled-frame index, row, column) of each visual token.
    grid: (t, rows, cols) of the visual token grid; frames: the sampled frames [T, H, W, 3] uint8.
    vision: the video's vision-tower outputs once computed (`engine.encode`: "model", "outputs",
        "seconds"), shared by every question asked of the same video (`Adapter.build_questions`);
        empty before.
    """

    model_kwargs: dict
    visual_positions: torch.Tensor
    token_grid: torch.Tensor
    grid: tuple[int, int, int]
    frames: np.ndarray
    timestamps: list[float] = field(default_factory=list)
    vision: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def input_ids(self) -> torch.Tensor:
        return self.model_kwargs["input_ids"]

    @property
    def m(self) -> int:
        return self.input_ids.shape[1]

    @property
    def m_v(self) -> int:
        return int(self.visual_positions.numel())

    @property
    def query_start(self) -> int:
        """First prompt position after the last visual token: the query tokens start here."""
        return int(self.visual_positions[-1]) + 1 if self.m_v else 0

    def to(self, device) -> "VideoInputs":
        kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.model_kwargs.items()}
        return VideoInputs(kw, self.visual_positions, self.token_grid, self.grid, self.frames, self.timestamps,
                           self.vision)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's resize rule: both sides multiples of `factor`, area within [min_pixels, max_pixels]."""
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def resize_normalize(frames: np.ndarray, height: int, width: int, mean, std) -> np.ndarray:
    """[T, H, W, 3] uint8 -> [T, 3, height, width] float32, bicubic resize, rescale 1/255, normalise."""
    out = np.empty((len(frames), 3, height, width), dtype=np.float32)
    mean = np.asarray(mean, np.float32)[:, None, None]
    std = np.asarray(std, np.float32)[:, None, None]
    for i, frame in enumerate(frames):
        img = Image.fromarray(frame)
        if img.size != (width, height):
            img = img.resize((width, height), Image.BICUBIC)
        out[i] = (np.asarray(img, np.float32).transpose(2, 0, 1) / 255.0 - mean) / std
    return out


def qwen2vl_preprocess(frames: np.ndarray, patch_size=14, temporal_patch_size=2, merge_size=2,
                       min_pixels=128 * 28 * 28, max_pixels=768 * 28 * 28,
                       image_mean=CLIP_MEAN, image_std=CLIP_STD) -> tuple[torch.Tensor, torch.Tensor]:
    """Frames [T, H, W, 3] uint8 -> (pixel_values_videos [t*h*w, 3*tp*p*p], video_grid_thw [1, 3]).

    Same resize rule and patch order as transformers' Qwen2-VL video processor: frames padded to a
    multiple of `temporal_patch_size` by repeating the last one, patches ordered so that each run of
    merge_size**2 patches forms one merged visual token.
    """
    T, H, W, _ = frames.shape
    h, w = smart_resize(H, W, patch_size * merge_size, min_pixels, max_pixels)
    x = resize_normalize(frames, h, w, image_mean, image_std)
    if pad := -T % temporal_patch_size:
        x = np.concatenate([x, np.repeat(x[-1:], pad, axis=0)])
    gt, gh, gw = x.shape[0] // temporal_patch_size, h // patch_size, w // patch_size
    p, m, tp = patch_size, merge_size, temporal_patch_size
    x = x.reshape(gt, tp, 3, gh // m, m, p, gw // m, m, p)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    x = x.reshape(gt * gh * gw, 3 * tp * p * p)
    return torch.from_numpy(np.ascontiguousarray(x)), torch.tensor([[gt, gh, gw]])


def read_json(name_or_dir: str, filename: str) -> dict | None:
    """A JSON file of a model folder or (cached) hub repo, or None if it has none."""
    text = read_text(name_or_dir, filename)
    return None if text is None else json.loads(text)


class Adapter:
    """Base: prompt building and the visual span. Subclasses define `build_inputs`."""

    arch = ""

    def __init__(self, name_or_dir: str, config, tokenizer):
        self.name, self.config, self.tokenizer = name_or_dir, config, tokenizer

    def build_inputs(self, frames: np.ndarray, question: str, timestamps=None,
                     video: VideoInputs | None = None) -> VideoInputs:
        """The prefill inputs of one question on `frames`. `video`: inputs of another question on the
        same frames, whose pixel tensors and vision-tower outputs these share (not preprocessed again)."""
        raise NotImplementedError

    def build_questions(self, frames: np.ndarray, questions: list[str], timestamps=None,
                        device=None) -> list[VideoInputs]:
        """One `build_inputs` per question on one video (a batch of questions): the video is
        preprocessed once, moved to `device` once, and encoded by the vision tower once for all of
        them (`engine.encode`); only the questions' tokens differ."""
        def moved(x: VideoInputs) -> VideoInputs:
            return x if device is None else x.to(device)

        first = moved(self.build_inputs(frames, questions[0], timestamps))
        return [first] + [moved(self.build_inputs(frames, q, timestamps, video=first)) for q in questions[1:]]

    def positions(self, model, inputs: "VideoInputs") -> tuple[torch.Tensor | None, int]:
        """(the prompt's position ids for the prefill, or None to let the model number them 0..m-1;
        the position of the first token fed after the prompt). Read-only on the model."""
        return None, inputs.m

    def position_ids(self, start: int, q: int, device) -> torch.Tensor:
        """Positions of q tokens fed from position `start`, as the language model takes them: [1, q]."""
        return torch.arange(start, start + q, device=device)[None]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    # stands for the question while the chat text around it is built and tokenised (never in a question:
    # `check_question` refuses NUL characters)
    QUESTION = "\x00question\x00"

    def prompt_ids(self, before: str, after: str, question: str) -> tuple[list[int], list[int]]:
        """Token ids of the chat text before and after the video tokens, `after` holding QUESTION.
        The question is tokenised as text only: a `<|im_end|>` or `<|video_pad|>` typed in it stays
        characters, never a control token (the template's own special tokens are tokenised as such)."""
        head, tail = after.split(self.QUESTION)
        question_ids = self.tokenizer(question, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        return self.encode(before), self.encode(head) + question_ids + self.encode(tail)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True).strip()

    @property
    def eos_token_ids(self) -> list[int]:
        ids = set()
        for tok in ("<|im_end|>", "<|endoftext|>"):
            i = self.tokenizer.convert_tokens_to_ids(tok)
            if isinstance(i, int) and i != self.tokenizer.unk_token_id:
                ids.add(i)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        gen = getattr(self.config, "eos_token_id", None)
        ids.update([gen] if isinstance(gen, int) else (gen or []))
        return sorted(ids)


def check_question(question: str, max_chars: int = 1000) -> str:
    question = (question or "").strip()
    if not question:
        raise InputError("The question is empty: type a question about the video.")
    if "\x00" in question:
        raise InputError("The question holds a NUL character; type it as plain text.")
    if len(question) > max_chars:
        raise InputError(f"The question is {len(question)} characters long; the limit is {max_chars}.")
    return question


class Qwen2VLAdapter(Adapter):
    """Qwen2-VL and Qwen2.5-VL: one `<|video_pad|>` per merged visual token, 3-D M-RoPE."""

    arch = "qwen2_vl"
    system = "You are a helpful assistant."
    # Video defaults of transformers' Qwen2-VL video processor (per-frame pixel range).
    video_min_pixels, video_max_pixels = 128 * 28 * 28, 768 * 28 * 28

    def __init__(self, name_or_dir, config, tokenizer):
        super().__init__(name_or_dir, config, tokenizer)
        cfg = read_json(name_or_dir, "video_preprocessor_config.json") or read_json(
            name_or_dir, "preprocessor_config.json") or {}
        size = cfg.get("size") or {}
        vis = config.vision_config
        self.pre = dict(
            patch_size=cfg.get("patch_size", vis.patch_size),
            temporal_patch_size=cfg.get("temporal_patch_size", vis.temporal_patch_size),
            merge_size=cfg.get("merge_size", vis.spatial_merge_size),
            min_pixels=cfg.get("min_pixels", size.get("shortest_edge", self.video_min_pixels)),
            max_pixels=min(cfg.get("max_pixels", size.get("longest_edge", self.video_max_pixels)),
                           self.video_max_pixels),
            image_mean=cfg.get("image_mean", CLIP_MEAN),
            image_std=cfg.get("image_std", CLIP_STD),
        )
        self.video_token_id = tokenizer.convert_tokens_to_ids("<|video_pad|>")

    def positions(self, model, inputs: "VideoInputs") -> tuple[torch.Tensor, int]:
        """M-RoPE: the prompt's 3-D positions [3, 1, m] (`get_rope_index`, passed to the prefill so
        that transformers keeps no `rope_deltas` state on the model), and the first decode position:
        the prompt's largest position + 1, as one forward over prompt + answer places it.
        (transformers' own cached steps add `rope_deltas` taken from the video's largest temporal
        index, which on long clips is far past the text: a 256-frame prompt ended at 31 and decoding
        went on at 143.)"""
        inner = model.model
        params = inspect.signature(inner.get_rope_index).parameters
        kw = {k: v for k, v in inputs.model_kwargs.items() if k in params and k != "input_ids"}
        pos, _ = inner.get_rope_index(inputs.input_ids, **kw)  # [3, 1, m]
        return pos, int(pos[:, 0, -1].max()) + 1

    def position_ids(self, start: int, q: int, device) -> torch.Tensor:
        """The same position on the temporal, height and width axes: [3, 1, q]."""
        return torch.arange(start, start + q, device=device).view(1, 1, q).expand(3, 1, q)

    def prompt_parts(self, question: str) -> tuple[str, str]:
        """Chat text before and after the video tokens."""
        before = (f"<|im_start|>system\n{self.system}<|im_end|>\n"
                  "<|im_start|>user\n<|vision_start|>")
        after = f"<|vision_end|>{question}<|im_end|>\n<|im_start|>assistant\n"
        return before, after

    def build_inputs(self, frames: np.ndarray, question: str, timestamps=None,
                     video: VideoInputs | None = None) -> VideoInputs:
        question = check_question(question)
        if video is None:
            pixel_values, grid_thw = qwen2vl_preprocess(frames, **self.pre)
        else:
            pixel_values, grid_thw = video.model_kwargs["pixel_values_videos"], video.model_kwargs["video_grid_thw"]
        t, h, w = (int(v) for v in grid_thw[0])
        m = self.pre["merge_size"]
        rows, cols = h // m, w // m
        n_vis = t * rows * cols
        pre_ids, post_ids = self.prompt_ids(*self.prompt_parts(self.QUESTION), question)
        ids = pre_ids + [self.video_token_id] * n_vis + post_ids
        input_ids = torch.tensor([ids])
        mm_types = torch.zeros_like(input_ids, dtype=torch.int32)
        start = len(pre_ids)
        mm_types[0, start:start + n_vis] = 2
        kwargs = dict(input_ids=input_ids, pixel_values_videos=pixel_values, video_grid_thw=grid_thw,
                      mm_token_type_ids=mm_types)
        if self.config.model_type == "qwen2_5_vl":
            fps = _sampled_fps(timestamps, len(frames))
            kwargs["second_per_grid_ts"] = torch.tensor([self.pre["temporal_patch_size"] / fps])
        idx = torch.arange(n_vis)
        tp = self.pre["temporal_patch_size"]
        frame = torch.clamp((idx // (rows * cols)) * tp, max=len(frames) - 1)
        grid = torch.stack([frame, (idx % (rows * cols)) // cols, idx % cols], dim=1)
        return VideoInputs(kwargs, torch.arange(start, start + n_vis), grid, (t, rows, cols), frames,
                           list(timestamps or []), {} if video is None else video.vision)


def read_text(name_or_dir: str, filename: str) -> str | None:
    """A text file of a model folder or (cached) hub repo, or None if it has none."""
    if os.path.isdir(name_or_dir):
        path = os.path.join(name_or_dir, filename)
        if not os.path.exists(path):
            return None
    else:
        from transformers.utils import cached_file

        path = cached_file(name_or_dir, filename, _raise_exceptions_for_missing_entries=False)
        if path is None:
            return None
    with open(path, encoding="utf-8") as f:
        return f.read()


def llava_onevision_preprocess(frames: np.ndarray, size: int, image_mean=CLIP_MEAN, image_std=CLIP_STD) -> torch.Tensor:
    """Frames [T, H, W, 3] uint8 -> pixel_values_videos [1, T, 3, size, size] float32.

    As transformers' LLaVA-OneVision video processor: every frame resized to size x size (aspect
    ratio not kept, no padding), bicubic, rescaled by 1/255, normalised with the processor's
    mean/std. Identical to the PIL backend of transformers' LLaVA-OneVision image processor
    (tested); the torchvision video processor's antialiased bicubic uses a slightly different
    kernel, so its pixel values differ by small interpolation differences, not in layout.
    """
    x = resize_normalize(frames, size, size, image_mean, image_std)
    return torch.from_numpy(x)[None]


class LlavaOnevisionAdapter(Adapter):
    """LLaVA-OneVision (and LLaVA-Video checkpoints, same class).

    Each frame goes through the SigLIP tower at `image_size` (384 for real checkpoints: a
    n x n patch grid, n = image_size // patch_size = 27), is projected, then bilinearly pooled to
    ceil(n/2) x ceil(n/2) tokens (14 x 14 = 196 per frame), frames one after the other, each
    frame row-major. One learned `image_newline` embedding follows the last frame, so the prompt
    holds T * rows * cols + 1 `<video>` tokens (the processor's count). The newline is part of
    the visual span (it is a `<video>` position filled by the vision module); its `token_grid`
    entry is the last cell of the last frame (T-1, rows-1, cols-1), so plots never see an
    out-of-range cell; `newline_position` names it.
    """

    arch = "llava_onevision"
    # The chat format the llava-hf checkpoints' shipped chat template renders for one user turn
    # with a video and a question (no system turn); used when the folder has no usable template.
    default_template = "<|im_start|>user <video>\n{question}<|im_end|><|im_start|>assistant\n"

    def __init__(self, name_or_dir, config, tokenizer):
        super().__init__(name_or_dir, config, tokenizer)
        cfg = read_json(name_or_dir, "video_preprocessor_config.json") or read_json(
            name_or_dir, "preprocessor_config.json") or {}
        vis = config.vision_config
        # Frames are resized to the tower's image_size: the processor's `size` says the same for
        # real checkpoints, and the model pools a fixed (image_size // patch_size)^2 grid, so no
        # other size could run.
        self.size = int(vis.image_size)
        self.patch_size = int(vis.patch_size)
        n = self.size // self.patch_size
        self.rows = self.cols = math.ceil(n / 2)
        self.image_mean = tuple(cfg.get("image_mean", CLIP_MEAN))
        self.image_std = tuple(cfg.get("image_std", CLIP_STD))
        self.video_token = getattr(tokenizer, "video_token", None) or "<video>"
        self.video_token_id = int(config.video_token_id)
        self.chat_template = self._find_template(name_or_dir)

    def _find_template(self, name_or_dir) -> str | None:
        """The processor's chat template (chat_template.json / .jinja), else the tokenizer's."""
        cands = []
        j = read_json(name_or_dir, "chat_template.json")
        if j and isinstance(j.get("chat_template"), str):
            cands.append(j["chat_template"])
        cands.append(read_text(name_or_dir, "chat_template.jinja"))
        if isinstance(getattr(self.tokenizer, "chat_template", None), str):
            cands.append(self.tokenizer.chat_template)
        for tmpl in cands:
            if tmpl and self._render(tmpl, "Q") is not None:
                return tmpl
        return None

    def _render(self, tmpl: str, question: str) -> tuple[str, str] | None:
        """(before, after) the video token of a one-turn chat, or None if the template does not
        place exactly one video token before the question."""
        conv = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]}]
        try:
            text = self.tokenizer.apply_chat_template(conv, chat_template=tmpl, add_generation_prompt=True,
                                                      tokenize=False)
        except Exception:
            return None
        if not isinstance(text, str) or text.count(self.video_token) != 1:
            return None
        before, after = text.split(self.video_token)
        if question not in after:
            return None
        return before, after

    def prompt_parts(self, question: str) -> tuple[str, str]:
        """Chat text before and after the video tokens."""
        if self.chat_template is not None:
            parts = self._render(self.chat_template, question)
            if parts is not None:
                return parts
        before, after = self.default_template.split("<video>")
        return before, after.format(question=question)

    def build_inputs(self, frames: np.ndarray, question: str, timestamps=None,
                     video: VideoInputs | None = None) -> VideoInputs:
        question = check_question(question)
        T = len(frames)
        pixel_values = (llava_onevision_preprocess(frames, self.size, self.image_mean, self.image_std)
                        if video is None else video.model_kwargs["pixel_values_videos"])
        rows, cols = self.rows, self.cols
        per_frame = rows * cols
        n_vis = T * per_frame + 1  # + the image_newline after the last frame
        pre_ids, post_ids = self.prompt_ids(*self.prompt_parts(self.QUESTION), question)
        ids = pre_ids + [self.video_token_id] * n_vis + post_ids
        input_ids = torch.tensor([ids])
        kwargs = dict(input_ids=input_ids, pixel_values_videos=pixel_values)
        idx = torch.arange(n_vis - 1)
        grid = torch.stack([idx // per_frame, (idx % per_frame) // cols, idx % cols], dim=1)
        grid = torch.cat([grid, torch.tensor([[T - 1, rows - 1, cols - 1]])])
        start = len(pre_ids)
        return VideoInputs(kwargs, torch.arange(start, start + n_vis), grid, (T, rows, cols), frames,
                           list(timestamps or []), {} if video is None else video.vision)

    @staticmethod
    def newline_position(inputs: VideoInputs) -> int:
        """Prompt position of the image_newline token (the last visual position)."""
        return int(inputs.visual_positions[-1])


def _sampled_fps(timestamps, n: int) -> float:
    if timestamps is not None and len(timestamps) > 1 and timestamps[-1] > timestamps[0]:
        return (len(timestamps) - 1) / (timestamps[-1] - timestamps[0])
    return 1.0


def text_step(model, input_ids: torch.Tensor, position_ids: torch.Tensor, cache, num_layers: int | None = None):
    """Logits [1, q, V] of tokens fed after the prompt, through the language model's own modules:
    embeddings, the first `num_layers` decoder layers (all by default), final norm, LM head.

    The same for the three architectures (their text models are Qwen2-style stacks); positions
    come from the adapter (`position_ids`), so no multimodal wrapper work runs per step and nothing
    is written on the model. A first-L-layers view (LayerSkip's draft) is `num_layers = L`.
    """
    lm = model.model.language_model
    h = lm.embed_tokens(input_ids)
    pe = lm.rotary_emb(h, position_ids)
    for layer in lm.layers[:num_layers]:
        h = layer(h, attention_mask=None, position_embeddings=pe, past_key_values=cache, use_cache=True)
    return model.lm_head(lm.norm(h))


ADAPTERS: dict[str, type[Adapter]] = {"qwen2_vl": Qwen2VLAdapter, "qwen2_5_vl": Qwen2VLAdapter,
                                      "llava_onevision": LlavaOnevisionAdapter}


def adapter_for(name_or_dir: str, config, tokenizer) -> Adapter:
    cls = ADAPTERS.get(config.model_type)
    if cls is None:
        raise ModelError(f"Model type '{config.model_type}' is not supported; supported: "
                         f"{', '.join(sorted(ADAPTERS))}.")
    return cls(name_or_dir, config, tokenizer)
