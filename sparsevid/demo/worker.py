"""The streamed comparison: validate, decode the video, then run dense and each method in a worker
thread, yielding `Update`s as tokens arrive and the panels' `View` at the end.

Runs share nothing mutable. The worker holds `backend.RUN_LOCK` for its whole life, from loading
the model to the last method, so a run that is cancelled (the generator closed, as Gradio does) or
abandoned can never overlap the next: the next run waits for the lock, and the cancelled one stops
at its next token (its `on_token` raises once the run's stop flag is set).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field

from ..adapters import check_question
from ..errors import InputError, SparsevidError
from ..fast import state as steps_state
from ..methods import METHODS, parse_methods
from .. import runs
from ..runs import batch_json, compare, compare_rows, comparison_json, prompt_info
from ..video import load_video
from . import backend
from .config import FRAMES, MAX_MINUTES, MAX_NEW_TOKENS, MAX_QUESTION_CHARS, MAX_UPLOAD_MB, TIMING_BUDGET_S, \
    TIMING_MAX_REPEATS, TIMING_REPEATS, find_example, sampled_boxes, settings_from
from .panels import NO_SPEEDUP, View, all_panels, build_view, fmt_bytes
from .scope import scope_note

log = logging.getLogger("sparsevid.demo")
PASSES = (f"{TIMING_REPEATS} passes" if TIMING_MAX_REPEATS <= TIMING_REPEATS else
          f"{TIMING_REPEATS} to {TIMING_MAX_REPEATS} passes, more while they fit in {TIMING_BUDGET_S:g} s; on the "
          f"CPU those beyond {TIMING_REPEATS} time decoding only, from each method's first prefill")


@dataclass
class Update:
    """One step of a run, for the UI. `cards`: method -> markdown (only the methods run); `view`,
    `figures` (the five panels) and `traces` come once, at the end; `error`: a user-ready message
    (the run stopped)."""

    status: str = ""
    cards: dict[str, str] = field(default_factory=dict)
    progress: tuple[float, str] | None = None
    view: View | None = None
    figures: dict | None = None
    traces: dict | None = None
    error: str | None = None
    note: str = ""  # shown before the answer: the question is outside the embedded model's scope
    result: dict | None = None  # at the end: the same JSON as `python -m sparsevid run --json`
    stopped: bool = False  # the run was stopped (its stop flag set)


class Cancelled(Exception):
    """Raised in the worker at the next token once its run is cancelled."""


_DECODED: dict = {}  # the last video decoded: {(path, size, modified, frames): Video}
_DECODED_LOCK = threading.Lock()


def decoded(video, n_frames: int):
    """`load_video` with the app's limits, the last video kept: a follow-up question on the same
    upload (the same file, size, modification time and frame count) reuses its frames instead of
    decoding it again. Any problem is `load_video`'s own error."""
    try:
        st = os.stat(video)
        key = (os.path.realpath(video), st.st_size, st.st_mtime_ns, int(n_frames))
    except (OSError, TypeError, ValueError):
        key = None  # load_video says what is wrong with it
    with _DECODED_LOCK:
        if key is not None and key in _DECODED:
            return _DECODED[key]
    vid = load_video(video, n_frames, max_bytes=MAX_UPLOAD_MB * 2**20, max_duration=MAX_MINUTES * 60)
    if key is not None:
        with _DECODED_LOCK:
            _DECODED.clear()
            _DECODED[key] = vid
    return vid


