"""sparsevid demo: dense vs sparse and speculative decoding of a Video-LLM, side by side.

Layout and wiring only; the work is in `sparsevid.demo` (settings, the streamed comparison, the
panels' data) and `sparsevid.plots` (the Plotly figures).

    python app.py                                  # http://localhost:7860, embedded model
    SPARSEVID_MODEL=/path/to/model python app.py   # another default model
    GRADIO_SERVER_NAME=0.0.0.0 GRADIO_SERVER_PORT=8080 python app.py
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported (shared CPUs)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import inspect  # noqa: E402
import logging  # noqa: E402

import gradio as gr  # noqa: E402

from sparsevid import demo, whatif  # noqa: E402
from sparsevid.demo import scope  # noqa: E402
from sparsevid.errors import SparsevidError  # noqa: E402
from sparsevid.methods import METHODS  # noqa: E402

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

START = demo.startup()
METHOD_NAMES = list(METHODS)  # one answer card per registered method, dense first
FIELDS = demo.setting_fields()
EXAMPLES = demo.load_examples()
run_comparison = demo.gpu(demo.run_comparison)  # ZeroGPU on Spaces, unchanged elsewhere
compare_stream = demo.gpu(demo.compare_stream)

def named(fn, names: list[str]):
    """`fn(*args)` with the signature `names` + (request: gr.Request, progress=gr.Progress()): Gradio
    names the API's parameters from it (`video`, `question`, ..., `k`, `gamma`: no `param_6`)."""
    P = inspect.Parameter
    params = [P(n, P.POSITIONAL_OR_KEYWORD) for n in names]
    params += [P("request", P.POSITIONAL_OR_KEYWORD, annotation=gr.Request),
               P("progress", P.POSITIONAL_OR_KEYWORD, default=gr.Progress())]
    fn.__signature__ = inspect.Signature(params)
    fn.__annotations__ = {"request": gr.Request}
    return fn


def widget(f: demo.Field):
    kw = dict(label=f.label, info=f.info, elem_id=f"setting-{f.key}")
    if f.widget == "checkbox":
        return gr.Checkbox(value=f.value, **kw)
    if f.widget == "dropdown":
        return gr.Dropdown(list(f.option.choices), value=f.value, **kw)
    if f.widget == "textbox":  # an amount or an optional whole number, parsed as typed; blank: the default rule
        return gr.Textbox(value=f.value, placeholder="blank: default rule", **kw)
    if f.widget == "slider":
        return gr.Slider(f.option.min, f.option.max, value=f.value, step=f.step, **kw)
    return gr.Number(value=f.value, precision=0 if f.option.kind == "int" else None, **kw)


INPUT_NAMES = ["video", "question", "model", "frames", "methods", "max_new_tokens"]
SETTING_NAMES = [f.key for f in FIELDS]


def _split(args):
    """(inputs, settings, request, progress) from a `named` function's positional arguments."""
    n = len(INPUT_NAMES) + len(FIELDS)
    values, rest = list(args[:n]), list(args[n:]) + [None, None]
    return values[:len(INPUT_NAMES)], dict(zip(SETTING_NAMES, values[len(INPUT_NAMES):])), rest[0], rest[1]


def run(*args):
    (video, question, model, frames, methods, max_new_tokens), settings, request, progress = _split(args)
    session = getattr(request, "session_hash", None)
    updates = run_comparison(video, question, model, frames, methods, settings, max_new_tokens, session=session)
    try:
        for up in updates:
            if up.progress and progress is not None:
                progress(up.progress[0], desc=up.progress[1])
            if up.error:
                gr.Warning(up.error)
            cards = [up.cards.get(n, "") for n in METHOD_NAMES]
            shown = [gr.update(visible=n in up.cards) for n in METHOD_NAMES]
            plots = [up.figures[k] for k in demo.PANEL_KEYS] if up.figures else [gr.skip()] * len(demo.PANEL_KEYS)
            controls = [gr.skip()] * 7
            if up.view is not None:
                v, c = up.view, demo.default_choices(up.view)
                ref = demo.whatif_reference(v)
                controls = [
                    gr.update(choices=[(v.labels[m], m) for m in v.selection_methods()], value=c["method"]),
                    gr.update(maximum=max(1, v.num_layers - 1), value=c["layer"]),
                    gr.update(maximum=max(1, v.num_kv_heads - 1), value=0),
                    gr.update(choices=[(v.labels[m], m) for m in v.draft_methods()], value=c["draft"]),
                    demo.costs_text(v), gr.update(value=ref.gamma), gr.update(value=round(ref.acceptance, 2))]
            view = up.view if up.view is not None else gr.skip()
            yield [gr.skip(), up.status, *shown, *cards, *plots, view, *controls]
    finally:
        updates.close()  # a cancelled job: the run stops at its next token and frees the model


named(run, INPUT_NAMES + SETTING_NAMES)

COMPARE_NAMES = ["video", "question", "methods", "frames", "max_new_tokens", "model"]


