"""Procedural clips for the embedded toy Video-LLM.

Coloured shapes (circle, square, triangle, cross; six colours) move in straight lines over a
textured background with small grey distractors, appearing and disappearing at chosen times.
Every frame carries a thin progress bar along its bottom edge (like a player's seek bar), so
"when" questions are answerable from any single frame, whatever frames a caller samples.
Everything is deterministic in the seed. Frames are uint8 ``[T, H, W, 3]``; every object has a
per-frame tight box ``[x0, y0, x1, y1)`` (pixels, exclusive end; ``-1`` rows where invisible)
that covers exactly the pixels drawn for it.

Domain randomisation (issue 22, opt-in): ``make_clip(..., style=Style(...))`` renders the same kind
of content in another look: background family (plain, noise, gradient, stripes, checker; "rings" is
the held-out family), level (dark to light), contrast and scale, distractor kind (none, dots, lines,
grey shapes, specks, mixed, or the original blobs), object-size band, speed band, frame size and
aspect ratio, colour jitter and cast, sensor noise, the progress bar (bottom, top or none; any
colours and height) and libx264 compression artefacts. ``sample_style(seed)`` draws one;
``held_out_family(style)`` says whether it belongs to the held-out style family (the "rings"
background or the "xl" object-size band), which ``sample_style(..., train=True)`` never draws and
``sample_style(..., held_out=True)`` always draws. ``style=None`` (the default), like ``LEGACY``,
draws the original renderer's clips.

The world's one rule since issue 22's fourth fine-tune: an object that is not on screen for the
whole clip is visible in both frames of at least one frame pair (0-1, 2-3, ...). Qwen2-VL's vision
tower sees frames in such pairs and attends within one pair only, so an object caught in just two
frames of two pairs (frames 7 and 8 of 16) is seen by no visual token to move: its direction is not
in the model's input (model card, "Why narrations missed"). ``make_clip(..., glimpses=True)`` draws
the original world, where such glimpses happen (about one 16-frame narration in four); with
``style=None`` those are the original clips bit for bit, and the training recipes of the shipped
model's parents used them.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

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

# ---- domain randomisation (issue 22)
TRAIN_BACKGROUNDS = ["plain", "noise", "gradient", "stripes", "checker", "legacy"]
HELD_OUT_BACKGROUNDS = ["rings"]  # concentric rings: a background family training never sees
# object size bands, pixels of a 96-pixel frame side ([lo, hi); scaled with the frame's shorter side)
SIZE_BANDS = {"legacy": OBJ_SIZE, "small": (10, 16), "medium": (16, 24), "large": (24, 32), "xl": (32, 40)}
TRAIN_BANDS = ["small", "medium", "large"]
HELD_OUT_BANDS = ["xl"]  # an object-size band training never sees
SPEED_BANDS = {"slow": (1.5, 3.0), "normal": (3.0, 4.5), "fast": (4.5, 6.5)}  # px/frame of a 96-px side
DISTRACTORS = ["none", "legacy", "dots", "lines", "grey_shapes", "specks", "mixed"]
FRAME_SIZES = [(96, 96), (64, 64), (80, 80), (128, 128), (72, 128), (128, 72), (96, 128), (128, 96), (64, 112),
               (112, 64)]  # (height, width)
BARS = ["bottom", "top", "none"]


@dataclass(frozen=True)
class Style:
    """How a clip is rendered (not what happens in it). The defaults are the original renderer
    (``LEGACY``): ``make_clip(seed, style=LEGACY)`` equals ``make_clip(seed)`` bit for bit, and
    ``replace(LEGACY, bar="none")`` is the same clip without its progress bar."""
    background: str = "legacy"  # legacy | plain | noise | gradient | stripes | checker | rings
    level: float = 120.0  # mean background grey level (0-255); legacy: drawn
    contrast: float = 15.0  # texture amplitude (grey levels, +-)
    scale: float = 10.0  # texture scale, pixels: noise blob, stripe period, checker cell, ring period
    tint: float = 12.0  # per-channel background tint, +-
    noise: float = 2.0  # per-pixel sensor noise (standard deviation)
    distractors: str = "legacy"  # one of DISTRACTORS
    n_distractors: int = 0  # (legacy: drawn, 3-6 short / 3-9 long)
    size_band: str = "legacy"  # one of SIZE_BANDS
    speed: tuple = (3.0, 4.5)  # px/frame range (of a 96-pixel side)
    height: int | None = None  # frame size (None: the `size` argument, square)
    width: int | None = None
    obj_jitter: float = 12.0  # per-object colour jitter, per channel, +-
    gain: tuple = (1.0, 1.0, 1.0)  # per-channel gain of the whole frame (colour cast)
    brightness: float = 0.0  # added to the whole frame
    bar: str = "bottom"  # progress bar: bottom | top | none
    bar_space: bool = True  # keep objects off the bar's band (also when bar == "none")
    bar_h: int = BAR_H
    bar_colours: tuple = ((35, 35, 35), (215, 215, 215))  # track, fill (RGB)
    crf: int | None = None  # libx264 round trip at this CRF (None: no compression)
    name: str = ""  # free label (evaluation reports)

    @property
    def family(self) -> str:
        return self.background

    def to_dict(self) -> dict:
        return asdict(self)


LEGACY = Style()


def held_out_family(style: Style | None) -> bool:
    """Whether a style belongs to the held-out style family: the "rings" background or the "xl"
    object-size band (never drawn by ``sample_style(train=True)``)."""
    return style is not None and (style.background in HELD_OUT_BACKGROUNDS or style.size_band in HELD_OUT_BANDS)


def sample_style(seed: int, train: bool = True, held_out: bool = False) -> Style:
    """A random rendering style, deterministic in `seed`. ``train=True`` never draws the held-out
    family; ``held_out=True`` draws only it (its background, its size band, or both, a third of the
    time each)."""
    rng = np.random.default_rng([int(seed), 22, 4099])
    bgs, bands = TRAIN_BACKGROUNDS, TRAIN_BANDS
    if held_out:
        case = int(rng.integers(0, 3))
        bgs = HELD_OUT_BACKGROUNDS if case in (0, 2) else TRAIN_BACKGROUNDS
        bands = HELD_OUT_BANDS if case in (1, 2) else TRAIN_BANDS
    elif not train:
        bgs, bands = TRAIN_BACKGROUNDS + HELD_OUT_BACKGROUNDS, TRAIN_BANDS + HELD_OUT_BANDS
    bg = str(bgs[int(rng.integers(0, len(bgs)))])
    tone = int(rng.integers(0, 3))  # dark, mid, light
    level = float(rng.uniform(*[(15, 70), (70, 170), (170, 240)][tone]))
    contrast = {"plain": 0.0, "noise": rng.uniform(3, 40), "gradient": rng.uniform(10, 90),
                "stripes": rng.uniform(4, 60), "checker": rng.uniform(4, 70), "rings": rng.uniform(4, 60),
                "legacy": 15.0}[bg]
    scale = float(np.exp(rng.uniform(np.log(2.0), np.log(40.0))))
    size_band = str(bands[int(rng.integers(0, len(bands)))])
    speed = SPEED_BANDS[list(SPEED_BANDS)[int(rng.integers(0, len(SPEED_BANDS)))]]
    h, w = FRAME_SIZES[int(rng.integers(0, len(FRAME_SIZES)))]
    dis = DISTRACTORS[int(rng.integers(0, len(DISTRACTORS)))]
    n_dis = int(rng.integers(1, 12)) if dis not in ("none", "legacy") else 0
    bar = BARS[int(rng.choice(3, p=[0.35, 0.2, 0.45]))]
    if rng.random() < 0.5:  # grey track and fill
        t, f = sorted(rng.uniform(0, 255, 2))[:: 1 if rng.random() < 0.8 else -1]
        bar_colours = ((t, t, t), (f, f, f))
    else:  # coloured
        bar_colours = (tuple(rng.uniform(0, 255, 3)), tuple(rng.uniform(0, 255, 3)))
    bar_colours = tuple(tuple(int(round(c)) for c in col) for col in bar_colours)
    return Style(
        background=bg, level=level, contrast=float(contrast), scale=scale, tint=float(rng.uniform(0, 20)),
        noise=float(rng.uniform(0, 6)), distractors=dis, n_distractors=n_dis, size_band=size_band,
        speed=speed, height=h, width=w, obj_jitter=float(rng.uniform(0, 25)),
        gain=tuple(float(g) for g in 1 + rng.uniform(-0.12, 0.12, 3)), brightness=float(rng.uniform(-20, 20)),
        bar=bar, bar_space=bool(bar != "none" or rng.random() < 0.5), bar_h=int(rng.integers(2, 6)),
        bar_colours=bar_colours, crf=None if rng.random() < 0.5 else int(rng.integers(18, 41)))


def codec_roundtrip(frames: np.ndarray, crf: int, fps: int = 8) -> np.ndarray:
    """Encode with libx264 (yuv420p, one thread) at `crf` and decode again, in memory: the
    blocking, ringing and chroma bleeding of a compressed video. Deterministic (measured: the
    default lookahead/mb-tree runs differed 5 times in 20 on one clip even with threads=1, so
    tune=zerolatency, which turns them off); frames converted to yuv420p before the encoder, raw
    h264 (no container metadata), single-threaded decoding."""
    import io

    import av

    T, H, W, _ = frames.shape
    x = np.pad(frames, ((0, 0), (0, H % 2), (0, W % 2), (0, 0)), mode="edge")
    buf = io.BytesIO()
    with av.open(buf, "w", format="h264") as out:
        st = out.add_stream("libx264", rate=fps, options={
            "crf": str(int(crf)), "preset": "veryfast", "tune": "zerolatency", "x264-params": "threads=1"})
        st.width, st.height, st.pix_fmt = x.shape[2], x.shape[1], "yuv420p"
        st.codec_context.thread_count = 1
        st.codec_context.thread_type = "NONE"
        for i, a in enumerate(x):
            fr = av.VideoFrame.from_ndarray(np.ascontiguousarray(a), format="rgb24").reformat(format="yuv420p")
            fr.pts = i
            out.mux(st.encode(fr))
        out.mux(st.encode())
    buf.seek(0)
    with av.open(buf, format="h264") as c:
        vs = c.streams.video[0]
        vs.thread_type = "NONE"
        vs.codec_context.thread_count = 1
        dec = [f.to_ndarray(format="rgb24") for f in c.decode(vs)]
    return np.stack(dec)[:T, :H, :W]


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


def _path(rng, direction, size, length, w, h_usable, speed_range=(3.0, 4.5), y_lo=0):
    """Start centre and per-frame velocity of a straight path of `length` frames inside the frame
    (rows y_lo .. y_lo + h_usable)."""
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
        return (ax, cy + y_lo), (dx * speed, 0.0)
    hi = h_usable - margin - half - travel
    a0 = rng.uniform(lo, max(lo, hi))
    ay = a0 if dy > 0 else h_usable - a0
    cx = rng.uniform(margin + half, w - margin - half)
    return (cx, ay + y_lo), (0.0, dy * speed)


def _styled_background(rng: np.random.Generator, st: Style, h: int, w: int) -> np.ndarray:
    """Background of a non-legacy style: grey level + texture of its family + a small tint."""
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    c, sc, kind = st.contrast, max(1.0, st.scale), st.background
    if kind == "plain":
        tex = np.zeros((h, w), np.float32)
    elif kind == "noise":  # value noise at the style's scale (2 px: nearly per-pixel)
        gh, gw = max(2, int(round(h / sc)) + 1), max(2, int(round(w / sc)) + 1)
        tex = _upsample(rng.uniform(-1, 1, size=(gh, gw)), h, w) * c
    elif kind == "gradient":
        ang = rng.uniform(0, 2 * np.pi)
        t = xx * np.cos(ang) + yy * np.sin(ang)
        tex = (2 * (t - t.min()) / max(1e-6, float(t.max() - t.min())) - 1) * c
    elif kind == "stripes":
        ang = rng.uniform(0, np.pi)
        wave = np.sin((xx * np.cos(ang) + yy * np.sin(ang)) * 2 * np.pi / max(2.0, sc) + rng.uniform(0, 2 * np.pi))
        tex = (np.sign(wave) if rng.random() < 0.5 else wave) * c
    elif kind == "checker":
        cell = max(1, int(round(sc)))
        oy, ox = rng.integers(0, cell, size=2)
        tex = ((((yy + oy) // cell) + ((xx + ox) // cell)) % 2 * 2 - 1) * c
    elif kind == "rings":
        cy, cx = rng.uniform(0, h), rng.uniform(0, w)
        tex = np.sin(np.hypot(yy - cy, xx - cx) * 2 * np.pi / max(3.0, sc)) * c
    else:
        raise ValueError(f"unknown background {kind!r}")
    tint = rng.uniform(-st.tint, st.tint, size=3) if st.tint > 0 else np.zeros(3)
    return (st.level + tex[..., None] + tint[None, None, :]).astype(np.float32)



def _windows(x, y, vx, vy, rr: int, T: int, W: int, y_lo: int, y_hi: int):
    """For a distractor at (x, y) moving (vx, vy) per frame: (t, cx, cy, x0, x1, y0, y1) of each frame
    whose window of half-size rr around the centre lies partly inside [0, W) x [y_lo, y_hi)."""
    for t in range(T):
        cx, cy = x + vx * t, y + vy * t
        x0, x1 = max(0, int(cx) - rr), min(W, int(cx) + rr + 1)
        y0, y1 = max(y_lo, int(cy) - rr), min(y_hi, int(cy) + rr + 1)
        if x1 > x0 and y1 > y0:
            yield t, cx, cy, x0, x1, y0, y1

def _draw_distractors(rng, frames, kind: str, n: int, y_lo: int, y_hi: int, k: float, long: bool) -> None:
    """Neutral (grey) distractors drawn under the objects, never counted. `kind`: legacy (small
    blobs and bars, moving slowly), dots, lines (static thin lines), grey_shapes (grey circles,
    squares, triangles, crosses, smaller than the objects), specks (tiny dots, new places every
    frame) or mixed; `k` scales sizes with the frame."""
    T, H, W = frames.shape[:3]
    yy, xx = np.mgrid[0:H, 0:W].astype(np.float32)
    if kind == "legacy":  # the original distractors (their count drawn here)
        n = int(rng.integers(3, 7 if not long else 10))
    for _ in range(n):
        kd = DISTRACTORS[2 + int(rng.integers(0, 4))] if kind == "mixed" else kind
        tone = rng.choice([rng.uniform(15, 50), rng.uniform(200, 245)])
        if kd in ("legacy", "dots"):
            r = rng.uniform(1.5, 3.5) * (k if kd == "dots" else 1.0)
            bar = kd == "legacy" and rng.random() < 0.5
            x, y = rng.uniform(4, W - 4), rng.uniform(y_lo + 4, y_hi - 4)
            vx, vy = rng.uniform(-0.6, 0.6, size=2)
            for t, cx, cy, x0, x1, y0, y1 in _windows(x, y, vx, vy, int(np.ceil(r * 2.2)) + 1, T, W, y_lo, y_hi):
                lx, ly = xx[y0:y1, x0:x1], yy[y0:y1, x0:x1]
                if bar:
                    m = (np.abs(lx - cx) <= r * 2.2) & (np.abs(ly - cy) <= r * 0.5)
                else:
                    m = (lx - cx) ** 2 + (ly - cy) ** 2 <= r * r
                frames[t, y0:y1, x0:x1][m] = tone
        elif kd == "lines":
            ang = rng.uniform(0, np.pi)
            px, py = rng.uniform(0, W), rng.uniform(y_lo, y_hi)
            d = np.abs((xx - px) * np.sin(ang) - (yy - py) * np.cos(ang))
            m = (d <= rng.uniform(0.5, 1.5) * k) & (yy >= y_lo) & (yy < y_hi)
            frames[:, m] = tone
        elif kd == "grey_shapes":
            sh = SHAPES[int(rng.integers(0, len(SHAPES)))]
            half = rng.uniform(3, 7) * k
            x, y = rng.uniform(half, W - half), rng.uniform(y_lo + half, y_hi - half)
            vx, vy = rng.uniform(-0.8, 0.8, size=2)
            for t, cx, cy, x0, x1, y0, y1 in _windows(x, y, vx, vy, int(np.ceil(half)) + 1, T, W, y_lo, y_hi):
                m = shape_mask(sh, (xx[y0:y1, x0:x1] + 0.5 - cx) / half, (yy[y0:y1, x0:x1] + 0.5 - cy) / half)
                frames[t, y0:y1, x0:x1][m] = tone
        elif kd == "specks":
            m = 4 + int(rng.integers(0, 12))
            ts = np.repeat(np.arange(T), m)
            ys = rng.integers(y_lo, y_hi, size=T * m)
            xs = rng.integers(0, W, size=T * m)
            frames[ts, ys, xs] = tone
        else:
            raise ValueError(f"unknown distractor kind {kd!r}")


def holds_pair(start: int, end: int) -> bool:
    """Whether frames [start, end) include both frames of a frame pair (0, 1), (2, 3), ...: the
    model's temporal patch, the unit in which Qwen2-VL's vision tower sees motion."""
    first = start + (start % 2)  # the first pair that starts inside
    return first + 2 <= end


def _segment(rng, n_frames, phase, min_len, max_len, glimpses: bool):
    """A visible segment [start, end) lying entirely inside the given third of the clip.

    ``glimpses=False`` (the world since issue 22's fourth fine-tune): the segment also holds both
    frames of some frame pair, so that a visual token sees the object move. A draw that does not is
    drawn again among the segments that do, so a clip none of whose draws glimpsed (placements
    rejected on the way included) is the original world's bit for bit; where the third holds no
    whole pair (the middle of an 8-frame clip, the end of a 7-frame one, clips under 6 frames) the
    segment is a whole pair whose centre lies in the third."""
    idx = [i for i in range(n_frames) if frame_phase(i, n_frames) == phase]
    lo_i, hi_i = idx[0], idx[-1] + 1
    avail = hi_i - lo_i
    lengths = range(min(min_len, avail), min(max_len, avail) + 1)
    length = int(rng.integers(lengths.start, lengths.stop))
    start = int(rng.integers(lo_i, hi_i - length + 1))
    if glimpses or holds_pair(start, start + length):
        return start, start + length
    cands = [(a, a + n) for n in lengths for a in range(lo_i, hi_i - n + 1) if holds_pair(a, a + n)]
    if not cands:
        cands = [(a, a + 2) for a in range(0, n_frames - 1, 2)
                 if phase_of(a + 1.0, n_frames) == phase]
    if not cands:  # a clip too short for any pair in this third (under 4 frames)
        return start, start + length
    return cands[int(rng.integers(0, len(cands)))]


def make_clip(
    seed: int,
    n_frames: int = 16,
    size: int = 96,
    n_objects: int | None = None,
    segment_first: bool = False,
    max_objects: int = 4,
    style: Style | None = None,
    glimpses: bool = False,
) -> Clip:
    """Draw one clip.

    Short clips (<= 32 frames): 1..max_objects objects, each visible for the whole clip or for a
    segment inside one third of it. Long clips (> 32 frames): 2..max_objects objects, each visible
    only in a short segment (12..20 frames). ``segment_first`` forces object 0 to be a segment
    object (needed for "when" and "describe" questions). Colours and shapes are distinct within a
    clip, so "the red object" or "the circle" always names exactly one object. ``style`` renders
    it another way (`Style`; None: the original renderer). Every object not on screen for the
    whole clip is visible in both frames of some frame pair (the model's temporal patch), so a
    visual token sees it move; ``glimpses=True`` draws the original world, where a short-lived
    object may be seen in two frames of two pairs only, and with ``style=None`` exactly the
    original clips, bit for bit.
    """
    rng = np.random.default_rng([int(seed), int(n_frames), int(size), 7919])
    st = LEGACY if style is None else style
    T = int(n_frames)
    H, W = int(st.height or size), int(st.width or size)
    k = min(H, W) / 96.0  # sizes and speeds are given for a 96-pixel side
    if st.bar == "top":
        y_lo, y_hi = st.bar_h + 2, H
    elif st.bar == "bottom" or st.bar_space:
        y_lo, y_hi = 0, H - st.bar_h - 2
    else:
        y_lo, y_hi = 0, H
    h_usable = y_hi - y_lo
    long = T > SHORT_MAX
    if n_objects is None:
        n_objects = int(rng.integers(2 if long else 1, max_objects + 1))
    n_objects = max(1, min(n_objects, len(SHAPES), max_objects))
    colours = rng.permutation(COLOURS)[:n_objects]
    shapes = rng.permutation(SHAPES)[:n_objects]

    bg = _background(rng, H, W) if st.background == "legacy" else _styled_background(rng, st, H, W)
    frames = np.repeat(bg[None], T, axis=0)
    if st.noise > 0:
        frames += rng.normal(0, st.noise, size=frames.shape).astype(np.float32)  # sensor noise

    # distractors: neutral, drawn under the objects, not counted
    if st.distractors != "none":
        _draw_distractors(rng, frames, st.distractors, st.n_distractors, y_lo, y_hi, k, long)

    # objects, with rejection so that objects never overlap
    yy, xx = np.mgrid[0:H, 0:W].astype(np.float32)
    band = SIZE_BANDS[st.size_band]
    size_range = band if k == 1.0 else (max(4, int(round(band[0] * k))), max(5, int(round(band[1] * k))))
    speed_range = tuple(st.speed) if k == 1.0 else tuple(v * k for v in st.speed)
    idmap = np.full((T, H, W), -1, dtype=np.int8)
    objects: list[ToyObject] = []
    boxes_all: list[np.ndarray] = []
    for kk in range(n_objects):
        placed = None
        for _try in range(60):
            sz = int(rng.integers(*size_range))
            direction = DIRECTIONS[int(rng.integers(0, 4))]
            if long:
                full = False
                seg = _segment(rng, T, int(rng.integers(0, 3)), 12, MAX_SEG, glimpses)
            else:
                full = (not (segment_first and kk == 0)) and T <= MAX_SEG and rng.random() < 0.5
                if full:
                    seg = (0, T)
                else:
                    seg = _segment(rng, T, int(rng.integers(0, 3)), 2, min(MAX_SEG, max(2, T // 3)), glimpses)
            length = seg[1] - seg[0]
            (c0x, c0y), (vx, vy) = _path(rng, direction, sz, length, W, h_usable, speed_range, y_lo)
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
        colour, shape = str(colours[kk]), str(shapes[kk])
        jit = st.obj_jitter
        rgb = np.clip(np.array(RGB[colour], dtype=np.float32) + rng.uniform(-jit, jit, size=3), 0, 255)
        boxes = np.full((T, 4), -1, dtype=np.int32)
        half = sz / 2.0
        for t in range(seg[0], seg[1]):
            cx, cy = cen[t]
            x0 = max(0, int(np.floor(cx - half)) - 1); x1 = min(W, int(np.ceil(cx + half)) + 1)
            y0 = max(y_lo, int(np.floor(cy - half)) - 1); y1 = min(y_hi, int(np.ceil(cy + half)) + 1)
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

    # progress bar (seek bar) along the bottom (or top) edge
    if st.bar != "none":
        rows = slice(H - st.bar_h, H) if st.bar == "bottom" else slice(0, st.bar_h)
        track, fill_c = st.bar_colours
        grey = track[0] == track[1] == track[2] and fill_c[0] == fill_c[1] == fill_c[2]
        for t in range(T):
            frames[t, rows] = float(track[0]) if grey else np.asarray(track, np.float32)
            fill = int(round((t + 1) / T * W))
            frames[t, rows, :fill] = float(fill_c[0]) if grey else np.asarray(fill_c, np.float32)
    if tuple(st.gain) != (1.0, 1.0, 1.0) or st.brightness:
        frames = frames * np.asarray(st.gain, np.float32) + np.float32(st.brightness)
    frames = np.clip(np.rint(frames), 0, 255).astype(np.uint8)
    if st.crf is not None:
        frames = codec_roundtrip(frames, st.crf)
    meta = {"n_frames": T, "size": size, "long": long}
    if style is not None:
        meta.update(style=st.to_dict(), held_out=held_out_family(st), height=H, width=W)
    return Clip(frames=frames, objects=objects, idmap=idmap, seed=int(seed), meta=meta)