def card(name: str, text: str, trace=None, fig: dict | None = None, state: str = "") -> str:
    """Markdown of one method's column: its answer, then its numbers (times and KV once it has run;
    the ratios to dense once the comparison is complete)."""
    m = METHODS[name]
    kind = "reference" if m.kind == "dense" else ("lossless" if m.lossless else "lossy")
    mark = ""
    if fig is not None:
        same = fig.get("identical_to_dense")
        mark = " · **✓ identical to dense**" if same else (" · **✗ differs from dense**" if m.lossless
                                                           else " · differs from dense")
    head = f"### {m.label}\n{kind}{(' · *' + state + '*') if state else ''}{mark}\n\n"
    answer = text if text.strip() else ("…" if state else "(empty answer)")
    body = head + "> " + answer.replace("\n", " ") + ("▌" if state.startswith("decoding") else "") + "\n\n"
    if trace is None:
        return body
    tps = len(trace.token_ids) / trace.total_s if trace.total_s else 0.0
    rows = [("wall time", f"{trace.total_s:.2f} s (prefill {trace.prefill_s:.2f} + decode {trace.decode_s:.2f})"),
            ("tokens/s", f"{tps:.1f} ({len(trace.token_ids)} tokens)")]
    f = fig or {}
    if fig is not None:
        sp, e2e = f.get("speedup"), f.get("e2e_speedup")
        lo_hi = f.get("speedup_range")
        spread = f" ({lo_hi[0]:.2f}–{lo_hi[1]:.2f}× over {len(trace.decode_runs_s)} passes)" if lo_hi else ""
        rows.append(("speedup", (NO_SPEEDUP if sp is None else f"**{sp:.2f}×** decode{spread}")
                     + (f", {e2e:.2f}× end to end" if e2e is not None else "")))
    kv = fmt_bytes(trace.kv_bytes)
    if f.get("kv_ratio") is not None:
        kv += f" ({f['kv_ratio']:.0%} of dense)"
    rows.append(("KV memory", kv))
    if f.get("acceptance") is not None:
        rows.append(("acceptance", f"{f['acceptance']:.0%} · {f.get('tokens_per_round') or 0:.2f} tokens/round · "
                                   f"{f.get('rounds')} rounds (γ ≤ {f.get('gamma')}, "
                                   f"{f.get('dense_steps', 0)} of them plain dense steps)"))
    elif trace.kind == "speculative":  # adaptive γ chose dense steps only (a short answer, or a draft = dense)
        why = trace.rounds[-1].why if trace.rounds else "the answer ended at the first token"
        rows.append(("acceptance", f"no draft token proposed ({len(trace.rounds)} dense steps; {why})"))
    if f.get("decode_flops_pct") is not None:
        rows.append(("cost, % of dense", f"KV {f['prefill_kv_pct']:.0f} % prefill / {f['decode_kv_pct']:.0f} % decode"
                                         f" · FLOPs {f['prefill_flops_pct']:.0f} % / {f['decode_flops_pct']:.0f} %"
                                         f" · peak memory {f['peak_memory_pct']:.0f} %"
                                         f" ({f.get('peak_memory_source', 'estimate')})"))
    return body + "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows) + "\n"


def token_text(loaded, tok: int) -> str:
    """A token as a short readable string (byte-level pieces shown as the tokenizer's token)."""
    s = loaded.tokenizer.decode([tok], skip_special_tokens=False)
    if "\ufffd" in s or not s.strip():
        s = str(loaded.tokenizer.convert_ids_to_tokens(tok)).replace("Ġ", "␣").replace("Ċ", "⏎")
    return s.strip() or "␣"


def _failure(e: BaseException, where: str) -> str:
    """A one-line message for the UI: a SparsevidError's own, else the exception logged with its traceback."""
    if isinstance(e, SparsevidError):  # expected (bad input, unknown model): one line, no traceback
        log.info("%s refused: %s", where, e)
        return str(e)
    log.error("%s failed", where, exc_info=e)
    return f"Unexpected error: {backend.one_line(e)}"


def _check(video, question, n_frames, methods, settings, max_new_tokens):
    if not video:
        raise InputError("Upload a video first (or pick an example).")
    question = check_question(question, MAX_QUESTION_CHARS)
    names = parse_methods(["dense"] + list(methods or []))
    settings_from(settings)  # a bad setting is reported before any work
    n_frames = _whole("Frames", n_frames, FRAMES)
    max_new_tokens = _whole("Max new tokens", max_new_tokens, MAX_NEW_TOKENS)
    return question, names, n_frames, max_new_tokens


