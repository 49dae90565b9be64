"""Tests for sparsevid.video: real files of every supported format, written by the tests."""

import math
import os

import av
import numpy as np
import pytest

from sparsevid import video as V
from sparsevid.errors import VideoError
from sparsevid.video import (
    FileTooLargeError,
    NoFramesError,
    NotAVideoError,
    NoVideoStreamError,
    VideoNotFoundError,
    VideoTooLongError,
    load_video,
    write_video,
)

BITS = 12  # frame index written as 8x8 black/white blocks, 8 per row: survives any codec


def coded_frames(n: int, h: int = 48, w: int = 64) -> np.ndarray:
    """[n, h, w, 3] uint8 frames; frame i shows i in binary (block b lit <=> bit b set)."""
    frames = np.zeros((n, h, w, 3), np.uint8)
    for i in range(n):
        for b in range(BITS):
            if i >> b & 1:
                r, c = divmod(b, 8)
                frames[i, r * 8 : r * 8 + 8, c * 8 : c * 8 + 8] = 255
    return frames


def read_index(frame: np.ndarray) -> int:
    """Inverse of coded_frames for one [H, W, 3] frame, using each block's centre."""
    index = 0
    for b in range(BITS):
        r, c = divmod(b, 8)
        if frame[r * 8 + 2 : r * 8 + 6, c * 8 + 2 : c * 8 + 6].mean() > 128:
            index |= 1 << b
    return index


def expected_indices(total: int, n: int) -> list[int]:
    """Frame on screen at t_i = (i + 0.5) * duration / n, for a constant frame rate."""
    return sorted({min(total - 1, math.floor((i + 0.5) * total / n)) for i in range(n)})


FORMATS = {  # extension -> (fps, decoder name)
    ".mp4": (8, "h264"),
    ".webm": (8, "vp9"),
    ".mkv": (8, "h264"),
    ".mov": (8, "h264"),
    ".avi": (8, "mpeg4"),
    ".ts": (8, "h264"),
    ".gif": (10, "gif"),  # gif delays are in 1/100 s: 10 fps is exact
}


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    """One 40-frame 64x48 file per format."""
    root = tmp_path_factory.mktemp("videos")
    paths = {}
    for ext, (fps, _) in FORMATS.items():
        paths[ext] = str(root / f"clip{ext}")
        write_video(paths[ext], coded_frames(40), fps=fps)
    return paths


@pytest.mark.parametrize("ext", list(FORMATS))
def test_formats_sample_uniformly(videos, ext):
    fps, codec = FORMATS[ext]
    v = load_video(videos[ext], num_frames=8)
    assert v.frames.shape == (8, 48, 64, 3) and v.frames.dtype == np.uint8
    assert expected_indices(40, 8) == [2, 7, 12, 17, 22, 27, 32, 37]
    assert [read_index(f) for f in v.frames] == expected_indices(40, 8)
    assert v.timestamps == pytest.approx([i / fps for i in expected_indices(40, 8)], abs=0.011)
    assert all(a < b for a, b in zip(v.timestamps, v.timestamps[1:]))
    assert v.duration == pytest.approx(40 / fps, abs=0.02)
    assert v.fps == pytest.approx(fps, rel=0.02)
    assert v.source_size == (64, 48)
    assert v.codec == codec and v.path == videos[ext]


@pytest.mark.parametrize("n", [1, 3, 16, 40])
def test_num_frames_variants(videos, n):
    v = load_video(videos[".mp4"], num_frames=n)
    assert [read_index(f) for f in v.frames] == expected_indices(40, n)
    assert len(v.frames) == len(v.timestamps) == n


@pytest.mark.parametrize("ext", [".mp4", ".gif"])
def test_fewer_frames_than_requested_returns_each_once(tmp_path, ext):
    path = str(tmp_path / f"short{ext}")
    write_video(path, coded_frames(5), fps=10)
    v = load_video(path, num_frames=16)
    assert [read_index(f) for f in v.frames] == [0, 1, 2, 3, 4]  # T <= num_frames, no repeats
    assert len(v.timestamps) == 5


def test_unknown_duration_counts_packets(videos, monkeypatch):
    monkeypatch.setattr(V, "_duration", lambda container, stream: None)
    for ext in (".gif", ".mkv"):
        v = load_video(videos[ext], num_frames=8)
        assert v.duration == pytest.approx(40 / FORMATS[ext][0], abs=0.02)
        assert [read_index(f) for f in v.frames] == expected_indices(40, 8)


def test_downscale_keeps_aspect(tmp_path):
    path = str(tmp_path / "big.mp4")
    write_video(path, np.full((4, 100, 200, 3), 90, np.uint8))
    v = load_video(path, num_frames=2, max_side=64)
    assert v.frames.shape == (2, 32, 64, 3)
    assert v.source_size == (200, 100)
    assert load_video(path, num_frames=2).frames.shape == (2, 100, 200, 3)  # under the limit: as is


