"""Read a video into a small, uniformly sampled stack of RGB frames; write test videos.

``load_video`` never holds the whole video in memory: it either seeks (to the keyframe
before each target, then decodes forward) or streams once through the file, keeping
only the frames it picks. Every PyAV/FFmpeg failure becomes a ``VideoError`` subclass
whose message can be shown to a user as is.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from fractions import Fraction

import av
import numpy as np

from sparsevid.errors import VideoError

DEFAULT_MAX_BYTES = 500 * 2**20
DEFAULT_MAX_DURATION = 3600.0  # seconds
DEFAULT_MAX_SIDE = 768
SEEK_GAP_S = 2.0  # seek only when the next target lies this far past the decoder position
_EPS = 1e-6  # seconds; a frame "at" a target counts as on screen at it


class NotAVideoError(VideoError):
    """The file is missing, unreadable, damaged or not a media file."""


class VideoNotFoundError(NotAVideoError):
    """The path does not exist."""


class NoVideoStreamError(VideoError):
    """The file is a media file without a video stream (e.g. audio only)."""


class NoFramesError(VideoError):
    """The video stream holds no decodable frame."""


class FileTooLargeError(VideoError):
    """The file is larger than the byte limit."""


class VideoTooLongError(VideoError):
    """The video lasts longer than the duration limit."""


@dataclass
class Video:
    frames: np.ndarray  # [T, H, W, 3] uint8 RGB, sampled frames, rotation applied
    timestamps: list[float]  # seconds from the start, one per sampled frame, increasing
    duration: float  # seconds (best estimate)
    fps: float  # average frame rate (best estimate)
    source_size: tuple[int, int]  # (width, height) as displayed, after rotation
    path: str
    codec: str


def _size(n: float) -> str:
    for unit, scale in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{int(n)} bytes"


def _span(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}".rstrip("0").rstrip(".") + " s"
    m = round(seconds / 60)
    return f"{m} min" if m < 60 else f"{m // 60} h" + (f" {m % 60} min" if m % 60 else "")


def _duration(container, stream) -> float | None:
    """Duration in seconds from the stream, else the container; None when neither knows."""
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration:
        return container.duration / av.time_base
    return None


def _count_duration(container, stream, fps: float | None) -> tuple[float, int]:
    """(duration in seconds, packet count) by demuxing, without decoding."""
    first = end = None
    count = 0
    for packet in container.demux(stream):
        if packet.size == 0:
            continue
        count += 1
        if packet.pts is not None:
            t0 = float(packet.pts * stream.time_base)
            t1 = t0 + float((packet.duration or 0) * stream.time_base)
            first = t0 if first is None else min(first, t0)
            end = t1 if end is None else max(end, t1)
    if first is not None and end > first:
        return end - first, count
    return (count / fps if fps else float(count)), count


def _frame_to_array(frame: av.VideoFrame, width: int, height: int, rotation: int) -> np.ndarray:
    """Decoded frame -> [H, W, 3] uint8 RGB: scaled to (width, height), then turned by
    ``rotation`` quarter turns counter-clockwise (display matrix convention, like np.rot90)."""
    rgb = frame.reformat(width=width, height=height, format="rgb24").to_ndarray()
    return np.ascontiguousarray(np.rot90(rgb, k=rotation))


def _decode(container, stream):
    """Decoded frames of ``stream`` from the current position (a seam for tests).

    A decoding error ends the stream: a damaged tail keeps the frames before it.
    """
    try:
        yield from container.decode(stream)
    except av.FFmpegError:
        return


class _SeekFailed(Exception):
    """Seeking does not reach a keyframe before its target: use one pass from the start."""


def _timed(container, stream, start: float, fps: float, seek_to: float | None = None):
    """(seconds from start, frame) for each decoded frame, after seeking to seek_to if given."""
    if seek_to is not None:
        container.seek(int((start + seek_to) / stream.time_base), stream=stream, backward=True)
    t = None
    for frame in _decode(container, stream):
        if frame.time is None and seek_to is not None:
            raise _SeekFailed  # no timestamps: positions after a seek are unknown
        t = frame.time - start if frame.time is not None else (0.0 if t is None else t + 1 / fps)
        yield t, frame


def _seek(container, stream, start: float, fps: float, t: float):
    """(iterator, its first item) with the first frame at or before t, else at the very start.

    Some demuxers (mpeg-ts) land just after t on a non-keyframe: seek further back.
    """
    for back in (0, 1, 2, 4, 8, 16):
        it = _timed(container, stream, start, fps, max(0.0, t - back))
        first = next(it, None)
        if first is not None and (first[0] <= t + _EPS or first[0] <= _EPS):
            return it, first
    raise _SeekFailed


def _pick(container, stream, targets, start: float, fps: float, seek: bool, max_side: int):
    """For each target time (seconds from start) pick the frame on screen at that time.

    Holds at most two decoded frames at once; a picked frame is converted right away
    (see _frame_to_array) and kept once even when several targets share it.
    Returns ([(time, [H, W, 3] uint8)] in increasing time, (width, height) as displayed).
    """
    picked, size, it, prev, nxt, last_t, gap = [], None, None, None, None, -math.inf, SEEK_GAP_S
    for t in targets:
        if it is None or (seek and t - last_t > gap):
            prev, nxt = None, None
            if seek:
                it, nxt = _seek(container, stream, start, fps, t)
                last_t, gap = nxt[0], max(gap, t - nxt[0])  # don't seek again within a GOP
            else:
                it = _timed(container, stream, start, fps)
        while True:
            if nxt is None:
                nxt = next(it, None)
                if nxt is None:
                    break
                last_t = nxt[0]
            if nxt[0] > t + _EPS:
                break
            prev, nxt = nxt, None
        choice = prev or nxt  # nothing at or before t: the first frame after it
        if choice is None or (picked and choice[0] <= picked[-1][0]):
            continue  # end of stream, or the same frame again: never repeat one
        frame = choice[1]
        if size is None:  # first pick fixes rotation and output size for all frames
            rotation = round((getattr(frame, "rotation", 0) or 0) / 90) % 4
            w, h = frame.width, frame.height
            scale = min(1.0, max_side / max(w, h))
            out_w, out_h = max(1, round(w * scale)), max(1, round(h * scale))
            size = (h, w) if rotation % 2 else (w, h)
        picked.append((choice[0], _frame_to_array(frame, out_w, out_h, rotation)))
    return picked, size


def load_video(
    path,
    num_frames: int = 16,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_duration: float = DEFAULT_MAX_DURATION,
    max_side: int = DEFAULT_MAX_SIDE,
) -> Video:
    """Sample ``num_frames`` frames uniformly over the whole video.

    Target times are t_i = (i + 0.5) * duration / num_frames; for each, the frame on
    screen at t_i (the last one starting at or before it) is taken. A video with fewer
    frames than ``num_frames`` gives each frame at most once, so ``T <= num_frames``
    (frames are never repeated). Frames whose longer side exceeds ``max_side`` are
    downscaled keeping aspect ratio; rotation metadata (display matrix) is applied.
    Returns a ``Video`` with ``frames`` of shape [T, H, W, 3] uint8 RGB.
    Raises a ``VideoError`` subclass with a user-readable message on any problem.
    """
    path = os.fspath(path)
    name = os.path.basename(path) or path
    if num_frames < 1:
        raise ValueError("num_frames must be at least 1")
    if not os.path.exists(path):
        raise VideoNotFoundError(f"The file {name} does not exist.")
    if not os.path.isfile(path):
        raise NotAVideoError(f"{name} is not a file.")
    size = os.path.getsize(path)
    if size > max_bytes:
        raise FileTooLargeError(f"{name} is {_size(size)}; the limit is {_size(max_bytes)}.")
    try:
        return _load(path, name, num_frames, max_duration, max_side)
    except (av.FFmpegError, OSError, ValueError) as e:  # anything not converted more precisely
        raise NotAVideoError(f"{name} could not be decoded; the file may be damaged.") from e


def _open(path: str, name: str):
    """(container, its first real video stream); cover art does not count as video."""
    try:
        container = av.open(path)
    except (av.FFmpegError, OSError, ValueError) as e:
        raise NotAVideoError(f"{name} could not be read as a video or audio file.") from e
    art = av.stream.Disposition.attached_pic
    streams = [s for s in container.streams.video if not s.disposition & art]
    if not streams:
        container.close()
        raise NoVideoStreamError(f"{name} has no video stream (it may be an audio file).")
    streams[0].thread_type = "AUTO"
    return container, streams[0]


def _load(path, name, num_frames, max_duration, max_side) -> Video:
    container, stream = _open(path, name)
    try:
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        fps = float(rate) if rate else None
        duration = _duration(container, stream)
        if duration is None:  # e.g. some gifs: demux once (cheap) to measure, then reopen
            duration, count = _count_duration(container, stream, fps)
            if count == 0:
                raise NoFramesError(f"{name} contains no video frames.")
            container.close()
            container, stream = _open(path, name)
        if duration > max_duration:
            limit = _span(max_duration)
            raise VideoTooLongError(f"{name} lasts {_span(duration)}; the limit is {limit}.")
        if not fps:
            fps = (stream.frames / duration) if stream.frames and duration else 25.0
        start = float(stream.start_time * stream.time_base) if stream.start_time else 0.0
        targets = [(i + 0.5) * duration / num_frames for i in range(num_frames)]
        codec = stream.codec_context.name
        # Seek when targets are sparse; stream once when they are dense or seeking fails.
        picked = None
        if container.format.name != "gif" and duration / num_frames > SEEK_GAP_S:
            try:
                picked, size = _pick(container, stream, targets, start, fps, True, max_side)
            except (_SeekFailed, av.FFmpegError):
                container.close()
                container, stream = _open(path, name)
        if picked is None:
            picked, size = _pick(container, stream, targets, start, fps, False, max_side)
    finally:
        container.close()
    if not picked:
        raise NoFramesError(f"{name} contains no video frames that can be decoded.")
    return Video(
        frames=np.stack([array for _, array in picked]),
        timestamps=[max(0.0, t) for t, _ in picked],
        duration=duration,
        fps=fps,
        source_size=size,
        path=path,
        codec=codec,
    )


_ENCODERS = {".mp4": "libx264", ".mkv": "libx264", ".mov": "libx264", ".ts": "libx264",
             ".webm": "libvpx-vp9", ".avi": "mpeg4", ".gif": "gif"}


def write_video(path, frames: np.ndarray, fps: float = 8.0, codec: str | None = None) -> None:
    """Encode ``frames`` [T, H, W, 3] uint8 RGB to ``path``; the codec follows the extension
    (h264 for .mp4/.mkv/.mov/.ts, vp9 for .webm, mpeg4 for .avi, gif for .gif) unless given.

    yuv420p is used except for gif (rgb8); odd sizes are padded by repeating edge pixels.
    """
    path = os.fspath(path)
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or not len(frames):
        raise ValueError(f"frames must be a non-empty [T, H, W, 3] uint8 array, not {frames.shape}")
    ext = os.path.splitext(path)[1].lower()
    encoder = codec or _ENCODERS.get(ext)
    if encoder is None:
        raise ValueError(f"no default codec for extension {ext!r}; pass codec=")
    pix_fmt = "rgb8" if encoder == "gif" else "yuv420p"
    if pix_fmt == "yuv420p":
        odd_h, odd_w = frames.shape[1] % 2, frames.shape[2] % 2
        frames = np.pad(frames, ((0, 0), (0, odd_h), (0, odd_w), (0, 0)), mode="edge")
    with av.open(path, "w") as out:
        stream = out.add_stream(encoder, rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], pix_fmt
        for array in frames:
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(array), format="rgb24")
            if pix_fmt != "yuv420p":
                frame = frame.reformat(format=pix_fmt)
            out.mux(stream.encode(frame))
        out.mux(stream.encode())
