"""Method settings: declared once, as dataclass fields with `option(...)` metadata, parsed by one parser.

A method's dataclass is its configuration. Each field made with `option` carries its help text,
kind, range and unit; from these the CLI builds its flags (`add_arguments`) and the app its fields,
and both turn what a user typed into a value with `parse`. Keys are global: a key used by several
methods (e.g. `k` for StD and Streaming, `gamma` for every draft) is one setting, declared once and
imported by the others.

Kinds:
- "int", "float": a number within [min, max];
- "bool": on/off (true/false, 1/0, yes/no);
- "choice": one of `choices`;
- "amount": a count or a fraction. "288" (no decimal point) is a count of 288 (at least `min`,
  0 when it has none); "0.25" (with a decimal point, in (0, 1]) is a fraction of the whole; blank
  means the default rule (None). The same text gives the same value in the CLI and the app.
- "optional_int": a positive whole number, or blank for the default rule (None).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from .errors import InputError

KINDS = ("int", "float", "bool", "choice", "amount", "optional_int")
_INT = re.compile(r"^[+-]?\d+$")


@dataclass(frozen=True)
class Option:
    """One user-facing setting. `key` is its global name (CLI flag `--key-with-dashes`)."""

    key: str
    default: Any
    help: str
    kind: str
    label: str = ""
    min: float | None = None
    max: float | None = None
    unit: str = ""
    choices: tuple = ()

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    @property
    def title(self) -> str:
        return self.label or self.key


def count(text: str) -> int:
    """A command-line type: a whole number >= 1 (`--frames 0` or `--max-new-tokens x` is a usage error
    naming the flag, not a failure deep in a run)."""
    n = int(text) if _INT.match(str(text).strip()) else 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, not {text!r}")
    return n


def counts(text: str) -> str:
    """A command-line type: a comma list of whole numbers >= 1 ("16,256"), returned as given, spaces
    dropped (its readers split it)."""
    items = [t.strip() for t in str(text).split(",")]
    for t in items:
        count(t)
    return ",".join(items)


def option(default, help: str, kind: str, *, key: str | None = None, label: str = "", min=None, max=None,
           unit: str = "", choices: tuple = ()):
    """A dataclass field declaring a setting (its key defaults to the field's name)."""
    if kind not in KINDS:
        raise ValueError(f"unknown option kind {kind!r}")
    meta = dict(key=key, help=help, kind=kind, label=label, min=min, max=max, unit=unit, choices=tuple(choices))
    return dataclasses.field(default=default, metadata={"option": meta})


def options_of(cls) -> list[tuple[str, Option]]:
    """(field name, Option) of each setting a dataclass declares, in field order."""
    out = []
    for f in dataclasses.fields(cls):
        meta = f.metadata.get("option")
        if meta is not None:
            out.append((f.name, Option(default=f.default, **{**meta, "key": meta["key"] or f.name})))
    return out


def _range(opt: Option, v):
    lo, hi = opt.min, opt.max
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        bounds = (f"between {lo:g} and {hi:g}" if lo is not None and hi is not None
                  else f"at least {lo:g}" if lo is not None else f"at most {hi:g}")
        raise InputError(f"{opt.title} must be {bounds} (got {v:g}).")
    return v


def parse(opt: Option, value):
    """What a user gave for `opt` (text from a CLI flag or an app field, or a typed value) -> its value.
    Raises InputError with a one-line message."""
    name = opt.title
    if isinstance(value, str):
        value = value.strip()
    if opt.kind in ("amount", "optional_int") and value in (None, ""):
        return None
    if value is None or value == "":
        return opt.default
    try:
        if opt.kind == "bool":
            if isinstance(value, str):
                low = value.lower()
                if low not in ("true", "false", "on", "off", "yes", "no", "1", "0"):
                    raise ValueError
                return low in ("true", "on", "yes", "1")
            return bool(value)
        if opt.kind == "choice":
            if value not in opt.choices:
                raise InputError(f"{name}: choose one of {', '.join(map(str, opt.choices))} (got {value!r}).")
            return value
        if opt.kind == "int":
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return _range(opt, int(value) if not isinstance(value, str) else int(value, 10))
        if opt.kind == "float":
            return _range(opt, float(value))
        if opt.kind == "optional_int":
            v = int(value, 10) if isinstance(value, str) else int(value)
            return _range(opt, v)
        # amount: a count (whole number written without a decimal point) or a fraction in (0, 1]
        if isinstance(value, bool):
            raise ValueError
        if isinstance(value, int) or (isinstance(value, str) and _INT.match(value)):
            v = int(value)
            least = int(opt.min) if opt.min is not None else 0
            if v < least:
                raise InputError(f"{name} must be a count of at least {least} or a fraction in (0, 1] (got {v}).")
            return v
        v = float(value)
        if not 0 < v <= 1:
            raise InputError(f"{name}: a fraction must be in (0, 1]; a count is a whole number "
                             f"without a decimal point (got {value}).")
        return v
    except (ValueError, TypeError):
        raise InputError(f"{name} must be {_describe(opt)}, not {str(value)[:20]!r}.") from None


def _describe(opt: Option) -> str:
    return {"int": "a whole number", "float": "a number", "bool": "on or off", "choice": "one of the choices",
            "amount": "a count (e.g. 288) or a fraction (e.g. 0.25)",
            "optional_int": "a whole number (or blank for the default)"}[opt.kind]


def parse_config(cls, values: dict | None = None):
    """An instance of the dataclass `cls` from {key: value}; keys it does not declare are ignored,
    missing ones take their defaults."""
    values = values or {}
    kw = {name: parse(opt, values[opt.key]) for name, opt in options_of(cls) if opt.key in values}
    return cls(**kw)


def add_arguments(parser, opts: list[Option]) -> None:
    """One argparse flag per option; values stay text (None when not given) for `parse`."""
    for opt in opts:
        default = "blank: the default rule" if opt.default is None else opt.default
        if opt.kind == "bool":
            import argparse

            parser.add_argument(opt.flag, dest=opt.key, action=argparse.BooleanOptionalAction, default=None,
                                help=f"{opt.help} (default {'on' if opt.default else 'off'})")
            continue
        extra = dict(choices=list(opt.choices)) if opt.kind == "choice" else {}
        unit = f" [{opt.unit}]" if opt.unit else ""
        one_of = f"; one of {', '.join(map(str, opt.choices))}" if opt.choices else ""
        parser.add_argument(opt.flag, dest=opt.key, default=None, metavar=opt.key.upper(),
                            help=f"{opt.help}{unit} (default {default}{one_of})", **extra)


def values_from_args(args, opts: list[Option]) -> dict:
    """{key: text or value} of the flags that were given."""
    return {o.key: getattr(args, o.key) for o in opts if getattr(args, o.key, None) is not None}
