"""The embedded model's calibration source for SparseMM's visual-head scores (`sparsevid.calibration`)."""

from __future__ import annotations

from typing import Iterator

from ..calibration import CalibSample, Item, Source, TextImages, is_embedded


class ToyClips:
    """The embedded model's procedural clips: questions whose answers name an object (its colour or
    shape), items = every object of the clip, named by its colour and shape, with its per-frame box.
    Seeds from `seed` on (outside the training range and the evaluation seeds)."""

    name = "toy-clips"
    qtypes = ("colour", "shape", "describe")

    def __init__(self, frames: tuple[int, ...] = (16, 32), seed: int = 1_800_000_000):
        self.frames, self.seed = frames, seed

    def samples(self, loaded, n: int) -> Iterator[CalibSample]:
        from .questions import make_sample

        for i in range(n):
            s = make_sample(self.seed + i, self.frames[i % len(self.frames)], self.qtypes[i % len(self.qtypes)])
            items = [Item((o.colour, o.shape), o.boxes) for o in s.clip.objects]
            yield CalibSample(s.clip.frames, s.question, items)


def default_source(loaded) -> Source:
    """The embedded model's clips for the embedded model, rendered text images for any other."""
    return ToyClips() if is_embedded(loaded) else TextImages()
