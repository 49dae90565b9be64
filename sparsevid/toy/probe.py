"""What the embedded model's vision tower tells of motion: linear probes of an object's direction
read from the tower's output (the merged visual tokens the language model sees).

Qwen2-VL's tower attends within one temporal patch (here two frames) and no further, so a token sees
its object move only when the object is in both of its frames. Three probes, each a linear
classifier trained on clips of training seeds and scored on clips of held-out seeds:

- `two_frame_tokens`: tokens whose object is in both their frames (motion visible in the token);
- `one_frame_tokens`: tokens whose object is in one of their frames only (an object entering or
  leaving the cell, or one seen in two frames that straddle a pair: frames 7 and 8);
- `glimpsed_objects`: objects seen in exactly two frames that straddle a pair (no token of them
  sees them move), from the mean of their tokens in each of the two pairs and the difference
  (what the language model's attention, an average, could put together).

Chance is 0.25 (four directions). The clips are drawn in the original world (`glimpses=True`),
the one where glimpsed objects occur."""
from __future__ import annotations

import numpy as np
import torch

from .clips import COLOURS, DIRECTIONS
from .data import object_cover, token_labels
from .model import MERGE, preprocess_frames
from .questions import NARRATE, make_sample, seen_moving

TEST_SEED_BASE = 1_650_000_000  # the selection seeds: neither training nor the reported tables


def _linear_probe(x: torch.Tensor, y: torch.Tensor, train: torch.Tensor, steps: int = 600) -> float:
    """Accuracy on the rows not in `train` of a linear classifier fitted to the rows in it."""
    if train.all() or not train.any():
        return float("nan")
    mu, sd = x[train].mean(0), x[train].std(0) + 1e-5
    z = (x - mu) / sd
    torch.manual_seed(0)
    lin = torch.nn.Linear(z.shape[1], len(DIRECTIONS))
    opt = torch.optim.Adam(lin.parameters(), lr=1e-2, weight_decay=1e-3)
    with torch.enable_grad():  # the callers hold the tower's features under no_grad
        for _ in range(steps):
            loss = torch.nn.functional.cross_entropy(lin(z[train]), y[train])
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        return float((lin(z[~train]).argmax(-1) == y[~train]).float().mean())


@torch.no_grad()
def direction_probes(model_dir: str, n_train: int = 1200, n_test: int = 300, frames=(8, 16),
                     progress: bool = True) -> dict:
    """The three probes over `n_train` + `n_test` narration clips (every object of a clip counts),
    their lengths cycling over `frames` -> {probe: {"accuracy", "n_test"}}."""
    from tqdm import tqdm

    from .evaluate import load_toy

    _, model, _ = load_toy(model_dir)
    model.eval()
    tok_x, tok_y, tok_one, tok_test = [], [], [], []
    obj_x, obj_y, obj_test = [], [], []
    for i in tqdm(range(n_train + n_test), desc="toy probe", disable=not progress, mininterval=2.0):
        test = i >= n_train
        T = frames[i % len(frames)]
        s = make_sample((TEST_SEED_BASE if test else 900_000_000) + i, T, NARRATE, glimpses=True)
        pv, thw = preprocess_frames(s.clip.frames)
        gt, gh, gw = (int(v) for v in thw[0])
        mh, mw = gh // MERGE, gw // MERGE
        flat = model.model.visual(pv, grid_thw=thw).pooler_output  # [gt * cells, hidden]
        v = flat.reshape(gt, mh * mw, -1)
        owner = torch.from_numpy(token_labels(s.clip, gt, mh, mw)[:, 0])  # colour+1 of the token's object
        cover = object_cover(s.clip, gt, mh, mw)
        for o in s.clip.objects:
            d = DIRECTIONS.index(o.direction)
            mine = owner == COLOURS.index(o.colour) + 1  # the tokens labelled with it (colours are unique in a clip)
            cov = torch.from_numpy(cover[o.id])  # [gt, 2, cells]
            one = (cov == 0).any(1).reshape(-1)
            tok_x.append(flat[mine])
            tok_y.append(torch.full((int(mine.sum()),), d))
            tok_one.append(one[mine])
            tok_test.append(torch.full((int(mine.sum()),), test))
            seen = np.flatnonzero(o.boxes[:, 0] >= 0)
            if len(seen) == 2 and not seen_moving(o, T):
                p = int(seen[0]) // 2
                w0, w1 = cov[p].sum(0).float(), cov[p + 1].sum(0).float()
                if w0.sum() and w1.sum():
                    e, late = w0 @ v[p] / w0.sum(), w1 @ v[p + 1] / w1.sum()
                    obj_x.append(torch.cat([e, late, late - e]))
                    obj_y.append(d)
                    obj_test.append(test)
    x, y, one, test = torch.cat(tok_x), torch.cat(tok_y), torch.cat(tok_one), torch.cat(tok_test)
    out = {}
    for name, m in (("two_frame_tokens", ~one), ("one_frame_tokens", one)):
        out[name] = {"accuracy": _linear_probe(x[m], y[m], ~test[m]), "n_test": int((m & test).sum())}
    if obj_x:
        ot = torch.tensor(obj_test)
        out["glimpsed_objects"] = {"accuracy": _linear_probe(torch.stack(obj_x), torch.tensor(obj_y), ~ot),
                                   "n_test": int(ot.sum())}
    return out


