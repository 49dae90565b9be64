"""Evaluation over a manifest of clips: `python -m sparsevid eval`, in one process or several.

Manifest: JSON lines ``{"video": path, "question": ..., "answer": optional reference,
"answers": optional list of other answers that count as correct too (a narration's other orders of
objects that appear together), "boxes": optional ground truth, "frames": optional frames to sample,
"id": optional}``; video paths
are relative to the manifest's folder; ``--data DIR`` means ``DIR/manifest.jsonl``. Items without
an id are numbered by their position ("0", "1", ...).

Every item goes through dense and the chosen methods (`methods.compare`). Outputs in ``--out``:

- ``results.jsonl``: one line per (item, method): the run's trace (`traces.Trace.to_json`: text,
  token_ids, times, KV bytes, rounds) and its figures against dense (`metrics`), ``correct`` (exact answer, or one of ``answers``, after `normalise`, None without a
  reference), ``identical_to_dense``, ``frames``, ``settings``; or ``error`` when the item failed
  (unreadable video, ...), which does not stop the run.
- ``summary.json``: per method, accuracy, agreement with dense and median / quartiles / min / max of
  speedup, acceptance and KV memory against dense. Printed as a markdown table.
- with ``--report``: ``report.md`` (the table) and ``report.html`` (self-contained Plotly figures).

Several processes (``accelerate launch --multi_gpu --num_processes N -m sparsevid eval ...``, which
on a machine without GPUs starts N CPU processes; or ``torchrun --nproc_per_node N -m sparsevid
eval ...``): the items still to do are split between processes, each on its own device; the rows
are gathered in process 0, which writes the outputs, the same as a single process writes. (With
``--cpu``, ``accelerate launch`` starts a single process unless given ``--mpirun_hostfile``.)

Resume: a row is identified by (item id, method, settings). Each process also appends each finished
item's rows to ``results.part-<rank>.jsonl`` as it goes; process 0 merges these journals and the
gathered rows into ``results.jsonl`` at the end and removes them. A new run reads ``results.jsonl``
and any journals an interrupted run left, and skips items that have rows for every method under
the current settings (failed items included: delete their lines to retry them). Results of other
settings (e.g. another --gamma) stay in the file; the summary then lists one row per method and
setting.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import statistics
import sys

MANIFEST = "manifest.jsonl"
RESULTS = "results.jsonl"
SUMMARY = "summary.json"
JOURNAL = "results.part-{}.jsonl"
STATS = ("speedup", "acceptance", "kv_ratio", "e2e_speedup")


@functools.cache
def defaults() -> dict:
    """Every method setting's default ({key: value}, `methods.all_options`)."""
    from .methods import all_options

    return {o.key: o.default for o in all_options()}


# --------------------------------------------------------------------------------------------------
# Manifest and results files
# --------------------------------------------------------------------------------------------------


def read_manifest(data: str) -> list[dict]:
    """Items of a manifest file (or DIR/manifest.jsonl), each with its `id` (str) and video `path`."""
    from .errors import InputError

    path = os.path.join(data, MANIFEST) if os.path.isdir(data) else data
    if not os.path.isfile(path):
        raise InputError(f"No manifest at {path}.")
    root = os.path.dirname(os.path.abspath(path))
    items, ids = [], set()
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError:
                item = None
            if not isinstance(item, dict) or not item.get("video") or not item.get("question"):
                raise InputError(f"{path}, line {n}: expected a JSON object with 'video' and 'question'.")
            item["id"] = str(item.get("id", len(items)))
            if item["id"] in ids:
                raise InputError(f"{path}, line {n}: duplicate id {item['id']!r}.")
            ids.add(item["id"])
            item["path"] = os.path.join(root, item["video"])
            items.append(item)
    return items


def read_rows(path: str) -> list[dict]:
    """Rows of a JSON-lines file; a line cut short by an interruption is skipped."""
    rows = []
    if os.path.isfile(path):
        with open(path) as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    return rows


def journals(out: str) -> list[str]:
    return sorted(glob.glob(os.path.join(out, JOURNAL.format("*"))))


def row_key(row: dict) -> tuple:
    return row["id"], row["method"], json.dumps(row["settings"], sort_keys=True)


