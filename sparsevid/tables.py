"""Markdown tables for the command-line faces (bench, eval, the HT-Sparse ablation)."""

from __future__ import annotations


def cell(v, kind: str = "") -> str:
    """A value as a table cell: None '-', booleans yes/NO, kind 'x' (ratio), 'pct' (share), 'g' (as is)."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, str):
        return v
    return {"pct": f"{v:.0%}", "x": f"{v:.2f}x", "g": f"{v:g}"}.get(kind, f"{v:.2f}")


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = [header, ["---"] * len(header)] + rows
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)
