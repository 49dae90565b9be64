"""Plotly figures of what each method did, from plain data (numpy arrays, lists, dicts).

Every function returns a `plotly.graph_objects.Figure` and takes no model, tensor or trace, so
the app, the CLI and evaluation reports can all draw the same panels:

- `token_mosaic`: the sampled frames as a grid, with the visual tokens one head keeps overlaid
  (and the asked object's ground-truth box where the clip has one);
- `head_partition`: layer x query-head grid coloured dense / full / sparse / dropped (HT-Sparse);
- `visual_head_scores`: layer x KV-head visual-head scores and each head's KV budget (SparseMM);
- `draft_rounds`: the answer as speculative decoding built it, round by round;
- `speedups`: speed (higher is better) and memory (lower is better) of each method relative to
  dense, beside the I/O model's prediction;
- `step_costs`: measured per-step times and each speculative method's bound from them;
- `whatif`: the same bound at a reference setting (`sparsevid.whatif`), against context length;
- `placeholder`: an empty panel that says what to run to fill it.
"""

from __future__ import annotations

import base64
import io
import math

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .metrics import top_share

KEPT_COLOUR = "rgba(255, 215, 0, 0.40)"
DROPPED_COLOUR = "rgba(0, 0, 0, 0.55)"  # visual tokens the head does not keep are dimmed
BOX_COLOUR = "#00e5ff"
ROLE_NAMES = ("dense (not routed)", "full", "sparse", "dropped")
ROLE_COLOURS = ("#d9d9d9", "#2a9d8f", "#f4a261", "#264653")
STATUS_COLOURS = {"prefill": "#9e9e9e", "accepted": "#2e7d32", "rejected": "#c62828", "bonus": "#1565c0"}
_MARGIN = dict(l=40, r=20, t=60, b=40)


def placeholder(title: str, message: str) -> go.Figure:
    """A panel with nothing to show yet: `message` in the middle (one invisible trace, so the
    figure renders like the others)."""
    fig = go.Figure(go.Scatter(x=[0], y=[0], mode="markers", marker=dict(opacity=0), hoverinfo="skip",
                               showlegend=False))
    fig.add_annotation(text=message, x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False,
                       font=dict(size=15, color="#555"))
    fig.update_layout(title=title, height=260, margin=_MARGIN, xaxis=dict(visible=False), yaxis=dict(visible=False),
                      meta=dict(placeholder=True), plot_bgcolor="white")
    return fig


def _image_uri(img: np.ndarray) -> str:
    """[H, W, 3] uint8 -> data URI (PNG, or JPEG when that is much smaller: camera footage)."""
    from PIL import Image

    pil = Image.fromarray(np.ascontiguousarray(img))
    best = None
    for fmt, opts in (("png", dict(optimize=True)), ("jpeg", dict(quality=88))):
        buf = io.BytesIO()
        pil.save(buf, format=fmt.upper(), **opts)
        if best is None or buf.tell() < len(best[1]) * 0.7:  # PNG unless JPEG is much smaller
            best = (fmt, buf.getvalue())
    return f"data:image/{best[0]};base64," + base64.b64encode(best[1]).decode()


def _resize(frame: np.ndarray, width: int, height: int) -> np.ndarray:
    from PIL import Image

    if frame.shape[1] == width and frame.shape[0] == height:
        return frame
    return np.asarray(Image.fromarray(frame).resize((width, height), Image.BILINEAR))