def test_odd_size_is_padded_for_yuv420(tmp_path):
    path = str(tmp_path / "odd.mp4")
    write_video(path, coded_frames(6, h=47, w=63))
    v = load_video(path, num_frames=6)
    assert v.frames.shape == (6, 48, 64, 3)
    assert [read_index(f) for f in v.frames] == list(range(6))


def test_write_video_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError):
        write_video(str(tmp_path / "a.mp4"), np.zeros((2, 8, 8, 3), np.float32))
    with pytest.raises(ValueError):
        write_video(str(tmp_path / "a.xyz"), np.zeros((2, 8, 8, 3), np.uint8))


def test_write_video_codec_override(tmp_path):
    path = str(tmp_path / "override.mkv")
    write_video(path, coded_frames(4), codec="mpeg4")
    v = load_video(path, num_frames=4)
    assert v.codec == "mpeg4" and [read_index(f) for f in v.frames] == [0, 1, 2, 3]



# --- rotation ------------------------------------------------------------------------

def write_rotated(path: str, degrees: int) -> None:
    """64x48 landscape mp4 with a white block at the top-left and a display matrix
    rotating it ``degrees`` counter-clockwise (a phone's `rotate=90` tag is -90 here)."""
    frame = np.zeros((48, 64, 3), np.uint8)
    frame[:16, :16] = 255
    with av.open(path, "w") as out:
        stream = out.add_stream("libx264", rate=8)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        stream.set_display_rotation(degrees)
        for _ in range(4):
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(stream.encode())


@pytest.mark.parametrize(
    "degrees, shape, corner",
    [
        (-90, (64, 48), "top_right"),  # rotate=90 tag (clockwise): portrait phone video
        (90, (64, 48), "bottom_left"),
        (180, (48, 64), "bottom_right"),
        (0, (48, 64), "top_left"),
    ],
)
def test_rotation_is_applied(tmp_path, degrees, shape, corner):
    path = str(tmp_path / "rot.mp4")
    write_rotated(path, degrees)
    v = load_video(path, num_frames=2)
    frame = v.frames[0]
    assert frame.shape[:2] == shape
    assert v.source_size == (shape[1], shape[0])
    h, w = shape
    corners = {
        "top_left": frame[:8, :8], "top_right": frame[:8, w - 8 :],
        "bottom_left": frame[h - 8 :, :8], "bottom_right": frame[h - 8 :, w - 8 :],
    }
    lit = {name for name, patch in corners.items() if patch.mean() > 128}
    assert lit == {corner}


# --- long videos: bounded memory, seeking agrees with streaming -------------------------

@pytest.fixture(scope="module")
def long_video(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("long") / "long.mp4")
    write_video(path, coded_frames(2000, h=32, w=64), fps=25)  # 80 s
    return path


def instrument(monkeypatch):
    counts = {"decoded": 0, "converted": 0}
    decode, convert = V._decode, V._frame_to_array

    def counting_decode(container, stream):
        for frame in decode(container, stream):
            counts["decoded"] += 1
            yield frame

    def counting_convert(*args):
        counts["converted"] += 1
        return convert(*args)

    monkeypatch.setattr(V, "_decode", counting_decode)
    monkeypatch.setattr(V, "_frame_to_array", counting_convert)
    return counts


def test_long_video_seeks_and_keeps_only_samples(long_video, monkeypatch):
    counts = instrument(monkeypatch)
    v = load_video(long_video, num_frames=8)
    assert [read_index(f) for f in v.frames] == expected_indices(2000, 8)
    assert v.frames.shape == (8, 32, 64, 3)
    assert counts["converted"] == 8  # only the sampled frames ever become arrays
    assert counts["decoded"] < 2000  # seeking skipped part of the file


def test_streaming_matches_seeking(long_video, monkeypatch):
    monkeypatch.setattr(V, "SEEK_GAP_S", 1e9)  # forces the single pass
    counts = instrument(monkeypatch)
    v = load_video(long_video, num_frames=8)
    assert [read_index(f) for f in v.frames] == expected_indices(2000, 8)
    assert counts["converted"] == 8 and counts["decoded"] >= 1875  # up to the last target


@pytest.mark.parametrize("ext", [".ts", ".mkv", ".avi", ".webm"])
def test_seeking_in_other_containers(tmp_path, monkeypatch, ext):
    """mpeg-ts seeks land just after the target on a non-keyframe: seeking backs off."""
    path = str(tmp_path / f"long{ext}")
    write_video(path, coded_frames(1000, h=16, w=64), fps=25)  # 40 s, 8 targets 5 s apart
    counts = instrument(monkeypatch)
    v = load_video(path, num_frames=8)
    assert [read_index(f) for f in v.frames] == expected_indices(1000, 8)
    assert counts["decoded"] < 1000  # seeking worked: no fallback to a full pass