def _ridge_r2(x: torch.Tensor, y: torch.Tensor, train: torch.Tensor) -> dict:
    """R^2 and mean absolute error, on the rows not in `train`, of a ridge regression of y on x
    (standardised) fitted to the rows in it, its penalty chosen on the last quarter of those rows
    (rows come clip by clip, so that is other clips) -> {"r2", "mae"}."""
    mu, sd = x[train].mean(0), x[train].std(0) + 1e-5
    x = torch.cat([(x - mu) / sd, torch.ones(len(x), 1)], 1).double()
    y = y.double()

    def fit(rows: torch.Tensor, lam: float) -> torch.Tensor:
        a = x[rows]
        return torch.linalg.solve(a.T @ a + lam * len(a) * torch.eye(x.shape[1], dtype=x.dtype), a.T @ y[rows])

    idx = torch.nonzero(train).squeeze(1)
    fit_rows, val_rows = idx[: len(idx) * 3 // 4], idx[len(idx) * 3 // 4:]
    lam = min((1e-4, 1e-3, 1e-2, 1e-1, 1.0),
              key=lambda l: float(((x[val_rows] @ fit(fit_rows, l) - y[val_rows]) ** 2).mean()))
    err = x[~train] @ fit(idx, lam) - y[~train]
    return {"r2": float(1 - (err ** 2).mean() / y[~train].var()), "mae": float(err.abs().mean())}


@torch.no_grad()
def time_probes(model_dir: str, n: int = 150, frames=(64, 96, 128, 192, 256), progress: bool = True) -> dict:
    """What the language model's rows know of time in clips without a progress bar: ridge regressions,
    from each layer's output, of a visual token's frame pair (log(p + 1)) and, from the rows after the
    video, of the clip's length (log of its pairs). "Beginning / middle / end" without a bar is the one
    against the other. `n` "when" questions (the last fifth scored), their lengths cycling over `frames`
    -> {"visual_pair" | "clip_length": [{"r2", "mae"} per hidden state: embeddings, layer 1, ...]}."""
    from dataclasses import replace

    from tqdm import tqdm

    from .clips import LEGACY
    from .data import collate, encode
    from .evaluate import load_toy
    from .train import time_rows  # the time loss's rows and targets: the probe reads the same ones

    tok, model, special = load_toy(model_dir, attn="sdpa")
    rng = np.random.default_rng(0)
    vis_x, vis_y, vis_test, txt_x, txt_y, txt_test = [], [], [], [], [], []
    for i in tqdm(range(n), desc="toy time probe", disable=not progress, mininterval=2.0):
        s = make_sample(TEST_SEED_BASE + i, frames[i % len(frames)], "when", style=replace(LEGACY, bar="none"),
                        glimpses=False)
        e = encode(s, tok, special, with_answer=False)
        batch = collate([e], special["<|endoftext|>"], special["<|video_pad|>"])
        batch.pop("labels")
        hs = torch.stack(model(**batch, output_hidden_states=True).hidden_states)[:, 0]  # [layers + 1, L, hidden]
        _, rows, y, vis = time_rows([e])
        pick = torch.from_numpy(rng.choice(e.n_visual, min(60, e.n_visual), replace=False))
        vis_x.append(hs[:, rows[vis][pick]])
        vis_y.append(y[vis][pick])
        txt_x.append(hs[:, rows[~vis]])
        txt_y.append(y[~vis])
        test = i >= n - n // 5
        vis_test.append(torch.full((len(pick),), test))
        txt_test.append(torch.full((int((~vis).sum()),), test))
    out = {}
    for name, xs, ys, ts in (("visual_pair", vis_x, vis_y, vis_test), ("clip_length", txt_x, txt_y, txt_test)):
        x, y, t = torch.cat(xs, 1), torch.cat(ys), torch.cat(ts)
        out[name] = [_ridge_r2(x[k], y, ~t) for k in range(x.shape[0])]
    return out
