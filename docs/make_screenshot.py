"""Make ``docs/report_screenshot.png``: the report page of a real corpus model in headless
Chromium, with a group of nodes kept FP32 selected.

Converts PP-OCRv4 rec (from the corpus cache, or ``MIXPREC_CORPUS``) to bf16 with
``--validate --report``, opens the page in the system Chromium (``/usr/bin/chromium``)
through Playwright, clicks the first "kept FP32" group and takes the screenshot.

Usage: python docs/make_screenshot.py [OUT.png]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = "rapidocr-onnxruntime__ch_PP-OCRv4_rec_infer.onnx"
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def corpus_model() -> Path:
    base = os.environ.get("MIXPREC_CORPUS")
    folder = Path(base).expanduser() if base else Path.home() / ".cache" / "mixprec" / "corpus"
    path = folder / "models" / MODEL
    if not path.exists():
        sys.exit(f"{path} not found: run the real-model tests once (make test) to fetch it")
    return path


def main() -> None:
    from playwright.sync_api import sync_playwright

    out = Path(
        sys.argv[1] if len(sys.argv) > 1 else Path(__file__).with_name("report_screenshot.png")
    )
    with tempfile.TemporaryDirectory() as tmp:
        page_path = Path(tmp) / "report.html"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "mixprec",
                "convert",
                str(corpus_model()),
                "-o",
                str(Path(tmp) / "rec_bf16.onnx"),
                "--dtype",
                "bf16",
                "--validate",
                "--report",
                str(page_path),
                "-q",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
            page = browser.new_page(viewport={"width": 1280, "height": 760})
            page.goto(page_path.as_uri())
            page.wait_for_selector("body[data-ready='1']")
            page.locator("button.group").first.click()
            page.screenshot(path=str(out))
            browser.close()
    print(f"wrote {out} ({out.stat().st_size / 1024:.0f} KB)")


if __name__ == "__main__":
    main()