def _whole(label: str, value, spec: dict) -> int:
    """A slider's value as the slider allows it: a whole number within its range, on its steps
    (None or empty: its default); anything else is refused with a message, never rounded."""
    if value is None or value == "":
        return int(spec["value"])
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise InputError(f"{label} must be a number, not {str(value)[:40]!r}.") from None
    if not number.is_integer():
        raise InputError(f"{label} must be a whole number, not {number:g}.")
    number = int(number)
    if not spec["minimum"] <= number <= spec["maximum"]:
        raise InputError(f"{label} must be between {spec['minimum']} and {spec['maximum']}, not {number}.")
    step = spec.get("step", 1)
    if (number - spec["minimum"]) % step:
        raise InputError(f"{label} must be a multiple of {step} (the slider's step), not {number}.")
    return number


def result_json(loaded, vid, inputs, traces: dict, figs: dict) -> dict:
    """The comparison as plain data, the same JSON as `python -m sparsevid run --json`
    (`runs.comparison_json`, the decode steps' state from `fast.state`)."""
    return comparison_json(loaded, vid, inputs, traces, figs, steps_state(loaded))


_STOPS: dict[str, threading.Event] = {}  # session key -> the stop flag of its current run
_STOPS_LOCK = threading.Lock()


def request_stop(key: str) -> bool:
    """Set the stop flag of session `key`'s current run (its worker stops at its next token); False
    when it has none running."""
    with _STOPS_LOCK:
        ev = _STOPS.get(key)
    if ev is None:
        return False
    ev.set()
    return True


def run_comparison(video: str | None, question: str, model: str | None, n_frames: int, methods: list[str],
                   settings: dict, max_new_tokens: int, min_interval: float = 0.12, session: str | None = None):
    """Validate, decode the video, then run dense and each method, yielding `Update`s as tokens
    arrive. settings: the app's fields {key: text or value} (missing keys take the fields' initial
    values). Bad input ends with an Update carrying `error` (never an exception). Closing the
    generator, or `request_stop(session)`, stops the run: its worker stops at its next token and
    frees the model; a stopped run ends with an Update whose `stopped` is set."""
    t0 = time.perf_counter()
    with _stop_flag(session) as stop:
        yield from _run(video, question, model, n_frames, methods, settings, max_new_tokens, min_interval, t0, stop)


@contextlib.contextmanager
def _stop_flag(session: str | None):
    """A run's stop flag, registered as `session`'s (a session runs one comparison at a time: its
    previous run is stopped); set when the run ends or its generator is closed, so its worker stops at
    its next token and nothing waits for it."""
    stop = threading.Event()
    if session is not None:
        with _STOPS_LOCK:
            old = _STOPS.get(session)
            if old is not None:
                old.set()
            _STOPS[session] = stop
    try:
        yield stop
    finally:
        stop.set()
        if session is not None:
            with _STOPS_LOCK:
                if _STOPS.get(session) is stop:
                    del _STOPS[session]