def token_mosaic(frames: np.ndarray, token_grid: np.ndarray, grid: tuple[int, int, int],
                 kept: np.ndarray | None = None, boxes: list | None = None, timestamps: list | None = None,
                 title: str = "Selected tokens", max_tiles: int = 32, tile_px: int | None = None,
                 columns: int | None = None, width_px: int = 1250) -> go.Figure:
    """The frames that carry visual tokens as a grid, kept tokens as semi-transparent cells.

    frames [T, H, W, 3] uint8: the sampled frames. token_grid [m_v, 3] int: (frame, row, col) of
    each visual token (a token of a temporal patch names its first frame). grid: (t, rows, cols).
    kept: bool [m_v] (None: no overlay). boxes: per sampled frame, [x0, y0, x1, y1] normalised to
    [0, 1] or None (None: no ground truth). timestamps: seconds per sampled frame.
    """
    token_grid = np.asarray(token_grid).reshape(-1, 3)
    _, rows, cols = grid
    tile_frames = sorted({int(f) for f in token_grid[:, 0]}) or list(range(min(len(frames), max_tiles)))
    shown = tile_frames
    if len(shown) > max_tiles:
        shown = [tile_frames[round(i * (len(tile_frames) - 1) / (max_tiles - 1))] for i in range(max_tiles)]
    n = len(shown)
    ncol = columns or min(n, 8 if n > 16 else 4 if n > 4 else n)
    nrow = math.ceil(n / ncol)
    if tile_px is None:  # fill about width_px with the tiles of one row
        tile_px = int(min(300, max(120, width_px / ncol - 10)))
    cs = max(2, min(48, round(tile_px / max(rows, cols))))  # display pixels per token cell
    tw, th = cols * cs, rows * cs
    gap, label_h = max(6, cs // 2), 16
    W = ncol * tw + (ncol - 1) * gap
    H = nrow * (th + label_h) + (nrow - 1) * gap
    mosaic = np.full((H, W, 3), 255, np.uint8)
    origins = {}
    for i, f in enumerate(shown):
        x0 = (i % ncol) * (tw + gap)
        y0 = (i // ncol) * (th + label_h + gap) + label_h
        origins[f] = (x0, y0)
        mosaic[y0:y0 + th, x0:x0 + tw] = _resize(np.asarray(frames[min(f, len(frames) - 1)]), tw, th)

    fig = go.Figure(go.Image(source=_image_uri(mosaic), x0=0.5, y0=0.5, hoverinfo="skip", name="frames"))
    if kept is not None:
        kept = np.asarray(kept, bool)
        z = np.zeros((len(shown), rows, cols))
        z[:] = np.nan
        index = {f: i for i, f in enumerate(shown)}
        for j, (f, r, c) in enumerate(token_grid):
            i = index.get(int(f))
            if i is not None and 0 <= r < rows and 0 <= c < cols:
                z[i, r, c] = 1.0 if kept[j] else 0.0
        scale = [[0, DROPPED_COLOUR], [0.5, DROPPED_COLOUR], [0.5, KEPT_COLOUR], [1, KEPT_COLOUR]]
        for i, f in enumerate(shown):
            x0, y0 = origins[f]
            t = f" at {timestamps[f]:.1f} s" if timestamps and f < len(timestamps) else ""
            rr, cc = np.mgrid[0:rows, 0:cols]
            custom = np.stack([rr, cc], -1)
            fig.add_trace(go.Heatmap(
                z=z[i], x0=x0 + cs / 2, dx=cs, y0=y0 + cs / 2, dy=cs, zmin=0, zmax=1, colorscale=scale,
                showscale=False, customdata=custom, xgap=1, ygap=1, name=f"frame {f}",
                hovertemplate=f"frame {f}{t}<br>row %{{customdata[0]}}, col %{{customdata[1]}}"
                              "<br>kept: %{z}<extra></extra>"))
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name="kept token",
                                 marker=dict(symbol="square", size=12, color=KEPT_COLOUR)))
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name="not kept (dimmed)",
                                 marker=dict(symbol="square", size=12, color=DROPPED_COLOUR)))
    n_box = 0
    for f in shown:
        x0, y0 = origins[f]
        t = f"frame {f}" + (f" · {timestamps[f]:.1f} s" if timestamps and f < len(timestamps) else "")
        fig.add_annotation(x=x0 + tw / 2, y=y0 - 2, text=t, showarrow=False, yanchor="bottom",
                           font=dict(size=10, color="#333"))
        b = boxes[f] if boxes is not None and f < len(boxes) else None
        if b is not None:
            n_box += 1
            fig.add_shape(type="rect", x0=x0 + b[0] * tw, x1=x0 + b[2] * tw, y0=y0 + b[1] * th, y1=y0 + b[3] * th,
                          line=dict(color=BOX_COLOUR, width=2))
    if n_box:
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", name="asked object (ground truth)",
                                 line=dict(color=BOX_COLOUR, width=2)))
    height = int(min(1200, max(260, 90 + min(width_px, W * 1.5) * H / max(W, 1))))
    fig.update_layout(title=title, height=height, margin=dict(l=10, r=10, t=70, b=10), plot_bgcolor="white",
                      legend=dict(orientation="h", yanchor="bottom", y=1.0, x=1, xanchor="right"),
                      xaxis=dict(visible=False, range=[0, W], constrain="domain"),
                      yaxis=dict(visible=False, range=[H, 0], scaleanchor="x", constrain="domain"))
    return fig


