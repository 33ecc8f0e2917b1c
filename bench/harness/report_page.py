"""How fast the report page opens and answers in headless Chromium (the system
``/usr/bin/chromium``, driven by Playwright): from navigation to the first drawn frame,
a search, and the FP32 filter, for the pages of the models given (and of the 2,000-node
model from ``examples/make_wide_model.py``). Timings belong here, not in the tests.

Usage: python -m bench.harness.report_page [MODEL.onnx ...]   (prints one line per page)
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from playwright.sync_api import sync_playwright

from bench.harness.common import cpu_summary

ROOT = Path(__file__).resolve().parents[2]
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _page(model: Path, out: Path) -> Path:
    page = out / f"{model.stem}.html"
    command = [sys.executable, "-m", "mixprec", "report", str(model), "-o", str(page), "-q"]
    subprocess.run(command, check=True)
    return page


def _timed(browser, path: Path, search: str) -> str:
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    start = time.perf_counter()
    page.goto(path.as_uri())
    page.wait_for_selector("body[data-ready='1']", timeout=120_000)
    page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
    opened = time.perf_counter() - start
    t = time.perf_counter()
    page.locator("#search").fill(search)
    page.locator("#search-count").inner_text()
    searched = time.perf_counter() - t
    page.locator("#search").fill("")
    t = time.perf_counter()
    page.locator("#fp32-only").check()
    page.locator("g.n.gone").first.wait_for(state="attached")
    filtered = time.perf_counter() - t
    nodes = page.locator("g.n").count()
    page.close()
    size = path.stat().st_size / 1024
    return (
        f"{path.stem}: {nodes} nodes, page {size:.0f} KB, load+render {opened:.2f} s, "
        f"search {searched:.2f} s, filter {filtered:.2f} s"
    )


def main(models: list[str]) -> None:
    print(f"cpu: {cpu_summary()}")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        wide = out / "wide_2000.onnx"
        maker = ROOT / "examples" / "make_wide_model.py"
        subprocess.run([sys.executable, str(maker), str(wide)], check=True)
        pages = [_page(Path(m), out) for m in models] + [_page(wide, out)]
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
            for path in pages:
                print(_timed(browser, path, "Conv"), flush=True)
            browser.close()


if __name__ == "__main__":
    main(sys.argv[1:])