def _run(video, question, model, n_frames, methods, settings, max_new_tokens, min_interval, t0, stop):
    note = ""
    try:
        question, names, n_frames, max_new_tokens = _check(video, question, n_frames, methods, settings,
                                                           max_new_tokens)
        note = scope_note(question, model or backend.default_model())
        if note:
            yield Update(status=note, note=note, progress=(0.01, "Question outside the model's scope"))
        yield Update(status="Decoding video frames…", progress=(0.02, "Decoding video frames"))
        vid = decoded(video, n_frames)
    except Exception as e:  # noqa: BLE001 - never a traceback in the UI
        msg = _failure(e, "run (before decoding)")
        yield Update(status=f"⚠️ {msg}", error=msg, note=note)
        return
    settings = settings_from(settings)
    model = model or backend.default_model()
    example = find_example(video, question)
    boxes = None
    if example and example.get("boxes"):
        boxes = sampled_boxes(example["boxes"], vid.timestamps, float(example.get("fps") or vid.fps))
    events: queue.Queue = queue.Queue()

    def on_token(name, tok):
        if stop.is_set():
            raise Cancelled
        events.put(("token", name, tok))

    def work():
        with backend.RUN_LOCK:  # the whole life of the run: the next one waits until this one has stopped
            try:
                if stop.is_set():
                    raise Cancelled
                events.put(("status", None, f"{len(vid.frames)} frames decoded; loading the model…"))
                loaded = backend.get_model(model)
                skipped = {n: why for n, why in backend.broken_methods(model).items() if n in names}
                run = [n for n in names if n not in skipped]
                inputs = loaded.adapter.build_inputs(vid.frames, question, vid.timestamps).to(loaded.device)
                events.put(("ready", None, (loaded, inputs, run, skipped)))
                out = compare(loaded, inputs, run, settings, max_new_tokens, on_token=on_token,
                              on_result=lambda t: events.put(("result", t.method, t)), should_stop=stop.is_set,
                              repeats=TIMING_REPEATS, max_repeats=TIMING_MAX_REPEATS, budget_s=TIMING_BUDGET_S,
                              on_pass=lambda i: events.put(("status", None, f"Answers done; timing pass {i} ({PASSES}; "
                                                                            "speedups are medians over the passes)…")))
                events.put(("done", None, out))
            except (Cancelled, runs.Cancelled):
                log.info("run cancelled")
                events.put(("cancelled", None, None))
            except BaseException as e:  # noqa: BLE001 - handed to the generator, which reports it
                events.put(("error", None, e))

    status = "Waiting for the previous run to stop…" if backend.RUN_LOCK.locked() else "Starting…"
    threading.Thread(target=work, name="sparsevid-compare", daemon=True).start()
    loaded = inputs = None
    run, skipped, tokens, results, out = names, {}, {n: [] for n in names}, {}, None
    current, first_token_s = names[0], None
    info = ""

    def cards() -> dict[str, str]:
        if loaded is None:
            return {}
        figs = out[1] if out else {}
        c = {}
        for n in run:
            if n in results:
                c[n] = card(n, results[n].text, results[n], figs.get(n) if out else None)
            elif n == current:
                st = f"decoding, {len(tokens[n])} tokens" if tokens[n] else "prefill…"
                c[n] = card(n, loaded.adapter.decode(tokens[n]), state=st)
            else:
                c[n] = card(n, "", state="waiting")
        for n, why in skipped.items():
            c[n] = f"### {METHODS[n].label}\n\n⚠️ Not available for this model (failed the start-up check: {why})."
        return c

    def progress() -> tuple[float, str]:
        if loaded is None:
            return 0.1, status
        i = run.index(current) if current in run else len(run)
        frac = 0.15 + 0.85 * (i + min(1.0, len(tokens.get(current, [])) / max_new_tokens)) / len(run)
        what = (f"{METHODS[current].label}: " + (f"decoding ({len(tokens[current])} tokens)" if tokens.get(current)
                                                 else "prefill")) if current else "dense again (timing)"
        return min(frac, 0.99), what

    finished, last = False, 0.0
    try:
        while not finished:
            if stop.is_set():
                yield Update(status="⏹ Stopped. " + _prefix(note), cards=cards(), note=note, stopped=True)
                return
            try:
                batch = [events.get(timeout=min_interval)]
            except queue.Empty:
                batch = []
            while True:
                try:
                    batch.append(events.get_nowait())
                except queue.Empty:
                    break
            changed = False
            for kind, name, payload in batch:
                if kind == "status":
                    status, changed = payload, True
                elif kind == "ready":
                    loaded, inputs, run, skipped = payload
                    changed = True
                    adjusted = adjustment_notes(loaded, inputs, n_frames, len(vid.frames), settings, run)
                    note = " ".join(x for x in (note, adjusted) if x)
                    info = (f"**{len(vid.frames)} frames** ({vid.duration:.1f} s video) → {inputs.m_v} visual "
                            f"tokens, prompt {inputs.m} tokens · model `{loaded.name}` on {loaded.device.type} "
                            f"({str(loaded.dtype)[6:]}) · decode steps: {steps_state(loaded)}")
                    if example:
                        info += f" · bundled example, expected answer: *{example.get('answer', '?')}*"
                    status = info
                elif kind == "token":
                    if first_token_s is None:
                        first_token_s = time.perf_counter() - t0
                    current = name
                    tokens[name].append(payload)
                elif kind == "result":
                    results[name] = payload
                    changed = True
                    i = run.index(name)
                    current = run[i + 1] if i + 1 < len(run) else None
                elif kind == "done":
                    out, finished = payload, True
                elif kind == "error":
                    raise payload
                elif kind == "cancelled":  # only when the stop flag was set here, so never reached
                    return
            now = time.perf_counter()
            if not finished and (changed or now - last >= min_interval):
                last = now
                yield Update(status=_prefix(note) + status, cards=cards(), progress=progress(), note=note)
    except Exception as e:  # noqa: BLE001 - a one-line message in the UI; unexpected ones logged with traceback
        msg = _failure(e, "comparison")
        yield Update(status=f"⚠️ {msg}", cards=cards(), error=msg, note=note)
        return
    results, figs = out
    result = result_json(loaded, vid, inputs, results, figs)
    try:
        view = build_view(results, figs, prompt_info(inputs), inputs.frames, inputs.timestamps,
                          (loaded.num_layers, loaded.num_heads, loaded.num_kv_heads),
                          lambda t: token_text(loaded, t), boxes)
        panels = all_panels(view)
    except Exception as e:  # noqa: BLE001 - the answers stand; the panels' failure is logged and shown
        msg = _failure(e, "drawing the panels")
        yield Update(status=f"⚠️ {msg}", cards=cards(), error=msg, traces=results, note=note, result=result)
        return
    total_s = time.perf_counter() - t0
    timing = (f"first token after **{first_token_s:.2f} s**, full comparison in **{total_s:.2f} s**"
              if first_token_s is not None else f"done in {total_s:.2f} s")
    passes = max((len(t.decode_runs_s) for t in results.values() if t.kind != "dense"), default=0)
    if passes > 1:
        timing += f" (speed figures: medians over {passes} passes of every method; {PASSES})"
    log.info("run: %d methods, first token %.2f s, total %.2f s", len(run), first_token_s or -1, total_s)
    yield Update(status=_prefix(note) + info + "<br>" + timing, cards=cards(), progress=(1.0, "done"), view=view,
                 figures=panels, traces=results, note=note, result=result)