def on_object_share(kept: np.ndarray, token_grid: np.ndarray, grid: tuple[int, int, int],
                    boxes: list) -> tuple[float, float] | None:
    """(share of kept tokens whose cell overlaps the ground-truth box, share of all visual tokens
    that do) over frames with a box; None when no kept token falls on a frame with a box."""
    _, rows, cols = grid
    on, inbox = [], []
    for j, (f, r, c) in enumerate(np.asarray(token_grid)):
        b = boxes[f] if f < len(boxes) else None
        if b is None:
            continue
        hit = (c + 1) / cols > b[0] and c / cols < b[2] and (r + 1) / rows > b[1] and r / rows < b[3]
        inbox.append(hit)
        if kept[j]:
            on.append(hit)
    if not on:
        return None
    return float(np.mean(on)), float(np.mean(inbox))


def head_partition(roles: np.ndarray, saliency: np.ndarray | None = None, kv_lengths: np.ndarray | None = None,
                   title: str = "Head partition", role_names: tuple[str, ...] = ROLE_NAMES) -> go.Figure:
    """roles int [L, H]: -1 not routed (dense), 0 full, 1 sparse, 2 dropped; saliency π [L, H]
    (NaN where not routed) on hover; kv_lengths [L, Hkv] (prompt KV entries each KV head keeps).
    role_names: the name of each role code + 1 (at most len(ROLE_COLOURS))."""
    roles = np.asarray(roles, int)
    L, H = roles.shape
    code = roles + 1  # 0 dense, 1 full, 2 sparse, 3 dropped
    sal = np.full((L, H), np.nan) if saliency is None else np.asarray(saliency, float)
    names = np.array(role_names, dtype=object)[code]
    sal_txt = np.where(np.isnan(sal), "—", np.char.mod("%.3f", np.nan_to_num(sal)))
    if kv_lengths is not None:
        kv = np.asarray(kv_lengths)
        group = H // kv.shape[1]
        kv_txt = np.repeat(kv, group, axis=1).astype(str)
    else:
        kv_txt = np.full((L, H), "—", dtype=object)
    custom = np.stack([names, sal_txt, kv_txt], -1)
    n = len(role_names)
    scale = []
    for i, c in enumerate(ROLE_COLOURS[:n]):
        scale += [[i / n, c], [(i + 1) / n, c]]
    fig = go.Figure(go.Heatmap(
        z=code, x=list(range(H)), y=list(range(L)), zmin=-0.5, zmax=n - 0.5, colorscale=scale, xgap=2, ygap=2,
        customdata=custom,
        colorbar=dict(tickvals=list(range(n)), ticktext=list(role_names), title="role"),
        hovertemplate="layer %{y}, head %{x}<br>%{customdata[0]}<br>saliency π = %{customdata[1]}"
                      "<br>prompt KV kept by its KV head: %{customdata[2]}<extra></extra>"))
    if kv_lengths is not None and group > 1:  # GQA groups: the query heads sharing one KV head
        for g in range(1, H // group):
            fig.add_vline(x=g * group - 0.5, line=dict(color="#222", width=2))
    for layer in range(L):
        if (roles[layer] < 0).all():
            fig.add_annotation(x=(H - 1) / 2, y=layer, text="not routed (dense)", showarrow=False,
                               font=dict(size=11, color="#555"))
    fig.update_layout(title=title, height=max(280, 110 + 28 * L), margin=dict(_MARGIN, t=80),
                      xaxis=dict(title="query head (thick lines: GQA groups sharing one KV head)", dtick=1),
                      yaxis=dict(title="layer", autorange="reversed", dtick=1))
    return fig


def visual_head_scores(scores: np.ndarray | None, budgets: np.ndarray | None = None,
                       title: str = "Visual-head scores", score_axis: str | None = None,
                       subtitle: str | None = None) -> go.Figure:
    """scores [L, H or Hkv] (normalised to sum 1) and budgets [L, Hkv] (KV entries each KV head
    keeps), side by side; either may be None. score_axis names the scores' columns (default: "query
    head" when they outnumber the budget columns, else "KV head")."""
    panels = [(n, np.asarray(a, float)) for n, a in (("score", scores), ("budget", budgets)) if a is not None]
    if score_axis is None:
        wider = scores is not None and budgets is not None and np.shape(scores)[1] > np.shape(budgets)[1]
        score_axis = "query head" if wider else "KV head"
    fig = make_subplots(rows=1, cols=len(panels), horizontal_spacing=0.14,
                        subplot_titles=["visual-head score" if n == "score" else "KV budget (prompt entries kept)"
                                        for n, _ in panels])
    for i, (name, a) in enumerate(panels):
        L, G = a.shape
        fmt = "%{z:.3f}" if name == "score" else "%{z:.0f}"
        axis = score_axis if name == "score" else "KV head"
        fig.add_trace(go.Heatmap(
            z=a, x=list(range(G)), y=list(range(L)), colorscale="Viridis" if name == "score" else "Blues",
            xgap=2, ygap=2, name=name,
            colorbar=dict(x=0.43 if (len(panels) > 1 and i == 0) else 1.01, len=0.9, title=name, thickness=12,
                          tickformat=".2f" if name == "score" else "d"),
            hovertemplate=f"layer %{{y}}, {axis} %{{x}}<br>{name} {fmt}<extra></extra>"), row=1, col=i + 1)
        fig.update_xaxes(title_text=axis, dtick=1, row=1, col=i + 1)
        fig.update_yaxes(title_text="layer" if i == 0 else None, autorange="reversed", dtick=1, row=1, col=i + 1)
    notes = [f"top 5 % of heads hold {top_share(scores):.0%} of the score mass"] if scores is not None else []
    notes += [subtitle] if subtitle else []
    if notes:
        title += f"<br><sub>{' · '.join(notes)}</sub>"
    L = panels[0][1].shape[0] if panels else 1
    fig.update_layout(title=title, height=max(280, 110 + 28 * L), margin=_MARGIN)
    return fig


def draft_rounds(first: str, rounds: list[dict], title: str = "Draft tokens") -> go.Figure:
    """The answer built round by round.

    first: the token dense chose at prefill. rounds: one dict per round with `proposed` (token
    strings), `accepted` (count), `bonus` (string or None), `draft_s`, `verify_s` (seconds).
    Row r shows round r's committed tokens at their output positions: the accepted proposals
    (green) then dense's bonus token (blue); the rejected proposals (red) sit just under them, from
    the position the bonus replaced. Reading green and blue cells left to right, top to bottom,
    gives the answer.
    """
    cells = {k: dict(x=[], y=[], text=[], hover=[]) for k in STATUS_COLOURS}

    def add(kind, x, y, tok, info):
        c = cells[kind]
        c["x"].append(x)
        c["y"].append(y)
        c["text"].append(tok)
        c["hover"].append(f"{info}<br>token <b>{_html(tok)}</b> at output position {x}")

    add("prefill", 0, 0, first, "first token (dense, at prefill)")
    pos = 1
    for r, rd in enumerate(rounds, start=1):
        times = f"round {r}: draft {rd.get('draft_s', 0) * 1e3:.1f} ms, verify {rd.get('verify_s', 0) * 1e3:.1f} ms"
        a = int(rd["accepted"])
        for j, tok in enumerate(rd["proposed"]):
            kind = "accepted" if j < a else "rejected"
            add(kind, pos + j, r + (0.42 if kind == "rejected" else 0), tok,
                f"{times}<br>{kind} (proposal {j + 1} of {len(rd['proposed'])})")
        if rd.get("bonus") is not None:
            add("bonus", pos + a, r, rd["bonus"], f"{times}<br>bonus token from the dense verification")
        pos += a + 1
    n = len(rounds)
    n_x = max([max(c["x"], default=0) for c in cells.values()]) + 1
    row_px = max(24.0, min(70.0, 1000 / (n + 1.4)))  # pixels per round: the figure stays under ~1.2k px
    size = int(max(8, min(40, 1100 / max(n_x, 1), 0.42 * row_px)))  # rejected sit 0.42 rows lower
    fig = go.Figure()
    for kind, c in cells.items():
        if not c["x"] and kind != "prefill":
            continue
        s = int(size * 0.8) if kind == "rejected" else size
        fig.add_trace(go.Scatter(
            x=c["x"], y=c["y"], mode="markers+text" if size >= 18 else "markers", name=kind,
            text=[t if len(t) <= 6 else t[:5] + "…" for t in c["text"]], textposition="middle center",
            textfont=dict(color="white", size=max(9, int(s / 3.2))), hovertext=c["hover"], hoverinfo="text",
            marker=dict(symbol="square", size=s, color=STATUS_COLOURS[kind])))
    fig.update_layout(title=title, height=int(max(260, 150 + row_px * (n + 1.4))), margin=_MARGIN,
                      plot_bgcolor="white", legend=dict(orientation="h", yanchor="bottom", y=1.0, x=1, xanchor="right"),
                      xaxis=dict(title="output position (token index in the answer)", showgrid=False, zeroline=False,
                                 tickmode="linear", tick0=0, dtick=max(1, math.ceil(n_x / 30)), tickformat="d"),
                      yaxis=dict(title="round", range=[n + 0.8, -0.6], tickvals=list(range(n + 1)),
                                 ticktext=["prefill"] + [str(r) for r in range(1, n + 1)], zeroline=False,
                                 showgrid=False))
    return fig


SPEED_BARS = (("speedup", "decode speedup (tokens/s ÷ dense)", "#2a9d8f"),
              ("e2e_speedup", "end to end (dense time ÷ time)", "#8ab17d"),
              ("predicted_speedup", "I/O model prediction", "#9c89b8"))
MEMORY_BARS = (("kv_ratio", "KV memory ÷ dense", "#e76f51"),)


def _html(text: str) -> str:
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _ratio_bars(fig: go.Figure, rows: list[dict], bars: tuple, col: int) -> float:
    """Grouped bars of `bars` (key, name, colour) per row into subplot `col`; returns the largest value."""
    labels = [r["label"] for r in rows]
    top = 1.0
    for key, name, colour in bars:
        ys = [r.get(key) for r in rows]
        if all(y is None for y in ys):
            continue
        top = max([top] + [y for y in ys if y is not None])
        fig.add_trace(go.Bar(
            x=labels, y=[y if y is not None else 0 for y in ys], name=name, marker_color=colour,
            text=[f"{y:.2f}×" if y is not None else "n/a" for y in ys], textposition="outside", cliponaxis=False,
            hovertext=[f"{r['label']}<br>{name}: " + (f"{y:.3f}" if y is not None else "n/a") + (
                f"<br>{r['hover']}" if r.get("hover") else "") for r, y in zip(rows, ys)],
            hoverinfo="text"), row=1, col=col)
    return top


def speedups(rows: list[dict], title: str = "Speed and memory relative to dense") -> go.Figure:
    """rows: one dict per method (dense excluded) with `label` and any of speedup, e2e_speedup,
    predicted_speedup (speed, higher is better), kv_ratio (memory, lower is better) as ratios to
    dense (None: n/a), plus `hover` (extra text). Two subplots: speed and memory."""
    fig = make_subplots(rows=1, cols=2, column_widths=[0.64, 0.36], horizontal_spacing=0.08,
                        subplot_titles=["Speed ÷ dense: higher is better", "KV memory ÷ dense: lower is better"])
    top_speed = _ratio_bars(fig, rows, SPEED_BARS, 1)
    top_mem = _ratio_bars(fig, rows, MEMORY_BARS, 2)
    for col, top in ((1, top_speed), (2, top_mem)):
        fig.add_hline(y=1.0, line=dict(color="#444", dash="dash"), row=1, col=col)
        fig.update_yaxes(range=[0, top * 1.25], row=1, col=col, title_text="ratio to dense (dense = 1)" if col == 1
                         else None)
        fig.update_xaxes(tickangle=-20, automargin=True, row=1, col=col)
    fig.update_layout(title=title, barmode="group", height=460, margin=dict(l=60, r=20, t=110, b=90),
                      legend=dict(orientation="h", yanchor="bottom", y=1.08, x=1, xanchor="right"))
    return fig


def step_costs(steps: list[dict], bounds: list[dict], title: str = "Where the time goes") -> go.Figure:
    """Measured per-step times and each speculative method's bound from them.

    steps: one dict per bar: `label`, `ms` (milliseconds), `group` ("dense" | a method's label),
    `hover`. bounds: one dict per speculative method: `label`, `measured` (decode speedup or None),
    `bound` (σ at the measured acceptance and step costs), `bound_full` (σ at acceptance 1),
    `predicted` (the I/O model's σ), `hover`."""
    fig = make_subplots(rows=1, cols=2, column_widths=[0.5, 0.5], horizontal_spacing=0.1,
                        subplot_titles=["Measured time per step (ms)", "Decode speedup: measured vs bound"])
    colours = {"dense": "#6c757d", "draft": "#f4a261", "verify": "#264653", "prefill": "#adb5bd"}
    for kind in ("prefill", "dense", "draft", "verify"):
        rows = [s for s in steps if s["kind"] == kind]
        if rows:
            fig.add_trace(go.Bar(x=[s["label"] for s in rows], y=[s["ms"] for s in rows], name=kind + (
                " pass" if kind == "verify" else " step" if kind in ("dense", "draft") else ""),
                marker_color=colours[kind], text=[f"{s['ms']:.1f}" for s in rows], textposition="outside",
                cliponaxis=False, hovertext=[s.get("hover", "") for s in rows], hoverinfo="text"), row=1, col=1)
    top = max([s["ms"] for s in steps] or [1.0])
    fig.update_yaxes(range=[0, top * 1.25], title_text="ms", row=1, col=1)
    bars = (("measured", "measured decode speedup", "#2a9d8f"), ("bound", "bound at measured acceptance", "#e9c46a"),
            ("bound_full", "bound at acceptance 1", "#f4a261"), ("predicted", "I/O model prediction", "#9c89b8"))
    top = _ratio_bars(fig, bounds, bars, 2) if bounds else 1.0
    fig.add_hline(y=1.0, line=dict(color="#444", dash="dash"), row=1, col=2)
    fig.update_yaxes(range=[0, top * 1.25], title_text="× dense", row=1, col=2)
    fig.update_xaxes(tickangle=-20, automargin=True)
    fig.update_layout(title=title, barmode="group", height=460, margin=dict(l=60, r=20, t=110, b=90),
                      legend=dict(orientation="h", yanchor="bottom", y=1.08, x=1, xanchor="right"))
    return fig


def whatif(rows: list[dict], title: str = "What if: the same formula at a reference setting") -> go.Figure:
    """Predicted speedup against visual tokens, one line per batch, at the chosen acceptance (solid)
    and at acceptance 1 (dotted). rows: `whatif.sweep` rows (batch, visual_tokens, speedup,
    speedup_full_acceptance, dense_step_ms, draft_cost, tokens_per_round)."""
    fig = go.Figure()
    colours = ["#2a9d8f", "#e76f51", "#264653", "#f4a261"]
    for i, b in enumerate(sorted({r["batch"] for r in rows})):
        rs = [r for r in rows if r["batch"] == b]
        x = [r["visual_tokens"] for r in rs]
        hover = [f"batch {b}, {r['visual_tokens'] // 1024}k visual tokens<br>dense step {r['dense_step_ms']:.2f} ms"
                 f"<br>draft step c = {r['draft_cost']:.2f} dense steps<br>Ω = {r['tokens_per_round']:.2f} tokens/round"
                 f"<br>σ = {r['speedup']:.2f}× (at acceptance 1: {r['speedup_full_acceptance']:.2f}×)" for r in rs]
        c = colours[i % len(colours)]
        fig.add_trace(go.Scatter(x=x, y=[r["speedup"] for r in rs], mode="lines+markers", name=f"batch {b}",
                                 line=dict(color=c, width=3), hovertext=hover, hoverinfo="text"))
        fig.add_trace(go.Scatter(x=x, y=[r["speedup_full_acceptance"] for r in rs], mode="lines",
                                 name=f"batch {b}, acceptance 1", line=dict(color=c, dash="dot"), hoverinfo="skip"))
    fig.add_hline(y=1.0, line=dict(color="#444", dash="dash"), annotation_text="dense = 1",
                  annotation_position="bottom right")
    fig.update_layout(title=title, height=420, margin=dict(l=60, r=20, t=90, b=60),
                      xaxis=dict(title="visual tokens in the context", tickformat="~s"),
                      yaxis=dict(title="predicted decode speedup (× dense)", rangemode="tozero"),
                      legend=dict(orientation="h", yanchor="bottom", y=1.0, x=1, xanchor="right"))
    return fig
