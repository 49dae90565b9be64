"""Procedural clips for the embedded toy Video-LLM.

Coloured shapes (circle, square, triangle, cross; six colours) move in straight lines over a
textured background with small grey distractors, appearing and disappearing at chosen times.
Every frame carries a thin progress bar along its bottom edge (like a player's seek bar), so
"when" questions are answerable from any single frame, whatever frames a caller samples.
Everything is deterministic in the seed. Frames are uint8 ``[T, H, W, 3]``; every object has a
per-frame tight box ``[x0, y0, x1, y1)`` (pixels, exclusive end; ``-1`` rows where invisible)
that covers exactly the pixels drawn for it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

COLOURS = ["red", "green", "blue", "yellow", "purple", "orange"]
RGB = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 90, 230),
    "yellow": (235, 210, 40),
    "purple": (150, 60, 200),
    "orange": (245, 135, 30),
}
SHAPES = ["circle", "square", "triangle", "cross"]
DIRECTIONS = ["left", "right", "up", "down"]
PHASES = ["beginning", "middle", "end"]
_DXY = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
BAR_H = 3  # progress bar rows at the bottom of every frame
SHORT_MAX = 32  # clips up to this many frames are "short"
MAX_SEG = 20  # longest visible segment (frames): fast straight paths must stay inside the frame
OBJ_SIZE = (20, 29)  # object size range in pixels (of 96), [lo, hi)


@dataclass
class ToyObject:
    id: int
    colour: str
    shape: str
    direction: str
    size: int
    start: int  # first visible frame
    end: int  # one past the last visible frame
    boxes: np.ndarray  # [T, 4] int32, x0 y0 x1 y1 (exclusive), -1 where invisible
    full: bool  # visible for the whole clip

    @property
    def phase(self) -> str:
        return PHASES[phase_of((self.start + self.end) / 2.0, len(self.boxes))]

    def to_dict(self) -> dict:
        return {
            "id": self.id, "colour": self.colour, "shape": self.shape, "direction": self.direction,
            "size": self.size, "start": self.start, "end": self.end, "full": self.full,
            "phase": self.phase,
        }


@dataclass
class Clip:
    frames: np.ndarray  # [T, H, W, 3] uint8
    objects: list[ToyObject]
    idmap: np.ndarray  # [T, H, W] int8: object id drawn at the pixel, -1 elsewhere
    seed: int
    meta: dict = field(default_factory=dict)

    @property
    def n_frames(self) -> int:
        return int(self.frames.shape[0])

    def obj(self, oid: int) -> ToyObject:
        return next(o for o in self.objects if o.id == oid)


def phase_of(frame_centre: float, n_frames: int) -> int:
    """Third of the clip (0 beginning, 1 middle, 2 end) that a frame position falls in."""
    return int(min(2, max(0, np.floor(3.0 * frame_centre / n_frames))))


def frame_phase(i: int, n_frames: int) -> int:
    return phase_of(i + 0.5, n_frames)


def shape_mask(shape: str, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Mask of a shape on local coordinates u (right), v (down) in [-1, 1]."""
    if shape == "circle":
        return u * u + v * v <= 1.0
    if shape == "square":
        return (np.abs(u) <= 0.86) & (np.abs(v) <= 0.86)
    if shape == "triangle":  # apex up
        return (v >= -0.95) & (v <= 0.85) & (np.abs(u) <= (v + 0.95) / 1.8)
    if shape == "cross":
        return ((np.abs(u) <= 0.3) & (np.abs(v) <= 1.0)) | ((np.abs(v) <= 0.3) & (np.abs(u) <= 1.0))
    raise ValueError(shape)


def _upsample(a: np.ndarray, h: int, w: int) -> np.ndarray:
    """Bilinear upsampling of a small 2-D array to (h, w), numpy only."""
    gh, gw = a.shape
    ys = np.linspace(0, gh - 1, h)
    xs = np.linspace(0, gw - 1, w)
    y0 = np.floor(ys).astype(int); x0 = np.floor(xs).astype(int)
    y1 = np.minimum(y0 + 1, gh - 1); x1 = np.minimum(x0 + 1, gw - 1)
    fy = (ys - y0)[:, None]; fx = (xs - x0)[None, :]
    top = a[y0][:, x0] * (1 - fx) + a[y0][:, x1] * fx
    bot = a[y1][:, x0] * (1 - fx) + a[y1][:, x1] * fx
    return top * (1 - fy) + bot * fy