def adjustment_notes(loaded, inputs, asked_frames: int, got_frames: int, settings: dict, names: list[str]) -> str:
    """What the run does other than what was asked, in words (shown with the answers, and in the
    API's `note`): fewer frames than asked, a one-frame clip, a setting beyond this model or prompt."""
    notes = []
    if got_frames < asked_frames:
        notes.append(f"The clip has {got_frames} frame{'s' if got_frames != 1 else ''}; {asked_frames} were asked: "
                     "all of them are used.")
    if got_frames < 2:
        notes.append("A single frame: the model reads frames in pairs and was trained on clips of 16 frames or "
                     "more, so its answer is unreliable.")
    L = loaded.num_layers
    if "layerskip" in names and (settings.get("layerskip_layers") or 0) >= L:
        notes.append(f"LayerSkip: {settings['layerskip_layers']} draft layers is the whole {L}-layer model, so "
                     "it runs plain dense steps.")
    l_v = settings.get("l_v")
    if any(n.startswith("htsparse") for n in names) and isinstance(l_v, int) and l_v >= inputs.m_v:
        notes.append(f"HT-Sparse: l_v = {l_v} is not fewer than the {inputs.m_v} visual tokens: it keeps them all.")
    return " ".join(notes)


def _prefix(note: str) -> str:
    return note + "<br>" if note else ""


def compare_json(video: str | None, question: str, model: str | None, n_frames: int, methods: list[str],
                 settings: dict, max_new_tokens: int, session: str | None = None) -> dict:
    """`run_comparison` to its end, as plain data: `result_json`'s dict, plus `note` where the
    question is outside the model's scope. Raises InputError with the run's message when it fails."""
    out = None
    for out in compare_stream(video, question, model, n_frames, methods, settings, max_new_tokens, session):
        pass
    return out


