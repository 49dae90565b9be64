"""SparseMM's visual-head calibration (the SparseMM paper's visual-head score) and the store of its scores.

Show the model inputs whose content location is known, let it generate greedily with dense
attention, and for each generated token that names exactly one known item, give every query head
whose top-1 attended key is a visual position inside that item's region a hit of
1 / (region size in visual tokens). Hits are averaged over samples, normalised to sum 1 and summed
within each KV group. Sources are pluggable: `TextImages` (rendered words at known boxes, "Provide
all the OCR results of this image.") for any model; the embedded model's clips
(`sparsevid.toy.calibration.ToyClips`) for the embedded model. The scores are kept in a JSON file
keyed by model name and revision (`load_scores` finds it: shipped in assets/visual_heads/, else the
user cache) and given to the SparseMM policy by the runner.

CLI: `python -m sparsevid calibrate --model NAME_OR_DIR [--samples N] [--out FILE]`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Iterator, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from .engine import new_run, prefill, step
from .metrics import top_share
from .models import ASSETS, EMBEDDED, Loaded, resolve

OCR_IMAGE = "Provide all the OCR results of this image."
OCR_VIDEO = "Provide all the OCR results of this video."
SHIPPED_DIR = os.path.join(ASSETS, "visual_heads")


def cache_dir() -> str:
    """Where calibrations are written by default: $SPARSEVID_CACHE or ~/.cache/sparsevid, /visual_heads."""
    root = os.environ.get("SPARSEVID_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "sparsevid")
    return os.path.join(root, "visual_heads")


# --------------------------------------------------------------------------------------------------
# Head scores and their file
# --------------------------------------------------------------------------------------------------


@dataclass
class HeadScores:
    """Visual-head scores of one model.

    scores [L, Hkv]: per KV head (query heads of a group summed), sum 1.
    head_scores [L, H]: per query head, sum 1 (the layer x head map of the plots).
    meta: model, revision, source, samples, hits, uniform (True when no hit was counted) ...
    """

    scores: torch.Tensor
    head_scores: torch.Tensor
    meta: dict = field(default_factory=dict)

    @classmethod
    def from_hits(cls, hits: torch.Tensor, num_kv_heads: int, meta: dict | None = None) -> "HeadScores":
        """hits [L, H] (averaged over samples) -> normalised scores; uniform if there are none."""
        meta = dict(meta or {})
        hits = hits.double().clamp_min(0)
        meta["uniform"] = bool(hits.sum() <= 0)
        if meta["uniform"]:
            hits = torch.ones_like(hits)
        head = hits / hits.sum()
        L, H = head.shape
        kv = head.view(L, num_kv_heads, H // num_kv_heads).sum(-1)
        return cls(kv.float(), head.float(), meta)

    @classmethod
    def uniform(cls, num_layers: int, num_heads: int, num_kv_heads: int, **meta) -> "HeadScores":
        return cls.from_hits(torch.zeros(num_layers, num_heads), num_kv_heads, meta)

    def top_mass(self, frac: float = 0.05, kv: bool = False) -> float:
        """Share of the score mass held by the top `frac` of heads (query heads, or KV heads)."""
        return top_share((self.scores if kv else self.head_scores).numpy(), frac)

    def to_json(self) -> dict:
        meta = {k: v for k, v in self.meta.items() if k != "file"}
        return dict(meta, scores=self.scores.tolist(), head_scores=self.head_scores.tolist(),
                    top5_mass=self.top_mass(), top5_mass_kv=self.top_mass(kv=True))

    def save(self, path: str) -> str:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, indent=1)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str) -> "HeadScores":
        with open(path) as f:
            d = json.load(f)
        meta = {k: v for k, v in d.items() if k not in ("scores", "head_scores")}
        meta["file"] = path
        return cls(torch.tensor(d["scores"]), torch.tensor(d["head_scores"]), meta)


def _fingerprint(folder: str) -> str:
    """Short hash of a local model folder's weights (size, head and tail of each safetensors file),
    computed once per folder state (the files' names, sizes and modification times)."""
    names = sorted(n for n in os.listdir(folder) if n.endswith((".safetensors", ".bin")) or n == "config.json")
    state = tuple((n, os.stat(os.path.join(folder, n)).st_size, os.stat(os.path.join(folder, n)).st_mtime_ns)
                  for n in names)
    return _hash_weights(folder, state)


@functools.lru_cache(maxsize=16)
def _hash_weights(folder: str, state: tuple) -> str:
    h = hashlib.sha256()
    for name, size, _ in state:
        h.update(f"{name}:{size}".encode())
        with open(os.path.join(folder, name), "rb") as f:
            h.update(f.read(1 << 20))
            if size > 2 << 20:
                f.seek(-(1 << 20), os.SEEK_END)
                h.update(f.read())
    return h.hexdigest()[:12]


def model_key(loaded: Loaded) -> str:
    """File-name-safe '<name>-<revision>': the hub id and commit, or a local folder's name and a hash of
    its weights (local folders have no revision; the hash keeps a retrained model from reusing a stale file)."""
    path = resolve(loaded.name)
    if os.path.isdir(path):
        name = os.path.basename(os.path.normpath(path))
        rev = loaded.revision if loaded.revision != "local" else f"local{_fingerprint(path)}"
    else:
        name, rev = loaded.name.replace("/", "--"), loaded.revision
    return re.sub(r"[^A-Za-z0-9._-]+", "-", f"{name}-{rev}")


def scores_path(loaded: Loaded) -> str:
    """Default calibration file of a model (in the user's cache)."""
    return os.path.join(cache_dir(), model_key(loaded) + ".json")


def find_scores(loaded: Loaded, path: str | None = None) -> str | None:
    """The calibration file to use: `path`, else one shipped in assets/visual_heads/, else the cache's."""
    key = model_key(loaded) + ".json"
    for p in ([path] if path else []) + [os.path.join(SHIPPED_DIR, key), os.path.join(cache_dir(), key)]:
        if p and os.path.exists(p):
            return p
    return None


_LOADED_SCORES: dict[str, HeadScores] = {}


def load_scores(loaded: Loaded, path: str | None = None) -> HeadScores:
    """The model's calibrated scores, or uniform scores with a warning when it has no calibration."""
    found = find_scores(loaded, path)
    if found is None:
        key = model_key(loaded)
        if key not in _LOADED_SCORES:
            warnings.warn(f"SparseMM: no visual-head calibration for '{loaded.name}'; using uniform head scores "
                          f"(plain SnapKV budgets). Run: python -m sparsevid calibrate --model {loaded.name}",
                          RuntimeWarning, stacklevel=2)
            _LOADED_SCORES[key] = HeadScores.uniform(loaded.num_layers, loaded.num_heads, loaded.num_kv_heads,
                                                     model=loaded.name, source="none")
        return _LOADED_SCORES[key]
    if found not in _LOADED_SCORES:
        hs = HeadScores.load(found)
        if tuple(hs.scores.shape) != (loaded.num_layers, loaded.num_kv_heads):
            from .errors import ModelError

            raise ModelError(f"Calibration file {found} has shape {tuple(hs.scores.shape)}, the model has "
                             f"{loaded.num_layers} layers x {loaded.num_kv_heads} KV heads.")
        _LOADED_SCORES[found] = hs
    return _LOADED_SCORES[found]


# --------------------------------------------------------------------------------------------------
# Calibration sources
# --------------------------------------------------------------------------------------------------


@dataclass
class Item:
    """Something the model may name. words: lower-case words naming it; boxes [T, 4] int pixel boxes
    (x0, y0, x1, y1), end exclusive, per frame; x0 < 0 where the item is not visible."""

    words: tuple[str, ...]
    boxes: np.ndarray


@dataclass
class CalibSample:
    frames: np.ndarray  # [T, H, W, 3] uint8
    question: str
    items: list[Item]


class Source(Protocol):
    name: str

    def samples(self, loaded: Loaded, n: int) -> Iterator[CalibSample]: ...


# Words for the text images: common, short, distinct; the tiny test tokenizer knows the first group.
WORDS = ("red green blue yellow circle square triangle left right up down one two three video object "
         "apple river house paper music table garden window summer orange purple winter bread coffee "
         "planet silver market doctor friend school pencil rabbit castle candle island forest bottle "
         "mirror rocket violin dragon tomato button camera ticket butter lemon tiger piano horse cloud "
         "light water night train heart smile bridge flower sugar field").split()


def _font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: fixed bitmap font
        return ImageFont.load_default()


class TextImages:
    """Rendered text images (no OCR engine needed): `words` words in a grid of cells on a light
    background, dark text at a random offset inside each cell, the box of each word's ink known.
    Sample i shows the image as a still "video" of `frames[i % len(frames)]` frames (1 = a single
    frame, asked with the image prompt)."""

    name = "text-images"

    def __init__(self, size: int = 448, words: int = 9, frames: tuple[int, ...] = (1, 4), seed: int = 0):
        self.size, self.n_words, self.frames, self.seed = size, words, frames, seed

    def vocabulary(self, loaded: Loaded) -> list[str]:
        """The words that the tokenizer encodes without unknown tokens, in at most 3 tokens."""
        tok = loaded.tokenizer
        out = []
        for w in dict.fromkeys(WORDS):
            ids = loaded.adapter.encode(" " + w)
            if 0 < len(ids) <= 3 and tok.unk_token_id not in ids:
                out.append(w)
        return out

    def render(self, words: list[str], rng: np.random.Generator) -> tuple[np.ndarray, list[tuple[int, ...]]]:
        """-> (image [S, S, 3] uint8, one (x0, y0, x1, y1) box per word)."""
        from PIL import Image, ImageDraw

        S = self.size
        cols = math.ceil(math.sqrt(len(words)))
        rows = math.ceil(len(words) / cols)
        cw, ch = S // cols, S // rows
        longest = max(len(w) for w in words)
        font = _font(max(8, min(int(ch * 0.45), int(cw * 0.9 / (0.6 * longest)))))
        bg = tuple(int(v) for v in rng.integers(215, 256, size=3))
        img = Image.new("RGB", (S, S), bg)
        draw = ImageDraw.Draw(img)
        boxes = []
        for i, w in enumerate(words):
            r, c = divmod(i, cols)
            l, t, rgt, b = draw.textbbox((0, 0), w, font=font)
            x = c * cw + int(rng.integers(0, max(1, cw - (rgt - l)))) - l
            y = r * ch + int(rng.integers(0, max(1, ch - (b - t)))) - t
            ink = tuple(int(v) for v in rng.integers(0, 90, size=3))
            draw.text((x, y), w, fill=ink, font=font)
            boxes.append(tuple(int(v) for v in draw.textbbox((x, y), w, font=font)))
        return np.asarray(img), boxes

    def samples(self, loaded: Loaded, n: int) -> Iterator[CalibSample]:
        vocab = self.vocabulary(loaded)
        if len(vocab) < 2:
            from .errors import ModelError

            raise ModelError("SparseMM calibration: the tokenizer knows too few of the rendered words.")
        rng = np.random.default_rng(self.seed)
        for i in range(n):
            words = [str(w) for w in rng.choice(vocab, size=min(self.n_words, len(vocab)), replace=False)]
            img, boxes = self.render(words, rng)
            T = self.frames[i % len(self.frames)]
            items = [Item((w,), np.repeat(np.array([b]), T, 0)) for w, b in zip(words, boxes)]
            yield CalibSample(np.repeat(img[None], T, 0), OCR_IMAGE if T == 1 else OCR_VIDEO, items)


def is_embedded(loaded: Loaded) -> bool:
    path = resolve(loaded.name)
    return os.path.isdir(path) and (os.path.realpath(path) == os.path.realpath(EMBEDDED)
                                    or os.path.exists(os.path.join(path, "toy_training.json")))


# --------------------------------------------------------------------------------------------------
# Hit counting (shared by every source)
# --------------------------------------------------------------------------------------------------


def item_regions(inputs, items: list[Item], exclude: list[int] = (), min_cover: float = 0.25) -> torch.Tensor:
    """bool [n_items, m]: the visual prompt positions inside each item's region.

    A visual token (frame f, row r, col c of `inputs.token_grid`) covers the pixel cell
    [c·W/cols, (c+1)·W/cols) x [r·H/rows, (r+1)·H/rows) of the frames f .. f + T/t − 1 (Qwen2-VL
    merges 2 frames per token); it lies in the item's region when, in one of those frames, the
    item's box covers at least `min_cover` of the cell or contains the cell holding the box centre.
    `exclude`: prompt positions that are not frame cells (LLaVA-OneVision's newline token).
    """
    T, H, W = inputs.frames.shape[:3]
    t, rows, cols = inputs.grid
    span = max(1, round(T / t))
    g = inputs.token_grid.numpy()
    f0, r, c = g[:, 0], g[:, 1], g[:, 2]
    cx0, cx1 = c * W / cols, (c + 1) * W / cols
    cy0, cy1 = r * H / rows, (r + 1) * H / rows
    out = torch.zeros(len(items), inputs.m, dtype=torch.bool)
    for i, item in enumerate(items):
        inside = np.zeros(len(g), dtype=bool)
        for o in range(span):
            b = item.boxes[np.minimum(f0 + o, T - 1)].astype(np.float64)  # [m_v, 4]
            ow = np.clip(np.minimum(cx1, b[:, 2]) - np.maximum(cx0, b[:, 0]), 0, None)
            oh = np.clip(np.minimum(cy1, b[:, 3]) - np.maximum(cy0, b[:, 1]), 0, None)
            mx, my = (b[:, 0] + b[:, 2]) / 2, (b[:, 1] + b[:, 3]) / 2
            centre = (mx >= cx0) & (mx < cx1) & (my >= cy0) & (my < cy1)
            cover = ow * oh >= min_cover * (W / cols) * (H / rows)
            inside |= (b[:, 0] >= 0) & (cover | centre)
        out[i, inputs.visual_positions[torch.from_numpy(inside)]] = True
    if len(exclude):
        out[:, list(exclude)] = False
    return out


def _norm_word(text: str) -> str:
    return re.sub(r"[^0-9a-z]", "", text.lower())


def named_item(token_text: str, items: list[Item]) -> int | None:
    """Index of the one item a generated token names, or None (no item, or more than one).

    The token names an item when its letters equal one of the item's words, or (a sub-word piece of
    at least 2 letters) occur inside one.
    """
    t = _norm_word(token_text)
    if not t:
        return None
    hits = [i for i, it in enumerate(items) if any(t == w or (len(t) >= 2 and t in w) for w in it.words)]
    return hits[0] if len(hits) == 1 else None


def _drop_last_token(inputs):
    """The same inputs without the last prompt token (fed afterwards as a decode step, so that the
    attention which produces the first generated token goes through the decode hook too)."""
    m = inputs.m
    kw = {k: (v[:, :-1] if isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape[0] == 1 and v.shape[1] == m
              else v) for k, v in inputs.model_kwargs.items()}
    return type(inputs)(kw, inputs.visual_positions, inputs.token_grid, inputs.grid, inputs.frames,
                        inputs.timestamps, inputs.vision)  # the same video: its vision-tower outputs shared


@torch.inference_mode()
def generate_top1(loaded: Loaded, inputs, max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy dense generation, recording the attention behind each token.

    Returns (tokens, top1 [n, L, H]): for generated token i, the key position each query head
    attends most in the forward step that produced it (argmax over all keys, as the official code).
    """
    L, H = loaded.num_layers, loaded.num_heads
    last = int(inputs.input_ids[0, -1])
    run = new_run(loaded, _drop_last_token(inputs), max_new_tokens + 2)
    cur = torch.zeros(L, H, dtype=torch.long)

    def hook(layer: int, query: torch.Tensor, key: torch.Tensor, scale: float) -> None:
        Hkv, D = key.shape[1], key.shape[3]
        q = query[0, :, -1].float().view(Hkv, H // Hkv, D)
        cur[layer] = torch.einsum("hgd,hnd->hgn", q, key[0].float()).argmax(-1).flatten().cpu()

    run.on_decode_attention = hook
    prefill(loaded, _drop_last_token(inputs), run)
    eos = set(loaded.adapter.eos_token_ids)
    tokens, top1, feed = [], [], last
    for _ in range(max_new_tokens):
        tok = int(step(loaded, run, [feed])[-1].argmax())
        tokens.append(tok)
        top1.append(cur.clone())
        if tok in eos:
            break
        feed = tok
    return tokens, torch.stack(top1)


def sample_hits(loaded: Loaded, sample: CalibSample, max_new_tokens: int) -> tuple[torch.Tensor, dict]:
    """One sample's hits [L, H] (sum over its generated tokens of 1 / region size per head whose
    top-1 key lies in the named item's region), and counts for the report."""
    adapter = loaded.adapter
    inputs = adapter.build_inputs(sample.frames, sample.question).to(loaded.device)
    exclude = [adapter.newline_position(inputs)] if hasattr(adapter, "newline_position") else []
    regions = item_regions(inputs, sample.items, exclude)  # [n_items, m]
    regions = F.pad(regions, (0, max_new_tokens + 2))  # generated positions are never inside
    sizes = regions.sum(1)
    tokens, top1 = generate_top1(loaded, inputs, max_new_tokens)
    hits = torch.zeros(loaded.num_layers, loaded.num_heads, dtype=torch.float64)
    named = 0
    for tok, t1 in zip(tokens, top1):
        i = named_item(adapter.tokenizer.decode([tok], skip_special_tokens=True), sample.items)
        if i is None or sizes[i] == 0:
            continue
        named += 1
        hits += regions[i][t1].double() / float(sizes[i])
    return hits, dict(tokens=len(tokens), named=named, head_hits=int((hits > 0).sum()))


def calibrate(loaded: Loaded, samples: int = 32, progress: bool = True, out: str | None = None,
              source: Source | None = None, max_new_tokens: int = 48, force: bool = False) -> HeadScores:
    """Visual-head scores of `loaded` (the SparseMM paper's visual-head score), reused from `out` (default: the cache file
    keyed by model name and revision, or the file shipped in assets/) unless `force`."""
    found = out if out else find_scores(loaded)
    if found and os.path.exists(found) and not force:
        return HeadScores.load(found)
    path = out or scores_path(loaded)
    from tqdm import tqdm

    source = source or TextImages()
    total = torch.zeros(loaded.num_layers, loaded.num_heads, dtype=torch.float64)
    counts = dict(tokens=0, named=0)
    t0 = time.perf_counter()
    bar = tqdm(source.samples(loaded, samples), total=samples, desc="calibrating visual heads", unit="sample",
               disable=not progress, file=sys.stderr)
    for sample in bar:
        hits, c = sample_hits(loaded, sample, max_new_tokens)
        total += hits
        counts["tokens"] += c["tokens"]
        counts["named"] += c["named"]
        bar.set_postfix(named=counts["named"])
    meta = dict(model=loaded.name, revision=loaded.revision, key=model_key(loaded), arch=loaded.model.config.model_type,
                source=source.name, samples=samples, max_new_tokens=max_new_tokens, generated_tokens=counts["tokens"],
                named_tokens=counts["named"], seconds=round(time.perf_counter() - t0, 1),
                created=time.strftime("%Y-%m-%dT%H:%M:%S"))
    hs = HeadScores.from_hits(total / max(samples, 1), loaded.num_kv_heads, meta)
    if hs.meta["uniform"]:
        warnings.warn(f"SparseMM calibration of '{loaded.name}': no head's top-1 key fell on the item a "
                      f"generated token named ({counts['named']} of {counts['tokens']} tokens named one); the scores are "
                      "uniform. Try more --samples.", RuntimeWarning, stacklevel=2)
    hs.save(path)
    hs.meta["file"] = path
    _LOADED_SCORES.pop(path, None)
    return hs


def format_map(hs: HeadScores) -> str:
    """The layer x query-head score map as text (percent of the total)."""
    L, H = hs.head_scores.shape
    lines = ["layer | " + " ".join(f"h{h:<3d}" for h in range(H))]
    for l in range(L):
        lines.append(f"{l:5d} | " + " ".join(f"{100 * v:4.1f}" for v in hs.head_scores[l].tolist()))
    return "\n".join(lines)