def _background(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """Muted textured background (low saturation so object colours stay unambiguous)."""
    base = rng.uniform(70, 170)
    tint = rng.uniform(-12, 12, size=3)
    kind = rng.integers(0, 3)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    if kind == 0:  # blotchy noise
        g = rng.integers(4, 10)
        tex = _upsample(rng.uniform(-1, 1, size=(g, g)), h, w) * rng.uniform(15, 35)
    elif kind == 1:  # stripes
        period = rng.uniform(6, 18)
        ang = rng.uniform(0, np.pi)
        tex = np.sin((xx * np.cos(ang) + yy * np.sin(ang)) * 2 * np.pi / period) * rng.uniform(8, 22)
    else:  # checker
        cell = int(rng.integers(6, 17))
        tex = (((yy // cell) + (xx // cell)) % 2 * 2 - 1) * rng.uniform(6, 18)
    tex = tex + rng.normal(0, 3.0, size=(h, w))
    img = base + tex[..., None] + tint[None, None, :]
    return img.astype(np.float32)


def _path(rng, direction, size, length, w, h_usable, speed_range=(3.0, 4.5)):
    """Start centre and per-frame velocity of a straight path of `length` frames inside the frame."""
    margin = 2
    span_max = (w if direction in ("left", "right") else h_usable) - size - 2 * margin
    speed = rng.uniform(*speed_range)
    if length > 1:
        speed = min(speed, (span_max - 4) / (length - 1))
    travel = speed * max(length - 1, 0)
    dx, dy = _DXY[direction]
    half = size / 2.0
    # along-axis start so the whole path stays inside
    lo = margin + half
    if direction in ("left", "right"):
        hi = w - margin - half - travel
        a0 = rng.uniform(lo, max(lo, hi))
        ax = a0 if dx > 0 else w - a0
        cy = rng.uniform(margin + half, h_usable - margin - half)
        return (ax, cy), (dx * speed, 0.0)
    hi = h_usable - margin - half - travel
    a0 = rng.uniform(lo, max(lo, hi))
    ay = a0 if dy > 0 else h_usable - a0
    cx = rng.uniform(margin + half, w - margin - half)
    return (cx, ay), (0.0, dy * speed)


def _segment(rng, n_frames, phase, min_len, max_len):
    """A visible segment [start, end) lying entirely inside the given third of the clip."""
    idx = [i for i in range(n_frames) if frame_phase(i, n_frames) == phase]
    lo_i, hi_i = idx[0], idx[-1] + 1
    avail = hi_i - lo_i
    length = int(rng.integers(min(min_len, avail), min(max_len, avail) + 1))
    start = int(rng.integers(lo_i, hi_i - length + 1))
    return start, start + length


def make_clip(
    seed: int,
    n_frames: int = 16,
    size: int = 96,
    n_objects: int | None = None,
    segment_first: bool = False,
    max_objects: int = 4,
) -> Clip:
    """Draw one clip.

    Short clips (<= 32 frames): 1..max_objects objects, each visible for the whole clip or for a
    segment inside one third of it. Long clips (> 32 frames): 2..max_objects objects, each visible
    only in a short segment (12..20 frames). ``segment_first`` forces object 0 to be a segment
    object (needed for "when" and "describe" questions). Colours and shapes are distinct within a
    clip, so "the red object" or "the circle" always names exactly one object.
    """
    rng = np.random.default_rng([int(seed), int(n_frames), int(size), 7919])
    T, H, W = int(n_frames), int(size), int(size)
    h_usable = H - BAR_H - 2
    long = T > SHORT_MAX
    if n_objects is None:
        n_objects = int(rng.integers(2 if long else 1, max_objects + 1))
    n_objects = max(1, min(n_objects, len(SHAPES), max_objects))
    colours = rng.permutation(COLOURS)[:n_objects]
    shapes = rng.permutation(SHAPES)[:n_objects]

    bg = _background(rng, H, W)
    frames = np.repeat(bg[None], T, axis=0)
    frames += rng.normal(0, 2.0, size=frames.shape).astype(np.float32)  # sensor noise

    # distractors: small neutral blobs / bars, drawn under the objects, not counted
    n_dis = int(rng.integers(3, 7 if not long else 10))
    yy, xx = np.mgrid[0:H, 0:W].astype(np.float32)
    for _ in range(n_dis):
        tone = rng.choice([rng.uniform(15, 50), rng.uniform(200, 245)])
        r = rng.uniform(1.5, 3.5)
        bar = rng.random() < 0.5
        x, y = rng.uniform(4, W - 4), rng.uniform(4, h_usable - 4)
        vx, vy = rng.uniform(-0.6, 0.6, size=2)
        rr = int(np.ceil(r * 2.2)) + 1
        for t in range(T):
            cx, cy = x + vx * t, y + vy * t
            x0, x1 = max(0, int(cx) - rr), min(W, int(cx) + rr + 1)
            y0, y1 = max(0, int(cy) - rr), min(h_usable, int(cy) + rr + 1)
            if x1 <= x0 or y1 <= y0:
                continue
            lx, ly = xx[y0:y1, x0:x1], yy[y0:y1, x0:x1]
            if bar:
                m = (np.abs(lx - cx) <= r * 2.2) & (np.abs(ly - cy) <= r * 0.5)
            else:
                m = (lx - cx) ** 2 + (ly - cy) ** 2 <= r * r
            frames[t, y0:y1, x0:x1][m] = tone

    # objects, with rejection so that objects never overlap
    idmap = np.full((T, H, W), -1, dtype=np.int8)
    objects: list[ToyObject] = []
    occupied = np.full((T, 4), 0, dtype=np.float32)
    boxes_all: list[np.ndarray] = []
    for k in range(n_objects):
        placed = None
        for _try in range(60):
            sz = int(rng.integers(*OBJ_SIZE))
            direction = DIRECTIONS[int(rng.integers(0, 4))]
            if long:
                full = False
                seg = _segment(rng, T, int(rng.integers(0, 3)), 12, MAX_SEG)
            else:
                full = (not (segment_first and k == 0)) and T <= MAX_SEG and rng.random() < 0.5
                if full:
                    seg = (0, T)
                else:
                    seg = _segment(rng, T, int(rng.integers(0, 3)), 2, min(MAX_SEG, max(2, T // 3)))
            length = seg[1] - seg[0]
            (c0x, c0y), (vx, vy) = _path(rng, direction, sz, length, W, h_usable)
            cen = np.full((T, 2), np.nan, dtype=np.float32)
            ts = np.arange(seg[0], seg[1])
            cen[ts, 0] = c0x + vx * (ts - seg[0])
            cen[ts, 1] = c0y + vy * (ts - seg[0])
            ok = True
            for prev in boxes_all:
                for t in ts:
                    if prev[t, 0] < 0:
                        continue
                    x0, y0 = cen[t] - sz / 2 - 3
                    x1, y1 = cen[t] + sz / 2 + 3
                    if not (x1 <= prev[t, 0] or x0 >= prev[t, 2] or y1 <= prev[t, 1] or y0 >= prev[t, 3]):
                        ok = False
                        break
                if not ok:
                    break
            if ok:
                placed = (sz, direction, seg, cen, full)
                break
        if placed is None:
            continue
        sz, direction, seg, cen, full = placed
        colour, shape = str(colours[k]), str(shapes[k])
        rgb = np.clip(np.array(RGB[colour], dtype=np.float32) + rng.uniform(-12, 12, size=3), 0, 255)
        boxes = np.full((T, 4), -1, dtype=np.int32)
        half = sz / 2.0
        for t in range(seg[0], seg[1]):
            cx, cy = cen[t]
            x0 = max(0, int(np.floor(cx - half)) - 1); x1 = min(W, int(np.ceil(cx + half)) + 1)
            y0 = max(0, int(np.floor(cy - half)) - 1); y1 = min(h_usable, int(np.ceil(cy + half)) + 1)
            u = (xx[y0:y1, x0:x1] + 0.5 - cx) / half
            v = (yy[y0:y1, x0:x1] + 0.5 - cy) / half
            m = shape_mask(shape, u, v)
            if not m.any():
                continue
            frames[t, y0:y1, x0:x1][m] = rgb
            idmap[t, y0:y1, x0:x1][m] = len(objects)
            ys, xs = np.nonzero(m)
            boxes[t] = (x0 + xs.min(), y0 + ys.min(), x0 + xs.max() + 1, y0 + ys.max() + 1)
        vis = np.nonzero(boxes[:, 0] >= 0)[0]
        if len(vis) == 0:
            continue
        boxes_all.append(boxes)
        objects.append(ToyObject(
            id=len(objects), colour=colour, shape=shape, direction=direction, size=sz,
            start=int(vis[0]), end=int(vis[-1]) + 1, boxes=boxes, full=full))

    # progress bar (seek bar) along the bottom edge
    for t in range(T):
        frames[t, H - BAR_H:] = 35.0
        fill = int(round((t + 1) / T * W))
        frames[t, H - BAR_H:, :fill] = 215.0
    frames = np.clip(np.rint(frames), 0, 255).astype(np.uint8)
    return Clip(frames=frames, objects=objects, idmap=idmap, seed=int(seed),
                meta={"n_frames": T, "size": size, "long": long})