def test_failed_seek_falls_back_to_one_pass(long_video, monkeypatch):
    real_pick = V._pick

    def pick(container, stream, targets, start, fps, seek, max_side):
        if seek:
            raise V._SeekFailed  # as when a seek lands after its target
        return real_pick(container, stream, targets, start, fps, seek, max_side)

    monkeypatch.setattr(V, "_pick", pick)
    counts = instrument(monkeypatch)
    v = load_video(long_video, num_frames=8)
    assert [read_index(f) for f in v.frames] == expected_indices(2000, 8)
    assert counts["decoded"] >= 1875


# --- bad input -------------------------------------------------------------------------

def test_text_file_named_mp4(tmp_path):
    path = tmp_path / "notes.mp4"
    path.write_text("this is not a video\n" * 50)
    with pytest.raises(NotAVideoError, match="notes.mp4"):
        load_video(path)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(VideoNotFoundError, match="nope.mp4"):
        load_video(tmp_path / "nope.mp4")
    assert issubclass(VideoNotFoundError, NotAVideoError)
    with pytest.raises(NotAVideoError):
        load_video(tmp_path)


@pytest.mark.parametrize("ext, codec", [(".wav", "pcm_s16le"), (".m4a", "aac")])
def test_audio_only(tmp_path, ext, codec):
    path = str(tmp_path / f"tone{ext}")
    samples = (np.sin(2 * np.pi * 440 * np.arange(16000) / 16000) * 8000).astype(np.int16)
    with av.open(path, "w") as out:
        stream = out.add_stream(codec, rate=16000, layout="mono")
        frame = av.AudioFrame.from_ndarray(samples[None], format="s16", layout="mono")
        frame.sample_rate = 16000
        if codec == "aac":
            frame = av.AudioResampler(format="fltp", layout="mono", rate=16000).resample(frame)[0]
        out.mux(stream.encode(frame))
        out.mux(stream.encode())
    with pytest.raises(NoVideoStreamError, match=f"tone{ext}"):
        load_video(path)


def test_video_stream_without_frames(tmp_path):
    path = str(tmp_path / "empty.avi")  # the avi muxer keeps a stream that got no packets
    with av.open(path, "w") as out:
        stream = out.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        out.start_encoding()  # writes the header; no packet follows
    with pytest.raises(NoFramesError, match="empty.avi"):
        load_video(path)


def test_file_too_large(videos):
    size = os.path.getsize(videos[".mp4"])
    with pytest.raises(FileTooLargeError, match=r"clip\.mp4 is .*; the limit is 100 bytes\."):
        load_video(videos[".mp4"], max_bytes=100)
    assert load_video(videos[".mp4"], num_frames=2, max_bytes=size).frames.shape[0] == 2


def test_video_too_long(videos):
    with pytest.raises(VideoTooLongError, match=r"clip\.mp4 lasts 5 s; the limit is 2 s\."):
        load_video(videos[".mp4"], max_duration=2.0)


def test_sizes_and_spans_read_well():
    assert V._size(3.2 * 2**30) == "3.2 GB" and V._size(500 * 2**20) == "500 MB"
    assert V._size(100) == "100 bytes"
    assert V._span(2.0) == "2 s" and V._span(600) == "10 min"
    assert V._span(3600) == "1 h" and V._span(5400) == "1 h 30 min"


def test_truncated_header(videos, tmp_path):
    path = tmp_path / "cut.mp4"
    data = open(videos[".mp4"], "rb").read()
    path.write_bytes(data[:1024])
    with pytest.raises(VideoError, match="cut.mp4"):
        load_video(path)


@pytest.mark.parametrize("ext", [".mp4", ".mkv", ".ts", ".webm", ".avi", ".gif"])
@pytest.mark.parametrize("keep", [0.1, 0.5, 0.9])
def test_damaged_files_never_crash(videos, tmp_path, ext, keep):
    """Truncated or corrupted files give either a usable Video or a VideoError."""
    data = bytearray(open(videos[ext], "rb").read())
    cut = int(len(data) * keep)
    for name, blob in {
        f"cut{ext}": data[:cut],
        f"noise{ext}": data[:64] + np.random.default_rng(1).bytes(len(data) - 64),
        f"flipped{ext}": data[:cut] + bytes(b ^ 0x5A for b in data[cut:]),
    }.items():
        path = tmp_path / name
        path.write_bytes(bytes(blob))
        try:
            v = load_video(path, num_frames=8)
        except VideoError as e:
            assert name in str(e) and "\n" not in str(e)
        else:
            assert 1 <= len(v.frames) <= 8 and v.frames.dtype == np.uint8


def test_messages_are_one_readable_sentence(tmp_path):
    path = tmp_path / "sub" / "holiday.mp4"
    path.parent.mkdir()
    path.write_text("x")
    with pytest.raises(NotAVideoError) as info:
        load_video(path)
    message = str(info.value)
    assert message.endswith(".") and "holiday.mp4" in message
    assert str(tmp_path) not in message and "Errno" not in message
