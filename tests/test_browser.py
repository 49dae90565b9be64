"""The app in a real browser: Debian's Chromium driven by Playwright.

1. An out-of-scope question shows the note under the question box before any run.
2. One click on the bundled multi-token example ("What does the square do?") runs it end to end:
   the answers stream in the cards beside the inputs, all six panels are drawn (the sixth in two
   figures), panel 1 draws the asked object's ground-truth box, panel 4 shows several rounds; a
   screenshot is taken.
3. A long run (256 frames) is stopped with Stop (Run is disabled while it runs, enabled after); the
   next run is complete and correct.
4. The plain-data endpoint (/compare, through gradio_client) returns the same tokens as `run --json`.

The screenshot goes to a temporary folder; with SPARSEVID_SCREENSHOT=1 it replaces
assets/screenshot.png (the README's, 1440 x 1000 viewport, full page). Skipped only when
/usr/bin/chromium is missing.
"""

import contextlib
import io
import json
import os

import pytest

import _appserver

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREENSHOT = os.path.join(_appserver.ROOT, "assets", "screenshot.png")
TIMEOUT_MS = 240_000
N_FIGURES = 7  # panels 1-5, and panel 6's two figures

PANELS_READY = """(n) => {
  const plots = [...document.querySelectorAll('.js-plotly-plot')];
  return plots.length >= n && plots.every(p => p.data && p.data.length > 0 &&
                                          !(p.layout && p.layout.meta && p.layout.meta.placeholder));
}"""
DONE = "document.querySelector('#status').innerText.includes('full comparison')"


def _examples():
    from sparsevid import demo

    return demo.load_examples(_appserver.server()["examples"])


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is missing (apt-get install chromium)")
def test_browser_example_stop_scope_and_api(tmp_path):
    from playwright.sync_api import sync_playwright

    app = _appserver.server()
    examples = _examples()
    multi = next((i for i, e in enumerate(examples) if len(e.get("answer", "").split()) > 3), 0)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 1000})
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(app["url"], wait_until="domcontentloaded")
            page.wait_for_selector("#status", timeout=60_000)
            # 1. A question outside the embedded model's forms: a visible note.
            if app["model"] == "embedded":
                page.locator("#question textarea").fill("What is the man doing?")
                page.locator("#scope-note").get_by_text("Outside the embedded model's scope").wait_for(timeout=30_000)
            # 2. One click on the bundled multi-token example runs it; every panel is drawn.
            page.locator(f"[data-testid='dataset-cell-{multi}-0']").first.click()
            page.wait_for_function("(() => { const t = document.querySelector('#status').innerText;"
                                   " return t.includes('bundled example') && t.includes('full comparison'); })()",
                                   timeout=TIMEOUT_MS)
            assert "⚠️" not in page.locator("#status").inner_text()
            page.wait_for_function(PANELS_READY, arg=N_FIGURES, timeout=60_000)
            assert page.locator("#scope-note").is_hidden()
            dense = page.locator("#card-dense").inner_text()
            assert examples[multi]["answer"] in dense, dense
            assert page.locator("text=identical to dense").count() > 0
            boxes = page.evaluate("() => (document.querySelector('.js-plotly-plot').layout.shapes || []).length")
            assert boxes > 0, "no ground-truth box on panel 1"
            rounds = page.evaluate("() => { const p = [...document.querySelectorAll('.js-plotly-plot')]"
                                   ".find(p => (p.layout.title.text || '').startsWith('Draft tokens'));"
                                   " return p ? p.layout.yaxis.tickvals.length - 1 : -1; }")
            assert rounds >= 2, rounds
            assert page.locator("#costs-text").inner_text().strip()
            page.wait_for_timeout(800)  # let the last plots finish their layout
            page.evaluate("() => window.scrollTo(0, 0)")
            out = SCREENSHOT if os.environ.get("SPARSEVID_SCREENSHOT") == "1" else str(tmp_path / "screenshot.png")
            page.screenshot(path=out, full_page=True)
            assert os.path.getsize(out) > 10_000
            # 3. Stop a long run; Run is disabled while it runs and enabled after; the next run is complete.
            run, stop = page.locator("#run"), page.locator("#stop")
            assert run.is_enabled() and stop.is_disabled()
            _set_number(page, "Frames sampled", 256)
            run.click()
            page.wait_for_function("document.querySelector('#run').disabled", timeout=30_000)
            assert stop.is_enabled()
            page.wait_for_function("[...document.querySelectorAll('.card')].some(c => c.innerText.includes('prefill') "
                                   "|| c.innerText.includes('decoding'))", timeout=TIMEOUT_MS)
            stop.click()
            page.wait_for_function("!document.querySelector('#run').disabled", timeout=60_000)
            assert not page.evaluate(DONE)
            _set_number(page, "Frames sampled", int(examples[multi].get("frames") or 16))
            run.click()
            page.wait_for_function(DONE, timeout=TIMEOUT_MS)
            page.wait_for_function(PANELS_READY, arg=N_FIGURES, timeout=60_000)
            assert examples[multi]["answer"] in page.locator("#card-dense").inner_text()
            page.wait_for_function("!document.querySelector('#run').disabled", timeout=30_000)
            assert not errors, errors
        finally:
            browser.close()
    # 4. The plain-data endpoint: the same tokens as `run --json`.
    from gradio_client import Client, handle_file

    from sparsevid import cli

    e = examples[multi]
    frames = int(e.get("frames") or 16)
    api = Client(app["url"], verbose=False).predict(video=handle_file(e["path"]), question=e["question"],
                                                    methods=["std"], frames=frames, max_new_tokens=24,
                                                    api_name="/compare")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli.main(["run", e["path"], e["question"], "--model", app["model"], "--methods", "dense,std",
                         "--frames", str(frames), "--max-new-tokens", "24", "--k", "0.25", "--json", "--quiet"]) == 0
    ref = json.loads(buf.getvalue())
    assert {n: m["token_ids"] for n, m in api["methods"].items()} == {n: m["token_ids"] for n, m in
                                                                      ref["methods"].items()}


def _set_number(page, label: str, value: int) -> None:
    """Type into the number box of a Gradio slider."""
    box = page.get_by_label(f"number input for {label}")
    if box.count() == 0:
        box = page.locator(f"input[type=number][aria-label*='{label}']")
    box.first.fill(str(value))
    box.first.press("Enter")