def compare(*args):
    """The comparison as plain data: the same JSON as `python -m sparsevid run --json`. A generator
    that yields no change while the run goes, so that a client that cancels or disconnects stops it."""
    n = len(COMPARE_NAMES) + len(FIELDS)
    video, question, methods, frames, max_new_tokens, model = args[:len(COMPARE_NAMES)]
    settings = dict(zip(SETTING_NAMES, args[len(COMPARE_NAMES):n]))
    request = args[n] if len(args) > n else None
    try:
        for out in compare_stream(video, question, model, frames, methods, settings, max_new_tokens,
                                  session=getattr(request, "session_hash", None)):
            yield gr.skip() if out is None else out
    except SparsevidError as e:  # an expected error: one line in the log (the worker's), no traceback
        raise gr.Error(str(e), print_exception=False) from None


named(compare, COMPARE_NAMES + SETTING_NAMES)


def stop(request: gr.Request):
    """Set this session's run's stop flag (its worker stops at its next token); Run is enabled again."""
    demo.request_stop(getattr(request, "session_hash", None) or "")
    return gr.update(interactive=True), gr.update(interactive=False)


def busy():
    return gr.update(interactive=False), gr.update(interactive=True)


def idle():
    return gr.update(interactive=True), gr.update(interactive=False)


def redraw(view, method, layer, head):
    """Panels 1-3 from the stored run (no model call)."""
    if view is None:
        return [gr.skip()] * 3
    return [demo.panel_tokens(view, method, layer, head), demo.panel_partition(view, method),
            demo.panel_scores(view, method)]


def redraw_drafts(view, method):
    return gr.skip() if view is None else demo.panel_drafts(view, method)


def redraw_whatif(gpu, gamma, acceptance, k):
    """Panel 6's what-if at the chosen reference setting (no model call)."""
    return demo.panel_whatif(whatif.Reference(gpu=gpu, gamma=int(gamma), acceptance=float(acceptance), k=int(k)))


def scope_hint(question, model):
    note = scope.scope_note(question, model)
    return gr.update(value=note, visible=bool(note))


def help_line(key: str):
    return gr.Markdown(demo.PANEL_HELP[key], elem_classes="help", elem_id=f"help-{key}")


