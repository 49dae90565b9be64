"""The embedded model's scope: the question forms it was trained on (`toy.questions.TEMPLATES`, and
the narrations first),
a matcher for them, and the note shown when a question falls outside them.

The matcher is a regex built from the templates themselves, over `questions.normalise`d text (lower
case, punctuation dropped), with {ref} standing for the references the training used: "the
{colour} object", "the {shape}" or "the {colour} {shape}" (colour questions name the shape, shape
questions the colour, as in training).
"""

from __future__ import annotations

import functools
import os
import re

from ..models import EMBEDDED, EMBEDDED_NAME
from ..toy.clips import COLOURS, SHAPES
from ..toy.questions import NARRATE, NARRATE_TEMPLATES, TEMPLATES, normalise

# A concrete question per template, in the order of `TEMPLATES` (the question box's suggestions).
_REF_EXAMPLE = {"colour": "the circle", "shape": "the red object"}
FORMS = {NARRATE: NARRATE_TEMPLATES, **TEMPLATES}  # narrations first: the answers worth decoding fast


def _refs(qtype: str) -> str:
    c, s = "|".join(COLOURS), "|".join(SHAPES)
    if qtype == "colour":
        return f"the (?:{s})"
    if qtype == "shape":
        return f"the (?:{c}) object"
    return f"the (?:(?:{c}) object|{s}|(?:{c}) (?:{s}))"


@functools.lru_cache(maxsize=1)
def _patterns() -> dict[str, re.Pattern]:
    out = {}
    for qtype, forms in FORMS.items():
        alts = []
        for t in forms:
            head, _, tail = normalise(t.replace("{ref}", " REFX ")).partition("refx")
            alts.append(re.escape(head.strip()) + (r"\s*" + _refs(qtype) + r"\s*" + re.escape(tail.strip())
                                                   if "{ref}" in t else ""))
        out[qtype] = re.compile(r"^(?:" + "|".join(a.replace(r"\ ", " ").rstrip() for a in alts) + r")$")
    return out


def question_type(question: str) -> str | None:
    """The trained question type `question` has ("colour", "describe", ...), or None when it has
    none of the forms."""
    q = normalise(question or "")
    return next((t for t, p in _patterns().items() if p.match(q)), None)


def question_forms() -> list[str]:
    """One concrete question per template, e.g. "What colour is the circle?", "Describe the red square."."""
    out = []
    for qtype, forms in FORMS.items():
        for t in forms:
            out.append(t.format(ref=_REF_EXAMPLE.get(qtype, "the red square")))
    return out


def display_forms() -> list[str]:
    """Every template with its reference spelled as training used it ("What colour is the {shape}?")."""
    ref = {"colour": "the {shape}", "shape": "the {colour} object"}
    return [t.replace("{ref}", ref.get(q, "{ref}")) for q, forms in FORMS.items() for t in forms]


def is_embedded(model: str | None) -> bool:
    return model in (None, "", EMBEDDED_NAME) or (bool(model) and os.path.abspath(model) == EMBEDDED)


def scope_note(question: str, model: str | None) -> str:
    """'' when the model is not the embedded one or `question` has a trained form; else a one-line
    note (markdown) that says the answer may be meaningless and what the model understands."""
    if not is_embedded(model) or not (question or "").strip() or question_type(question) is not None:
        return ""
    return ("ℹ️ **Outside the embedded model's scope**: it was trained only on these question forms "
            "(`{ref}` is \"the red object\", \"the circle\" or \"the red circle\"): "
            + "; ".join(f"*{t}*" for t in display_forms())
            + ". It will still answer, but the answer may mean nothing; the speed figures stand.")
