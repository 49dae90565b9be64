"""sparsevid demo: dense vs sparse and speculative decoding of a Video-LLM, side by side.

Layout and callbacks only; the work is in `sparsevid.app_logic` (validation, the streamed
comparison, panel data) and `sparsevid.plots` (the Plotly figures).

    python app.py                                  # http://localhost:7860, embedded model
    SPARSEVID_MODEL=/path/to/model python app.py   # another default model
    GRADIO_SERVER_NAME=0.0.0.0 GRADIO_SERVER_PORT=8080 python app.py
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported (shared CPUs)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import logging  # noqa: E402

import gradio as gr  # noqa: E402

from sparsevid import app_logic as logic  # noqa: E402

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

START = logic.startup()
METHOD_NAMES = list(logic.METHODS)  # one answer card per registered method, dense first
FIELDS = logic.setting_fields()
EXAMPLES = logic.load_examples()
run_comparison = logic.gpu(logic.run_comparison)  # ZeroGPU on Spaces, unchanged elsewhere

CSS = ".card thead { display: none; } .card table { width: 100%; font-size: 0.9em; }"
INTRO = """# sparsevid: faster Video-LLM decoding from attention sparsity
Upload a video and ask a question. The model answers with **dense** decoding and with each method
you pick, on the same inputs: **StD** (a top-K sparse draft verified by dense, lossless),
**HT-Sparse** (query-guided head and token routing), **SparseMM** (visual heads get larger KV budgets),
and the Streaming and LayerSkip drafts. The panels below show what each method did."""


def _widget(f: logic.Field):
    if f.kind == "bool":
        return gr.Checkbox(value=f.default, label=f.label, info=f.info or None)
    if f.kind == "choice":
        return gr.Dropdown(list(f.choices), value=f.default, label=f.label, info=f.info or None)
    if f.kind == "optional":  # blank = the method's default
        return gr.Textbox(value="" if f.default is None else str(f.default), label=f.label, info=f.info or None,
                          placeholder="default")
    if f.minimum is not None and f.maximum is not None:
        return gr.Slider(f.minimum, f.maximum, value=f.default, step=f.step, label=f.label, info=f.info or None)
    return gr.Number(value=f.default, label=f.label, info=f.info or None, precision=0 if f.kind == "int" else None)


def _plot_outputs(figs: dict | None):
    if figs is None:
        return [gr.skip()] * 5
    return [figs[k] for k in ("tokens", "partition", "scores", "drafts", "speed")]


def run(video, question, model, frames, methods, max_new_tokens, *setting_values, progress=gr.Progress()):
    settings = {f.name: v for f, v in zip(FIELDS, setting_values)}
    for up in run_comparison(video, question, model, frames, methods, settings, max_new_tokens):
        if up.progress:
            progress(up.progress[0], desc=up.progress[1])
        if up.error:
            gr.Warning(up.error)
        cards = [up.cards.get(n, "") for n in METHOD_NAMES]
        shown = [gr.update(visible=n in up.cards) for n in METHOD_NAMES]
        controls = [gr.skip()] * 4
        if up.view is not None:
            v, c = up.view, logic.default_choices(up.view)
            controls = [
                gr.update(choices=[(v.labels[m], m) for m in v.selection_methods()], value=c["method"]),
                gr.update(maximum=max(1, v.num_layers - 1), value=c["layer"]),
                gr.update(maximum=max(1, v.num_kv_heads - 1), value=0),
                gr.update(choices=[(v.labels[m], m) for m in v.draft_methods()], value=c["draft"])]
        view = up.view if up.view is not None else gr.skip()
        yield [gr.skip(), up.status, *shown, *cards, *_plot_outputs(up.figures), view, *controls]


def redraw(view, method, layer, head):
    """Panels 1-3 from the stored run (no model call)."""
    if view is None:
        return [gr.skip()] * 3
    return [logic.panel_tokens(view, method, layer, head), logic.panel_partition(view, method),
            logic.panel_scores(view, method)]


def redraw_drafts(view, method):
    return gr.skip() if view is None else logic.panel_drafts(view, method)


with gr.Blocks(title="sparsevid") as demo:
    gr.Markdown(INTRO)
    if START["warning"]:
        gr.Markdown(f"⚠️ The default model could not be loaded: {START['warning']}")
    with gr.Row():
        with gr.Column(scale=1, min_width=320):
            video = gr.File(label=f"Video ({', '.join(t[1:] for t in logic.VIDEO_TYPES)}; ≤ {logic.MAX_UPLOAD_MB} MB, "
                                  f"≤ {logic.MAX_MINUTES:g} min)", file_types=logic.VIDEO_TYPES, type="filepath")
            question = gr.Textbox(label="Question", placeholder="What colour is the circle?", lines=2,
                                  max_length=logic.MAX_QUESTION_CHARS)
            model = gr.Dropdown(logic.model_choices(), value=START["model"], label="Model",
                                info="Real checkpoints load only where the Hugging Face hub is reachable.")
            with gr.Row():
                frames = gr.Slider(**logic.FRAMES, label="Frames sampled")
                max_new_tokens = gr.Slider(**logic.MAX_NEW_TOKENS, label="Max new tokens")
            run_btn = gr.Button("Run", variant="primary")
            progress_box = gr.Markdown("", elem_id="progress", min_height=56)  # the progress bar shows here
            gr.Markdown(f"<sub>{logic.limits_text()}</sub>")
        with gr.Column(scale=1, min_width=320):
            methods = gr.CheckboxGroup(START["methods"], value=[n for _, n in START["methods"]],
                                       label="Methods (dense always runs)")
            widgets = []
            with gr.Accordion("Method settings", open=False):
                for group in logic.setting_groups():
                    with gr.Accordion(group.title, open=False):
                        widgets += [_widget(f) for f in group.fields]
    if EXAMPLES:
        examples = gr.Examples([[e["path"], e["question"]] for e in EXAMPLES], inputs=[video, question],
                               label="Bundled examples (click one to run it)", cache_examples=False)
    status = gr.Markdown("Upload a video, ask a question and press **Run**.", elem_id="status")
    with gr.Row(equal_height=False):  # one column per method, dense first; wraps on narrow screens
        card_cols, cards = [], []
        for n in METHOD_NAMES:
            with gr.Column(visible=False, min_width=300, variant="panel") as col:
                cards.append(gr.Markdown(elem_id=f"card-{n}", elem_classes="card"))
            card_cols.append(col)
    view = gr.State(None)
    empty = logic.empty_figures()
    with gr.Row():
        inspect = gr.Dropdown([], label="Method (panels 1–3)", scale=2)
        layer = gr.Slider(0, 1, value=0, step=1, label="Layer")
        head = gr.Slider(0, 1, value=0, step=1, label="KV head")
    plot_tokens = gr.Plot(empty["tokens"], label="1 · Selected tokens per head")
    with gr.Row():
        plot_partition = gr.Plot(empty["partition"], label="2 · Head partition")
        plot_scores = gr.Plot(empty["scores"], label="3 · Visual-head scores")
    draft = gr.Dropdown([], label="Speculative method (panel 4)")
    plot_drafts = gr.Plot(empty["drafts"], label="4 · Draft tokens")
    plot_speed = gr.Plot(empty["speed"], label="5 · Speedups")

    run_inputs = [video, question, model, frames, methods, max_new_tokens, *widgets]
    plots = [plot_tokens, plot_partition, plot_scores, plot_drafts, plot_speed]
    run_outputs = [progress_box, status, *card_cols, *cards, *plots, view, inspect, layer, head, draft]
    gpu_queue = dict(concurrency_limit=1, concurrency_id="gpu", show_progress_on=progress_box)
    run_btn.click(run, run_inputs, run_outputs, api_name="run", **gpu_queue)
    question.submit(run, run_inputs, run_outputs, api_visibility="private", **gpu_queue)
    if EXAMPLES:
        examples.load_input_event.then(run, run_inputs, run_outputs, api_visibility="private", **gpu_queue)
    panel_outputs = [plot_tokens, plot_partition, plot_scores]
    inspect.input(redraw, [view, inspect, layer, head], panel_outputs, api_name="redraw", concurrency_limit=4)
    layer.release(redraw, [view, inspect, layer, head], panel_outputs, api_visibility="private", concurrency_limit=4)
    head.release(redraw, [view, inspect, layer, head], panel_outputs, api_visibility="private", concurrency_limit=4)
    draft.input(redraw_drafts, [view, draft], plot_drafts, api_name="redraw_drafts", concurrency_limit=4)


if __name__ == "__main__":
    demo.queue(default_concurrency_limit=1, max_size=32).launch(max_file_size=f"{logic.MAX_UPLOAD_MB}mb", css=CSS)