with gr.Blocks(title="sparsevid") as app:
    gr.Markdown(demo.INTRO)
    if START.message():
        gr.Markdown(START.message(), elem_id="startup-warning")
    with gr.Row(equal_height=False):
        with gr.Column(scale=4, min_width=380):
            video = gr.Video(label=f"Video (≤ {demo.MAX_UPLOAD_MB} MB, ≤ {demo.MAX_MINUTES:g} min)", sources=["upload"],
                             height=220, elem_id="video")
            with gr.Row():
                question = gr.Textbox(label="Question", placeholder="What colour is the circle?", lines=1, scale=3,
                                      max_length=demo.MAX_QUESTION_CHARS, elem_id="question")
                forms = gr.Dropdown(scope.question_forms(), value=None, label="Forms the embedded model knows",
                                    scale=2, elem_id="question-forms", visible=scope.is_embedded(START.model))
            note = gr.Markdown("", visible=False, elem_id="scope-note")
            model = gr.Dropdown(demo.model_choices(), value=START.model, label="Model",
                                info="Real checkpoints load only where the Hugging Face hub is reachable.")
            with gr.Row():
                frames = gr.Slider(**demo.FRAMES, label="Frames sampled", info=demo.FRAMES_INFO)
                max_new_tokens = gr.Slider(**demo.MAX_NEW_TOKENS, label="Max new tokens")
            methods = gr.CheckboxGroup(START.methods, value=[n for _, n in START.methods if n not in START.broken],
                                       label="Methods (dense always runs)")
            widgets = []
            with gr.Accordion("Method settings", open=False):
                for group in demo.setting_groups():
                    with gr.Accordion(group.title, open=False):
                        widgets += [widget(f) for f in group.fields]
            with gr.Row():
                run_btn = gr.Button("Run", variant="primary", elem_id="run")
                stop_btn = gr.Button("Stop", variant="stop", interactive=False, elem_id="stop")
            progress_box = gr.Markdown("", elem_id="progress", min_height=56)  # the progress bar shows here
            gr.Markdown(f"<sub>{demo.limits_text()}</sub>")
        with gr.Column(scale=6, min_width=480):
            status = gr.Markdown("Upload a video, ask a question and press **Run** (or click a bundled example).",
                                 elem_id="status")
            with gr.Row(equal_height=False):  # one card per method, dense first; wraps
                card_cols, cards = [], []
                for n in METHOD_NAMES:
                    with gr.Column(visible=False, min_width=260, variant="panel") as col:
                        cards.append(gr.Markdown(elem_id=f"card-{n}", elem_classes="card"))
                    card_cols.append(col)
            if EXAMPLES:
                examples = gr.Examples([[e["path"], e["question"], e.get("frames") or demo.FRAMES["value"]]
                                        for e in EXAMPLES], inputs=[video, question, frames],
                                       label="Bundled examples (click one to run it; the 256-frame clip takes longer)",
                                       cache_examples=False)
    view = gr.State(None)
    empty = demo.empty_panels()
    with gr.Row():
        inspect_method = gr.Dropdown([], label="Method (panels 1–3)", scale=2)
        layer = gr.Slider(0, 1, value=0, step=1, label="Layer")
        head = gr.Slider(0, 1, value=0, step=1, label="KV head")
    plot_tokens = gr.Plot(empty["tokens"], label="1 · Selected tokens per head")
    help_line("tokens")
    with gr.Row(equal_height=False):
        with gr.Column():
            plot_partition = gr.Plot(empty["partition"], label="2 · Head partition")
            help_line("partition")
        with gr.Column():
            plot_scores = gr.Plot(empty["scores"], label="3 · Visual-head scores")
            help_line("scores")
    draft = gr.Dropdown([], label="Speculative method (panel 4)")
    plot_drafts = gr.Plot(empty["drafts"], label="4 · Draft tokens")
    help_line("drafts")
    plot_speed = gr.Plot(empty["speed"], label="5 · Speed and memory")
    help_line("speed")
    plot_costs = gr.Plot(empty["costs"], label="6 · Where the time goes")
    help_line("costs")
    costs_text = gr.Markdown("", elem_id="costs-text")
    with gr.Row():
        gpu = gr.Dropdown(list(whatif.BANDWIDTH), value=whatif.Reference().gpu, label="Reference GPU",
                          info="Peak memory bandwidth: A100 80GB 2.0, H100 SXM 3.35, H200 4.8 TB/s")
        gamma = gr.Slider(1, 16, value=whatif.Reference().gamma, step=1, label="γ (draft length)")
        acceptance = gr.Slider(0.0, 1.0, value=whatif.Reference().acceptance, step=0.01, label="Acceptance α",
                               info="Set to the run's measured acceptance after a run")
        k_ref = gr.Number(value=whatif.Reference().k, precision=0, label="K (visual tokens the draft keeps)")
    plot_whatif = gr.Plot(empty["whatif"], label="6 · What if")
    help_line("whatif")
    compare_out = gr.JSON(visible=False)
    compare_btn = gr.Button(visible=False)

    run_inputs = [video, question, model, frames, methods, max_new_tokens, *widgets]
    plots = [plot_tokens, plot_partition, plot_scores, plot_drafts, plot_speed, plot_costs, plot_whatif]
    run_outputs = [progress_box, status, *card_cols, *cards, *plots, view, inspect_method, layer, head, draft,
                   costs_text, gamma, acceptance]
    # Runs wait for the model on the worker's run lock, not in Gradio's queue, so that a request that
    # fails validation (frames=0, no video) answers at once while another run goes; on ZeroGPU a
    # waiting request would hold a GPU, so there one at a time
    in_flight = 1 if demo.backend.ZERO_GPU else 4
    gpu_queue = dict(concurrency_limit=in_flight, concurrency_id="gpu", show_progress_on=progress_box)
    buttons = [run_btn, stop_btn]
    runs = []
    for i, trigger in enumerate([run_btn.click, question.submit]
                                + ([examples.load_input_event.then] if EXAMPLES else [])):
        trigger(None, None, None, js=demo.SCROLL_TO_ANSWERS, queue=False, api_visibility="private")  # answers in view
        ev = trigger(busy, None, buttons, queue=False, api_visibility="private")
        ev = ev.then(run, run_inputs, run_outputs, api_name="run" if i == 0 else None,
                     api_visibility="public" if i == 0 else "private", **gpu_queue)
        ev.then(idle, None, buttons, queue=False, api_visibility="private")
        runs.append(ev)
    stop_btn.click(stop, None, buttons, cancels=runs, queue=False, api_name="stop")
    compare_btn.click(compare, [video, question, methods, frames, max_new_tokens, model, *widgets], compare_out,
                      api_name="compare", concurrency_limit=in_flight, concurrency_id="gpu")
    forms.input(lambda q: q, forms, question, queue=False, api_visibility="private")
    question.change(scope_hint, [question, model], note, queue=False, api_visibility="private")
    model.change(scope_hint, [question, model], note, queue=False, api_visibility="private")
    panel_inputs, panel_outputs = [view, inspect_method, layer, head], [plot_tokens, plot_partition, plot_scores]
    inspect_method.input(redraw, panel_inputs, panel_outputs, api_name="redraw", concurrency_limit=4)
    layer.release(redraw, panel_inputs, panel_outputs, api_visibility="private", concurrency_limit=4)
    head.release(redraw, panel_inputs, panel_outputs, api_visibility="private", concurrency_limit=4)
    draft.input(redraw_drafts, [view, draft], plot_drafts, api_name="redraw_drafts", concurrency_limit=4)
    for c in (gpu, gamma, acceptance, k_ref):
        c.change(redraw_whatif, [gpu, gamma, acceptance, k_ref], plot_whatif, api_visibility="private",
                 concurrency_limit=4)

if __name__ == "__main__":
    # show_error: a value Gradio's own components refuse (a word where a number goes) reaches an API
    # client as Gradio's message, not as "the app has raised an exception"
    app.queue(default_concurrency_limit=1, max_size=32).launch(max_file_size=f"{demo.MAX_UPLOAD_MB}mb", css=demo.CSS,
                                                               show_error=True)