def merge(rows: list[dict], items: list[dict]) -> list[dict]:
    """Latest row per key, in manifest order, then settings in order of appearance, then method order."""
    from .methods import METHODS

    latest = {row_key(r): r for r in rows}
    order = {it["id"]: i for i, it in enumerate(items)}
    settings_order: dict[str, int] = {}
    for k in latest:
        settings_order.setdefault(k[2], len(settings_order))
    method_order = {m: i for i, m in enumerate(METHODS)}
    return sorted(latest.values(), key=lambda r: (order.get(r["id"], len(order)), r["id"],
                                                  settings_order[row_key(r)[2]], method_order.get(r["method"], 99)))


def write_rows(path: str, rows: list[dict]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------------
# Running items
# --------------------------------------------------------------------------------------------------


def run_settings(args) -> dict:
    """What a row's results depend on besides the item and method (part of its resume key): the
    method settings that differ from their defaults (so a new setting leaves old keys valid), and
    the model, frames, token limit and sampling."""
    from .methods import check_settings

    s = {k: v for k, v in check_settings(args.settings).items() if v != defaults().get(k)}
    s.update(model=args.model, frames=args.frames, max_new_tokens=args.max_new_tokens,
             temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    return s


def setting(row: dict, name: str):
    """A setting of a row, its default where the row does not list it."""
    return row["settings"].get(name, defaults().get(name))


def is_correct(text: str, item: dict) -> bool | None:
    """Whether `text` is the item's reference answer or one of its other accepted `answers`, after
    `normalise` (case, punctuation and spacing do not count); None without a reference."""
    from .toy.questions import is_answer

    if item.get("answer") is None:
        return None
    return is_answer(text, [item["answer"], *item.get("answers", [])])


def run_items(loaded, items: list[dict], names: list[str], settings: dict, sampling, settings_dict: dict,
              frames: int, max_new_tokens: int, width: int | None = None, videos: dict | None = None) -> list[dict]:
    """One row per method for each manifest item, the items decoded together (`--batch`: at most
    `width` rows at once, the next item joining as a row ends: continuous batching; one item:
    `runs.compare`); an item that fails (its video, its question) gets rows with `error` and the
    others go on. `videos`: {(path, frames): (video, inputs)} of the previous call's items, kept
    between calls: an item asking about a video already there shares its decoded frames, pixels and
    vision-tower outputs (benchmarks ask several questions per video); left holding this call's."""
    from .errors import SparsevidError
    from .runs import compare, compare_rows
    from .video import load_video

    def error(e):
        return str(e) if isinstance(e, SparsevidError) else f"{type(e).__name__}: {e}"

    def base(item):
        return dict(id=item["id"], video=item["video"], question=item["question"], reference=item.get("answer"),
                    settings=settings_dict)

    rows, ok, seen = [], [], {}
    videos = {} if videos is None else videos
    for item in items:
        try:
            key = (item["path"], int(item.get("frames") or frames))
            video, first = seen.get(key) or videos.get(key) or (load_video(*key), None)
            inputs = loaded.adapter.build_inputs(video.frames, item["question"], video.timestamps,
                                                 video=first).to(loaded.device)
            seen.setdefault(key, (video, inputs))
            ok.append((item, video, inputs))
        except Exception as e:  # recorded; the run goes on (KeyboardInterrupt is not an Exception)
            rows += [dict(base(item), method=name, error=error(e)) for name in names]
    videos.clear()
    videos.update(seen)
    if not ok:
        return rows
    try:
        if len(ok) == 1:
            results = [compare(loaded, ok[0][2], names, settings, max_new_tokens, sampling)]
        else:
            results = compare_rows(loaded, [x for _, _, x in ok], names, settings, max_new_tokens, sampling,
                                   width=width)
    except Exception as e:
        return rows + [dict(base(item), method=name, error=error(e)) for item, _, _ in ok for name in names]
    for (item, video, inputs), (traces, figs) in zip(ok, results):
        for name, res in traces.items():
            # batch_of: the first item of the batch this item was decoded in (its trace's batch_decode_s:
            # that batch's decode time)
            row = dict(base(item), method=name, frames=len(video.frames), visual_tokens=inputs.m_v,
                       prompt_tokens=inputs.m, batch_of=ok[0][0]["id"])
            row.update(res.to_json())
            row.update(figs.get(name, {}))
            if name == "dense":
                row.update(speedup=1.0, e2e_speedup=1.0, kv_ratio=1.0, identical_to_dense=True)
            row.setdefault("acceptance", None)  # direct methods and dense have none
            row["correct"] = is_correct(res.text, item)
            rows.append(row)
    return rows


CHUNK = 4  # --batch N: items of a chunk (CHUNK x N) flow through N rows (continuous batching)


def batch_order(items: list[dict]) -> list[dict]:
    """The order in which `--batch` fills its batches: items asking the same question together, then
    by frame count, then in manifest order. A batch decodes until its longest answer ends, and answers
    to one question tend to be of one length (a narration against a colour), so like with like wastes
    the fewest steps of a batch with one row left. Results are written in manifest order; each
    item's answer does not depend on its batch."""
    order = {id(it): i for i, it in enumerate(items)}
    return sorted(items, key=lambda it: (" ".join(str(it.get("question", "")).lower().split()),
                                         int(it.get("frames") or 0), order[id(it)]))


def decode_seconds(rows: list[dict]) -> float | None:
    """The decode time of `rows` (one method's) as run: each batch's decode time once (`batch_of`,
    `batch_decode_s`; a row of an older results file without them counts its own `decode_s`)."""
    batches = {}
    for r in rows:
        if r.get("decode_s") is None:
            continue
        batches[r.get("batch_of") or r["id"]] = r.get("batch_decode_s") or r["decode_s"]
    return sum(batches.values()) if batches else None


def distributed_state(args):
    """accelerate's PartialState: CPU processes (gloo) where there is no GPU or --device cpu."""
    import torch
    from accelerate import PartialState

    cpu = args.device == "cpu" or not torch.cuda.is_available()
    return PartialState(cpu=cpu)


def eval_main(args) -> int:
    import torch
    from accelerate.utils import gather_object
    from tqdm import tqdm

    from .engine import Sampling
    from .methods import check_settings, parse_methods
    from .models import load_model

    if args.batch < 1:
        from .errors import InputError

        raise InputError(f"--batch must be at least 1, not {args.batch}.")
    state = distributed_state(args)
    n_proc, rank = state.num_processes, state.process_index
    if n_proc == 1 and os.environ.get("ACCELERATE_USE_CPU", "").lower() == "true" and os.environ.get("MASTER_ADDR"):
        print("warning: `accelerate launch --cpu` starts one process (unless --mpirun_hostfile is given); "
              "use `accelerate launch --multi_gpu --num_processes N` to split over N CPU processes.", file=sys.stderr)
    items = read_manifest(args.data)
    names = parse_methods(args.methods)
    settings_dict = run_settings(args)
    os.makedirs(args.out, exist_ok=True)

    # What is done: results.jsonl plus the journals of an interrupted run. Every process reads it
    # before any process writes its journal, so all split the same list of items to do.
    old = read_rows(os.path.join(args.out, RESULTS)) + [r for j in journals(args.out) for r in read_rows(j)]
    key = json.dumps(settings_dict, sort_keys=True)
    have = {(r["id"], r["method"]) for r in old if row_key(r)[2] == key}
    todo = [it for it in items if not all((it["id"], n) in have for n in names)]
    state.wait_for_everyone()

    if state.is_main_process:
        print(f"eval: {len(items) - len(todo)} of {len(items)} items done, {len(todo)} to run"
              + (f" over {n_proc} processes" if n_proc > 1 and todo else ""), file=sys.stderr)
    new: list[dict] = []
    if todo:
        device = args.device
        if n_proc > 1 and args.device in (None, state.device.type):  # this process's GPU, or the CPU
            device = "cpu" if state.device.type == "cpu" else str(state.device)
        if n_proc > 1 and torch.device(device).type == "cpu":  # share the cores instead of oversubscribing
            per_node = int(os.environ.get("LOCAL_WORLD_SIZE", n_proc))
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // per_node))
        loaded = load_model(args.model, device, args.dtype)
        from .fast import enable

        enable(loaded, args.compile)  # compiled in the first item's warm-up (`runs.warm_up`)
        settings = check_settings(args.settings)
        sampling = Sampling(args.temperature, args.top_p, args.seed)
        with state.split_between_processes(todo) as mine:
            if n_proc > 1:
                print(f"eval: process {rank} of {n_proc}: {len(mine)} items on {loaded.device}", file=sys.stderr)
            with open(os.path.join(args.out, JOURNAL.format(rank)), "a") as journal:
                bar = tqdm(total=len(mine), desc="eval", file=sys.stderr,
                           disable=args.quiet or not state.is_main_process)
                # --batch N: chunks of CHUNK x N items, each decoded N rows at a time (a row that ends
                # makes room for the chunk's next item), each chunk journaled as it ends
                size = args.batch * (CHUNK if args.batch > 1 else 1)
                if args.batch > 1:
                    mine = batch_order(mine)
                videos: dict = {}  # the last chunk's videos: the next chunk's questions on them share them
                for i in range(0, len(mine), size):
                    rows = run_items(loaded, mine[i:i + size], names, settings, sampling, settings_dict,
                                     args.frames, args.max_new_tokens, width=args.batch, videos=videos)
                    bar.update(len(mine[i:i + size]))
                    journal.write("".join(json.dumps(r) + "\n" for r in rows))
                    journal.flush()
                    new += rows
                    for r in rows:
                        if "error" in r and r["method"] == names[0]:
                            bar.write(f"eval: item {r['id']} ({r['video']}): {r['error']}", file=sys.stderr)
    new = gather_object(new)  # all rows in every process (as is in a single process)

    if state.is_main_process:
        rows = merge(old + new, items)
        write_rows(os.path.join(args.out, RESULTS), rows)
        for j in journals(args.out):
            os.remove(j)
        summary = summarise(rows, items, args.data)
        with open(os.path.join(args.out, SUMMARY), "w") as f:
            json.dump(summary, f, indent=1)
        if args.report:
            write_report(args.out, rows, summary)
        print(format_table(summary))
    state.wait_for_everyone()
    if n_proc > 1:
        state.destroy_process_group()
    return 0


# --------------------------------------------------------------------------------------------------
# Summary, table and report
# --------------------------------------------------------------------------------------------------


def spread(values) -> dict | None:
    """median, quartiles (inclusive), min, max and n of the non-None values."""
    v = sorted(x for x in values if x is not None)
    if not v:
        return None
    q1, med, q3 = statistics.quantiles(v, n=4, method="inclusive") if len(v) > 1 else (v[0],) * 3
    return dict(median=med, q1=q1, q3=q3, min=v[0], max=v[-1], n=len(v))


def _mean(bools) -> float | None:
    b = [x for x in bools if x is not None]
    return sum(b) / len(b) if b else None


def group_label(row: dict, varying: list[str]) -> str:
    """The method, with the settings that differ between the rows of the results (if any)."""
    if not varying:
        return row["method"]
    values = ", ".join(f"{k}={setting(row, k)}" for k in varying)
    return f"{row['method']} ({values})"


def varying_settings(rows: list[dict]) -> list[str]:
    keys = sorted({k for r in rows for k in r["settings"]})
    return [k for k in keys if len({json.dumps(setting(r, k)) for r in rows}) > 1]


def groups(rows: list[dict]) -> dict[str, list[dict]]:
    varying = varying_settings(rows)
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(group_label(r, varying), []).append(r)
    return out


def summarise(rows: list[dict], items: list[dict], data: str | None = None) -> dict:
    """Per method (and setting, where the results hold several): counts, accuracy, agreement with
    dense, and the spread of speedup, acceptance and KV memory against dense over items."""
    varying = varying_settings(rows)
    methods = {}
    for label, rs in groups(rows).items():
        ok = [r for r in rs if "error" not in r]
        methods[label] = dict(
            method=rs[0]["method"], setting={k: setting(rs[0], k) for k in varying},
            items=len(rs), errors=len(rs) - len(ok),
            accuracy=_mean([r["correct"] for r in ok]), with_reference=sum(r["correct"] is not None for r in ok),
            agreement_with_dense=_mean([r.get("identical_to_dense") for r in ok]),
            decode_s=decode_seconds(ok), decode_tokens=sum(r.get("decode_tokens") or 0 for r in ok),
            **{s: spread([r.get(s) for r in ok]) for s in STATS})
    settings = list({json.dumps(r["settings"], sort_keys=True): r["settings"] for r in rows}.values())
    errors = sorted({(r["id"], r["error"]) for r in rows if "error" in r})
    return dict(data=data, items=len(items), settings=settings, varying_settings=varying, methods=methods,
                errors=[dict(id=i, error=e) for i, e in errors])


def _num(x: str) -> float:
    try:
        return float(x)
    except ValueError:
        return 0.0


def _fmt(st: dict | None, pct: bool = False) -> str:
    if st is None:
        return "-"
    f = (lambda v: f"{v:.0%}") if pct else (lambda v: f"{v:.2f}x")
    if st["n"] == 1 or st["q1"] == st["q3"]:
        return f(st["median"])
    return f"{f(st['median'])} ({f(st['q1'])}–{f(st['q3'])})"


COLUMNS = ("method", "accuracy", "agreement with dense", "speedup", "acceptance", "KV vs dense", "items")


def table_rows(summary: dict) -> list[list[str]]:
    """One row of COLUMNS per method (and setting); ratios are medians (quartiles) over items."""
    pct = lambda v: "-" if v is None else f"{v:.0%}"  # noqa: E731
    rows = []
    for label, m in summary["methods"].items():
        items = f"{m['items'] - m['errors']}" + (f" (+{m['errors']} failed)" if m["errors"] else "")
        rows.append([label, pct(m["accuracy"]), pct(m["agreement_with_dense"]), _fmt(m["speedup"]),
                     _fmt(m["acceptance"], True), _fmt(m["kv_ratio"], True), items])
    return rows


def format_table(summary: dict) -> str:
    """The summary as a markdown table."""
    from .tables import markdown_table

    table = markdown_table(list(COLUMNS), table_rows(summary))
    times = [f"{label} {m['decode_s']:.2f} s ({m['decode_tokens'] / m['decode_s']:.0f} tok/s)"
             for label, m in summary["methods"].items() if m.get("decode_s")]
    return table + ("\n\nDecode time, all items (a batch's time once): " + ", ".join(times) if times else "")


def figures(rows: list[dict], summary: dict) -> list:
    """Speedup vs frames per method; acceptance vs γ and K (or per method); accuracy vs KV memory."""
    import plotly.colors
    import plotly.graph_objects as go

    ok = [r for r in rows if "error" not in r]
    palette = plotly.colors.qualitative.Plotly  # one colour per method (and setting) in every figure
    colour = {label: palette[i % len(palette)] for i, label in enumerate(summary["methods"])}
    by = groups(ok)

    def error_bars(sts):
        return dict(type="data", symmetric=False, array=[s["q3"] - s["median"] for s in sts],
                    arrayminus=[s["median"] - s["q1"] for s in sts])

    speed = go.Figure()
    for label, rs in by.items():
        if rs[0]["method"] == "dense":
            continue
        xs = sorted({r["frames"] for r in rs})
        sts = [spread([r["speedup"] for r in rs if r["frames"] == x]) for x in xs]
        xs, sts = [x for x, s in zip(xs, sts) if s], [s for s in sts if s]
        speed.add_trace(go.Scatter(x=xs, y=[s["median"] for s in sts], error_y=error_bars(sts),
                                   mode="lines+markers", name=label, line_color=colour[label]))
    speed.update_layout(title="Decode speedup over dense vs frames (median, quartiles)", yaxis_title="speedup (x)",
                        xaxis=dict(title="frames", tickmode="array", tickvals=sorted({r["frames"] for r in ok})))

    def k_of(r):
        return "auto" if setting(r, "k") is None else setting(r, "k")

    spec = [r for r in ok if r.get("acceptance") is not None]
    gammas = sorted({setting(r, "gamma") for r in spec})
    ks = sorted({k_of(r) for r in spec}, key=str)
    acc = go.Figure()
    if len(gammas) > 1 or len(ks) > 1:  # x: γ (lines per method and K), else K (lines per method)
        along_gamma = len(gammas) > 1
        x_of = (lambda r: setting(r, "gamma")) if along_gamma else (lambda r: str(k_of(r)))
        order = sorted({x_of(r) for r in spec}, key=lambda x: x if along_gamma else (x == "auto", _num(x)))
        lines: dict[str, list[dict]] = {}
        for r in spec:
            lines.setdefault(r["method"] + (f" (K={k_of(r)})" if along_gamma and len(ks) > 1 else ""), []).append(r)
        for name, rs in lines.items():
            xs = [x for x in order if any(x_of(r) == x for r in rs)]
            sts = [spread([r["acceptance"] for r in rs if x_of(r) == x]) for x in xs]
            acc.add_trace(go.Scatter(x=xs, y=[s["median"] for s in sts], error_y=error_bars(sts),
                                     mode="lines+markers", name=name))
        acc.update_layout(title=f"Draft acceptance vs {'γ' if along_gamma else 'K'} (median, quartiles)",
                          xaxis=dict(title="γ (draft tokens per round)", tickvals=order) if along_gamma else
                          dict(title="K (visual budget)", type="category", categoryorder="array", categoryarray=order),
                          yaxis_title="acceptance", yaxis_tickformat=".0%")
    else:
        labels = [l for l, m in summary["methods"].items() if m["acceptance"]]
        sts = [summary["methods"][l]["acceptance"] for l in labels]
        acc.add_trace(go.Bar(x=labels, y=[s["median"] for s in sts], error_y=error_bars(sts),
                             marker_color=[colour[l] for l in labels]))
        acc.update_layout(title="Draft acceptance per method (median, quartiles)"
                          + (f"; γ={gammas[0]}, K={ks[0]}" if gammas else ""),
                          yaxis_title="acceptance", yaxis_tickformat=".0%")

    have_ref = any(m["with_reference"] for m in summary["methods"].values())
    what = "accuracy" if have_ref else "agreement_with_dense"
    pts = [(l, m) for l, m in summary["methods"].items() if m["kv_ratio"] and m[what] is not None]
    kv = go.Figure([go.Scatter(x=[m["kv_ratio"]["median"]], y=[m[what]], name=label, mode="markers",
                               marker=dict(size=12, color=colour[label])) for label, m in pts])
    kv.update_layout(title=("Accuracy" if have_ref else "Agreement with dense (no reference answers)")
                     + " vs KV memory", xaxis_title="KV memory vs dense (median)", yaxis_title=what.replace("_", " "),
                     xaxis_tickformat=".0%", yaxis_tickformat=".0%", yaxis_range=[-0.05, 1.05])
    return [speed, acc, kv]


def write_report(out: str, rows: list[dict], summary: dict) -> None:
    """report.md (the table) and report.html (the table and figures; plotly.js embedded once)."""
    import html

    import plotly.io as pio

    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(format_table(summary) + "\n")
    divs = [pio.to_html(fig, full_html=False, include_plotlyjs=(i == 0)) for i, fig in enumerate(figures(rows, summary))]

    def tr(cells, tag="td"):
        return "<tr>" + "".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in cells) + "</tr>"

    tab = tr(COLUMNS, "th") + "".join(tr(r) for r in table_rows(summary))
    errors = "".join(f"<li>{html.escape(e['id'])}: {html.escape(e['error'])}</li>" for e in summary["errors"])
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>sparsevid evaluation</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px}}</style></head><body>
<h1>sparsevid evaluation</h1>
<p>{html.escape(str(summary['data']))}: {summary['items']} items. Ratios against dense: median (quartiles) over items.</p>
<table>{tab}</table>
{f'<h2>Failed items</h2><ul>{errors}</ul>' if errors else ''}
{''.join(divs)}
</body></html>
"""
    with open(os.path.join(out, "report.html"), "w") as f:
        f.write(page)


def add_arguments(p) -> None:
    """eval's own flags (the model and method flags come from the CLI)."""
    from .options import count

    p.add_argument("--frames", type=count, default=16, help="frames sampled per clip (unless the item sets 'frames')")
    p.add_argument("--batch", type=count, default=1, help="rows decoded together (batched decoding; the StD "
                   "paper: 8): items flow through N rows, the next joining as a row ends (continuous batching); "
                   "every method gives each item the answer of a batch of one")
    p.add_argument("--out", default="eval-out", help="output folder (results.jsonl, summary.json, report.*)")
    p.add_argument("--report", action="store_true", help="also write report.html and report.md")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