def compare_stream(video: str | None, question: str, model: str | None, n_frames: int, methods: list[str],
                   settings: dict, max_new_tokens: int, session: str | None = None, every: float = 0.5):
    """`compare_json` as a generator: None while the run goes (at most every `every` seconds), then
    the result. The API's /compare serves it, so that a client that cancels or disconnects closes it
    and the run stops at its next token (a plain function would run to its end, holding the model).
    Several questions, one per line (at most MAX_QUESTIONS), are decoded together as one batch
    (`runs.compare_rows`): the result is then `runs.batch_json`'s dict."""
    questions = split_questions(question)
    if len(questions) > 1:
        yield from _compare_rows_stream(video, questions, model, n_frames, methods, settings, max_new_tokens,
                                        session, every)
        return
    last, t = None, time.monotonic()
    for last in run_comparison(video, questions[0], model, n_frames, methods, settings, max_new_tokens, session=session):
        if time.monotonic() - t >= every:
            t = time.monotonic()
            yield None
    if last is None or last.result is None:
        raise InputError(last.error if last is not None and last.error else "The run stopped before its end.")
    yield dict(last.result, note=last.note) if last.note else last.result


MAX_QUESTIONS = 8  # the StD paper's batch


def split_questions(text: str | None) -> list[str]:
    """The questions in `text`, one per non-blank line (a single question may be empty: `_check`
    says so). More than MAX_QUESTIONS is refused."""
    questions = [q.strip() for q in (text or "").splitlines() if q.strip()] or [text or ""]
    if len(questions) > MAX_QUESTIONS:
        raise InputError(f"{len(questions)} questions (one per line); at most {MAX_QUESTIONS} are decoded together.")
    return questions


def _compare_rows_stream(video, questions, model, n_frames, methods, settings, max_new_tokens, session, every):
    """Several questions on one video decoded together (`runs.compare_rows`), in a worker thread that
    holds the run lock like `_run`'s: None every `every` seconds while it goes, then the result
    (`runs.batch_json`, plus `note` where a question is outside the model's scope). Closing the
    generator stops the run at its next token."""
    try:
        questions = [check_question(q, MAX_QUESTION_CHARS) for q in questions]
        _, names, n_frames, max_new_tokens = _check(video, questions[0], n_frames, methods, settings, max_new_tokens)
        model = model or backend.default_model()
        note = " ".join(dict.fromkeys(n for n in (scope_note(q, model) for q in questions) if n))
        vid = decoded(video, n_frames)
        settings = settings_from(settings)
    except Exception as e:  # noqa: BLE001 - one line, never a traceback
        raise InputError(_failure(e, "batched comparison (before decoding)")) from None
    done: queue.Queue = queue.Queue()
    with _stop_flag(session) as stop:
        def work():
            with backend.RUN_LOCK:
                try:
                    if stop.is_set():
                        raise runs.Cancelled
                    loaded = backend.get_model(model)
                    run = [n for n in names if n not in backend.broken_methods(model)]
                    batch = loaded.adapter.build_questions(vid.frames, questions, vid.timestamps, loaded.device)
                    results = compare_rows(loaded, batch, run, settings, max_new_tokens, should_stop=stop.is_set)
                    done.put(batch_json(loaded, vid, questions, batch, results, steps_state(loaded)))
                except runs.Cancelled:
                    log.info("batched run cancelled")
                    done.put(None)
                except BaseException as e:  # noqa: BLE001 - handed to the generator, which reports it
                    done.put(e)

        threading.Thread(target=work, name="sparsevid-compare-rows", daemon=True).start()
        while True:
            try:
                out = done.get(timeout=every)
                break
            except queue.Empty:
                yield None
    if isinstance(out, SparsevidError):
        raise out
    if isinstance(out, BaseException):
        raise InputError(_failure(out, "batched comparison")) from None
    if out is None:
        raise InputError("The run stopped before its end.")
    yield dict(out, note=note) if note else out
