"""Methods by name. The registry imports each method module; they never import it back.

Every method is dense, a policy used directly (lossy), or a draft verified by dense (lossless).
Settings are one flat {key: value} mapping (`sparsevid.options`): each method reads the keys its
dataclass declares, so the same text typed in the CLI or the app gives the same configuration.
"""

from __future__ import annotations

from ..errors import InputError
from ..options import Option, parse, parse_config
from . import htsparse, layerskip, sparsemm, std, streaming
from .base import Method, Speculative

METHODS: dict[str, Method] = {m.name: m for m in [
    Method("dense", "Dense", "dense"),
    *std.METHODS, *streaming.METHODS, *layerskip.METHODS, *htsparse.METHODS, *sparsemm.METHODS]}


def all_options() -> list[Option]:
    """Every setting of every method, once per key, in registry order (shared keys must agree)."""
    seen: dict[str, Option] = {}
    for m in METHODS.values():
        for o in m.options():
            if o.key in seen and seen[o.key] != o:
                raise RuntimeError(f"setting {o.key!r} is declared twice with different definitions")
            seen.setdefault(o.key, o)
    return list(seen.values())


def methods_using(key: str) -> list[str]:
    """Names of the methods that read setting `key`."""
    return [m.name for m in METHODS.values() if any(o.key == key for o in m.options())]


def parse_methods(spec: str | list[str]) -> list[str]:
    """'dense,std' -> ['dense', 'std'] (dense always first). Unknown names raise InputError."""
    names = [n.strip() for n in (spec.split(",") if isinstance(spec, str) else spec) if n and n.strip()]
    bad = [n for n in names if n not in METHODS]
    if bad:
        raise InputError(f"Unknown method(s): {', '.join(bad)}. Available: {', '.join(METHODS)}.")
    return ["dense"] + [n for n in dict.fromkeys(names) if n != "dense"]


def check_settings(settings: dict | None) -> dict:
    """Parse every given setting (raises InputError on a bad value or an unknown key); -> {key: value}."""
    opts = {o.key: o for o in all_options()}
    settings = settings or {}
    unknown = [k for k in settings if k not in opts]
    if unknown:
        raise InputError(f"Unknown setting(s): {', '.join(unknown)}. Known: {', '.join(opts)}.")
    return {k: parse(opts[k], v) for k, v in settings.items()}


def configure(name: str, settings: dict | None = None):
    """(method config, speculative options) of method `name` from {key: value}: the config is None
    for dense, the Speculative options None unless the method is speculative."""
    m = METHODS[name]
    config = parse_config(m.config, settings) if m.config is not None else None
    return config, parse_config(Speculative, settings) if m.kind == "speculative" else None


__all__ = ["METHODS", "Method", "Speculative", "all_options", "check_settings", "configure", "methods_using",
           "parse_methods"]
