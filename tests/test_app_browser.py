"""The demo end to end in a real headless browser: Debian's chromium (installed by `make browser`, which `make test`
runs first), driven by Playwright. A missing browser fails the test; KIMI_VL_SKIP_BROWSER_TEST=1 skips it instead, for a
developer machine without one."""

import os
import re
from pathlib import Path

import pytest
from demo_server import REPO_ROOT, running_demo
from PIL import Image
from playwright.sync_api import expect, sync_playwright

CHROMIUM = Path(os.environ.get("KIMI_VL_CHROMIUM", "/usr/bin/chromium"))
OUTPUT_DIR = REPO_ROOT / "test-output"

pytestmark = pytest.mark.skipif(
    bool(os.environ.get("KIMI_VL_SKIP_BROWSER_TEST")), reason="KIMI_VL_SKIP_BROWSER_TEST is set"
)


def test_chat_in_a_headless_browser(tmp_path):
    if not CHROMIUM.is_file():
        pytest.fail(f"{CHROMIUM} not found: run `make browser` (installs chromium) or set KIMI_VL_SKIP_BROWSER_TEST=1")
    image_path = tmp_path / "sunset.png"
    Image.radial_gradient("L").convert("RGB").resize((168, 112)).save(image_path)
    OUTPUT_DIR.mkdir(exist_ok=True)

    with running_demo(tmp_path) as url, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 1000})
            page.goto(url)
            expect(page.locator("#model-banner")).to_contain_text("its answers are random", timeout=60_000)

            page.locator("#message input[type=file]").set_input_files(str(image_path))
            # The upload shows a thumbnail in the box once it is on the server; sending before that drops the image.
            expect(page.locator("#message img")).to_be_visible(timeout=30_000)
            page.locator("#message textarea").fill("What is in this picture?")
            page.locator("#message textarea").press("Enter")

            chat = page.locator("#chat")
            expect(chat).to_contain_text("What is in this picture?", timeout=30_000)
            expect(chat.locator("img")).to_have_count(1)  # the uploaded image, shown in the user's turn
            # The stats block closes the answer: it appears once the last token has streamed.
            expect(chat).to_contain_text("tokens/s; image 8×12 → 24 tokens", timeout=120_000)
            # The box unlocks after the answer; a follow-up question (text only) gets a second answer.
            expect(page.locator("#message textarea")).to_be_editable(timeout=30_000)
            page.locator("#message textarea").fill("Tell me more.")
            page.locator("#message textarea").press("Enter")
            expect(chat.get_by_text("Stats:")).to_have_count(2, timeout=120_000)
            # The answers themselves: bot messages that are not a collapsible block (Thinking, Stats).
            answer_texts = chat.locator(".bot .message:not(.thought) .message-content").all_inner_texts()
            bot_text = "\n".join(chat.locator(".bot").all_inner_texts())
            page.screenshot(path=str(OUTPUT_DIR / "demo_browser.png"), full_page=True)
        finally:
            browser.close()

    assert len(answer_texts) == 2, bot_text
    for answer_text in answer_texts:
        # The tiny model decodes greedily by default, so its (random) answers are the same on every run. An empty
        # answer shows as "…", followed by a note such as "(cut at the max new tokens setting)" when it ended early.
        words = re.sub(r"\s*\((stopped|failed|cut at the max new tokens setting)\)$", "", answer_text).strip(" …\n")
        assert words, f"an answer has no text: {answer_text!r}"
    assert "⚠" not in bot_text, bot_text
