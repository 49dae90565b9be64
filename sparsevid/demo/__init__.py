"""Everything the Gradio app does except layout and wiring; imports no gradio (only `app.py` does).

- `config`: limits, the settings fields (from `methods.all_options()`), the bundled examples;
- `backend`: the model cache, `RUN_LOCK` (one run on a model at a time), the start-up method check;
- `worker`: `run_comparison`, the streamed comparison (a generator of `Update`s; closing it cancels);
- `panels`: the `View` built from a run's traces, and the six panels drawn from it (the sixth in two
  figures: this run's step costs, and the what-if of `sparsevid.whatif`), with a line on how to read each;
- `scope`: the embedded model's question forms, the matcher and the out-of-scope note.
"""

from .backend import RUN_LOCK, Startup, broken_methods, check_methods, default_model, describe_method, get_model, gpu, \
    model_choices, startup
from .config import CSS, FRAMES, FRAMES_INFO, INTRO, MAX_MINUTES, MAX_NEW_TOKENS, MAX_QUESTION_CHARS, MAX_UPLOAD_MB, \
    PRESETS, SCROLL_TO_ANSWERS, VIDEO_TYPES, Field, Group, find_example, limits_text, load_examples, sampled_boxes, setting_fields, setting_groups, \
    settings_from
from .panels import PANEL_HELP, PANEL_KEYS, View, all_panels, build_view, costs_text, default_choices, \
    empty_panels, panel_costs, panel_drafts, panel_partition, panel_scores, panel_speed, panel_tokens, panel_whatif, \
    whatif_reference
from .scope import question_forms, question_type, scope_note
from .worker import Update, card, compare_json, compare_stream, request_stop, result_json, run_comparison

__all__ = ["PANEL_HELP", "compare_json", "compare_stream", "costs_text", "panel_costs", "panel_whatif", "question_forms",
           "question_type", "request_stop", "result_json", "scope_note", "whatif_reference", "CSS", "FRAMES",
           "FRAMES_INFO", "INTRO", "MAX_MINUTES", "MAX_NEW_TOKENS", "MAX_QUESTION_CHARS", "MAX_UPLOAD_MB", "PANEL_KEYS",
           "PRESETS", "SCROLL_TO_ANSWERS",
           "RUN_LOCK", "VIDEO_TYPES", "Field", "Group", "Startup", "Update", "View", "all_panels", "broken_methods",
           "build_view", "card", "check_methods", "default_choices", "default_model", "describe_method", "empty_panels",
           "find_example", "get_model", "gpu", "limits_text", "load_examples", "model_choices", "panel_drafts",
           "panel_partition", "panel_scores", "panel_speed", "panel_tokens", "run_comparison", "sampled_boxes",
           "setting_fields", "setting_groups", "settings_from", "startup"]
