"""End-to-end: the llama.cpp WebUI that `ninfer serve` serves, driven in headless Chromium.

The WebUI is the one scripts/fetch-webui.sh builds (found where `ninfer serve` finds it,
ninfer_core.server.webui.default_webui_dir); the browser is the system Chromium (Debian's
`chromium`, or $CHROMIUM) driven by Playwright. .ci/run installs and builds all three; elsewhere a
missing piece skips the test and says which. Screenshots go to the test's tmp_path (printed).

1. On the default model, ninfer-tiny: ask "What is 38 + 47?", see the prompt-processing progress
   ("Processing N%", from return_progress; --prefill-chunk 16 makes the prompt take several
   units), the reasoning, the answer "85" and the live token statistics (timings_per_token).
2. On a random-weights model, whose thinking never closes by itself: Skip reasoning ends it (the
   reasoning then carries the close the server inserted and an answer follows), and Stop cancels
   the generation (the server goes idle).
Neither run may log a console error or throw: the only error lines allowed are the browser's
report of the 403 that /tools answers by design (llama-server without tools does the same).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import httpx
import pytest

from ninfer_core.server.prepare import BUDGET_MESSAGE
from ninfer_core.server.webui import ENTRY, default_webui_dir

pytestmark = pytest.mark.timeout(900)
QUESTION = "What is 38 + 47?"
# Recorded in the page: every "Processing N%" text the UI showed while the prompt was processed.
PROGRESS_WATCH = """
window.__progress = [];
new MutationObserver(() => {
  const m = (document.body && document.body.innerText || '').match(/Processing \\d+%[^\\n]*/g);
  if (m) for (const t of m) if (!window.__progress.includes(t)) window.__progress.push(t);
}).observe(document, {subtree: true, childList: true, characterData: true});
"""
# Recorded in the page: whether each text pushed onto window.__needles was ever in the document. The
# reasoning block collapses (its text leaves the DOM) as soon as the answer starts, so the budget's
# close may be visible for a fraction of a second only: polling the page from here missed it once.
TEXT_WATCH = """
window.__needles = []; window.__found = {};
new MutationObserver(() => {
  const t = (document.body && document.body.textContent) || '';
  for (const n of window.__needles) if (!window.__found[n] && t.includes(n)) window.__found[n] = true;
}).observe(document, {subtree: true, childList: true, characterData: true});
"""


def _chromium() -> str:
    exe = os.environ.get("CHROMIUM") or next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
    if exe is None:
        pytest.skip("no Chromium on this machine (apt-get install chromium, or set CHROMIUM)")
    return exe


def _webui() -> Path:
    d = default_webui_dir()
    if not (d / ENTRY).is_file():
        pytest.skip(f"the built WebUI is absent from {d} (run scripts/fetch-webui.sh)")
    return d


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[clients]')")
    exe = _chromium()
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


class Page:
    """One browser page on the served WebUI, with its console watched."""

    def __init__(self, browser, base: str, shots: Path):
        self.base, self.shots = base, shots
        self.errors: list[str] = []
        self.context = browser.new_context(viewport={"width": 1280, "height": 900})
        self.page = self.context.new_page()
        self.page.add_init_script(PROGRESS_WATCH)
        self.page.add_init_script(TEXT_WATCH)
        self.controls: list[str] = []  # the answers of POST /v1/chat/completions/control
        self.page.on("response", self._response)
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        self.n = 0

    def _response(self, resp) -> None:
        if resp.url.endswith("/v1/chat/completions/control"):
            try:
                self.controls.append(f"{resp.status} {resp.text()}")
            except Exception as exc:  # noqa: BLE001 - the page may be gone; say so in the record
                self.controls.append(f"{resp.status} (body unread: {exc})")

    def _console(self, msg) -> None:
        if msg.type != "error":
            return
        url = (msg.location or {}).get("url", "")
        if url.endswith("/tools") and "403" in msg.text:
            return  # /tools answers 403 feature_disabled by design
        self.errors.append(f"console error: {msg.text} ({url})")

    def shot(self, name: str) -> Path:
        self.n += 1
        path = self.shots / f"{self.n:02d}-{name}.png"
        self.page.screenshot(path=str(path))
        print("screenshot", path)
        return path

    def ask(self, text: str) -> None:
        self.page.goto(self.base + "/", wait_until="networkidle")
        self.shot("start")
        self.page.locator("textarea").fill(text)
        self.page.keyboard.press("Enter")

    def stop_button(self):
        return self.page.get_by_role("button", name="Stop", exact=True)

    def assistant_text(self) -> str:
        return self.page.locator(".chat-message-assistant").last.inner_text()

    def close(self) -> None:
        self.context.close()


def test_webui_answers_with_progress_reasoning_and_statistics(browser, launch, tmp_path):
    pytest.importorskip("ninfer_tiny", reason="the answer 85 is ninfer-tiny's (plugins/tiny)")
    webui = _webui()
    server = launch(None, "--webui-dir", str(webui), "--prefill-chunk", "16", log_dir=tmp_path, timeout=600)
    page = Page(browser, server.base_url, tmp_path)
    try:
        page.ask(QUESTION)
        page.stop_button().wait_for(state="visible", timeout=120_000)
        page.shot("generating")
        page.stop_button().wait_for(state="hidden", timeout=600_000)
        page.shot("answered")
        text = page.assistant_text()
        assert "85" in text, text
        assert "Reasoning" in text  # the reasoning block, collapsed once the answer came
        assert "t/s" in text and "tokens" in text, text  # the message statistics
        page.page.locator(".chat-message-assistant").last.get_by_text("Reasoning").first.click()
        page.shot("reasoning-open")
        assert "8 + 7" in page.assistant_text()  # ninfer-tiny's worked addition
        progress = page.page.evaluate("window.__progress")
        assert progress and all(p.startswith("Processing") for p in progress), progress
        assert not page.errors, page.errors
    finally:
        page.close()
        server.stop()


def test_webui_skip_reasoning_and_stop(browser, launch, tiny_artifact, tmp_path):
    webui = _webui()
    server = launch(tiny_artifact, "--webui-dir", str(webui), log_dir=tmp_path, timeout=600)
    page = Page(browser, server.base_url, tmp_path)
    try:
        page.ask("Count to three.")
        skip = page.page.get_by_role("button", name="Skip reasoning")
        skip.wait_for(state="visible", timeout=120_000)
        page.page.get_by_text("Reasoning").first.wait_for(timeout=120_000)
        page.shot("reasoning")
        needle = BUDGET_MESSAGE.strip()[:40]
        page.page.evaluate("n => window.__needles.push(n)", needle)
        # wait for the control endpoint's answer itself: the page's response event can be delivered
        # after the stream already shows the budget message (seen once under a parallel suite)
        with page.page.expect_response(lambda r: r.url.endswith("/v1/chat/completions/control"),
                                       timeout=120_000) as answered:
            skip.click()
        control = answered.value
        assert control.status == 200 and '"success":true' in control.text().replace(" ", ""), (
            control.status, control.text(), page.controls)
        # The server closes the thinking with the budget's close; the answer streams after it.
        deadline = time.monotonic() + 120
        while not page.page.evaluate("n => !!window.__found[n]", needle):
            assert time.monotonic() < deadline, (page.controls, page.page.inner_text("body")[-2000:])
            time.sleep(0.2)
        page.shot("reasoning-skipped")
        assert page.stop_button().is_visible()  # still generating: the answer goes on
        page.stop_button().click()
        page.stop_button().wait_for(state="hidden", timeout=60_000)
        page.shot("stopped")
        deadline = time.monotonic() + 60
        while True:
            r = httpx.get(server.base_url + "/v1/load", timeout=10).json()["requests"]
            if r["running"] == 0 and r["admitted"] == 0 and r["waiting"] == 0:
                break
            assert time.monotonic() < deadline, r
            time.sleep(0.1)
        counters = httpx.get(server.base_url + "/metrics", timeout=10).text
        assert "cancel" in counters
        assert "cancelled" in server.log()
        assert not page.errors, page.errors
    finally:
        page.close()
        server.stop()
