"""The README's promises: its hand-written sections exist, its library snippet runs, and every
command it lists answers --help."""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()


def section(title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, re.S | re.M)
    assert m, f"README lost its section {title!r}"
    return m.group(1)


@pytest.mark.parametrize("title", ["Quick start", "The methods", "Command line", "Library", "Layout",
                                   "Running the app elsewhere", "Limits"])
def test_readme_keeps_its_hand_written_sections(title):
    assert len(section(title).strip()) > 100


def test_readme_library_snippet_runs_and_stays_lossless():
    code = re.search(r"```python\n(.*?)```", section("Library"), re.S).group(1)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_WAIT_POLICY="PASSIVE"))
    assert out.returncode == 0, out.stderr[-2000:]
    text, identical, acceptance = out.stdout.strip().rsplit(" ", 2)
    with open(os.path.join(ROOT, "assets", "examples", "examples.json")) as f:
        narration = next(e for e in json.load(f) if e["file"] == "toy_narrate.mp4")
    assert text == narration["answer"] and len(text.split()) > 15  # the bundled narration, exactly
    assert identical == "True" and 0 < float(acceptance) <= 1


def commands() -> list[list[str]]:
    """Each distinct `python -m MODULE [SUBCOMMAND]` of the Command line section."""
    found = []
    for line in section("Command line").splitlines():
        m = re.match(r"(?:accelerate launch .*? -m|python -m) (sparsevid[.\w]*)(?: ([a-z-]+(?: \| [a-z-]+)*))?", line)
        if not m:
            continue
        subs = (m.group(2) or "").split(" | ") if m.group(2) and not m.group(2).startswith("-") else [""]
        for sub in subs:
            cmd = [m.group(1)] + ([sub] if sub else [])
            if cmd not in found:
                found.append(cmd)
    return found


def test_readme_lists_every_cli_subcommand():
    from sparsevid.cli import build_parser

    listed = {c[1] for c in commands() if c[0] == "sparsevid" and len(c) > 1}
    sub = next(a for a in build_parser()._actions if a.dest == "cmd")
    assert listed == set(sub.choices)


@pytest.mark.parametrize("cmd", commands(), ids=" ".join)
def test_every_command_in_the_readme_answers_help(cmd):
    out = subprocess.run([sys.executable, "-m", *cmd, "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert out.returncode == 0, out.stderr[-1500:]
    assert "usage:" in out.stdout
