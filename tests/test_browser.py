"""The app in a real browser: Debian's Chromium driven by Playwright uploads a clip, runs every
method, waits for the five Plotly panels, then runs a bundled example with one click (its
ground-truth box drawn on panel 1) and takes a screenshot.

The screenshot goes to a temporary folder; with SPARSEVID_SCREENSHOT=1 it replaces
assets/screenshot.png (the README's). Skipped only when /usr/bin/chromium is missing.
"""

import os

import pytest

import _appserver

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREENSHOT = os.path.join(_appserver.ROOT, "assets", "screenshot.png")
TIMEOUT_MS = 180_000

PANELS_READY = """() => {
  const plots = [...document.querySelectorAll('.js-plotly-plot')];
  return plots.length >= 5 && plots.every(p => p.data && p.data.length > 0 &&
                                          !(p.layout && p.layout.meta && p.layout.meta.placeholder));
}"""


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is missing (apt-get install chromium)")
def test_browser_upload_run_and_panels(tmp_path):
    from playwright.sync_api import sync_playwright

    app = _appserver.server()
    clip = _appserver.write_clip(str(tmp_path / "moving_square.mp4"))
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 1000})
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(app["url"], wait_until="domcontentloaded")
            page.wait_for_selector("#status", timeout=60_000)
            # 1. Upload a clip, type a question, run every method.
            page.locator("input[type=file]").first.set_input_files(clip)
            page.get_by_text("moving_square.mp4").first.wait_for(timeout=60_000)
            page.get_by_label("Question").fill(_appserver.question_for(app["model"]))
            _set_number(page, "Frames sampled", 8)
            _set_number(page, "Max new tokens", 12)
            page.get_by_role("button", name="Run", exact=True).click()
            page.wait_for_function("document.querySelector('#status').innerText.includes('full comparison')",
                                   timeout=TIMEOUT_MS)
            status = page.locator("#status").inner_text()
            assert "⚠️" not in status, status
            page.wait_for_function(PANELS_READY, timeout=60_000)
            n_traces = page.evaluate("() => [...document.querySelectorAll('.js-plotly-plot')].map(p => p.data.length)")
            assert len(n_traces) >= 5 and all(n > 0 for n in n_traces), n_traces
            assert page.locator("text=identical to dense").count() > 0
            # 2. One click on a bundled example runs it; panel 1 draws the asked object's box.
            page.locator("[data-testid='dataset-cell-0-0']").first.click()
            page.wait_for_function("(() => { const t = document.querySelector('#status').innerText;"
                                   " return t.includes('bundled example') && t.includes('full comparison'); })()",
                                   timeout=TIMEOUT_MS)
            page.wait_for_function(PANELS_READY, timeout=60_000)
            boxes = page.evaluate("() => (document.querySelector('.js-plotly-plot').layout.shapes || []).length")
            assert boxes > 0, "no ground-truth box on panel 1"
            page.wait_for_timeout(500)  # let the last plots finish their layout
            out = SCREENSHOT if os.environ.get("SPARSEVID_SCREENSHOT") == "1" else str(tmp_path / "screenshot.png")
            page.screenshot(path=out, full_page=True)
            assert os.path.getsize(out) > 10_000
            assert not errors, errors
        finally:
            browser.close()


def _set_number(page, label: str, value: int) -> None:
    """Type into the number box of a Gradio slider."""
    box = page.get_by_label(f"number input for {label}")
    if box.count() == 0:
        box = page.locator(f"input[type=number][aria-label*='{label}']")
    box.first.fill(str(value))
    box.first.press("Enter")
