"""The report page in a real browser: headless Chromium driven by Playwright.

Uses the system Chromium (``/usr/bin/chromium``, Debian package ``chromium``; ``make test``
installs it when missing) and never downloads a browser. Skipped, with the reason shown,
when Playwright or Chromium is missing.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest

from mixprec.api.convert import annotate
from mixprec.report.html import write_report_html

#: slow: headless Chromium
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
#: The 2,000-node model's builder (also timed by bench/harness/report_page.py).
WIDE = ROOT / "examples" / "make_wide_model.py"


def _open(browser: Any, path: Path) -> Any:
    """A new page showing ``path``, once its first frame is drawn (how long that takes is
    measured by ``bench/harness/report_page.py``, not here)."""
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(path.as_uri())
    page.wait_for_selector("body[data-ready='1']", timeout=60_000)
    page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
    return page


def _data(path: Path) -> dict[str, Any]:
    text = path.read_text()
    graphs: dict[str, Any] = json.loads(text.split('id="mp-data">', 1)[1].split("</script>", 1)[0])[
        "graphs"
    ]
    return graphs


def _matches(nodes: list[dict[str, Any]], query: str) -> int:
    """How many nodes the search box should find: name or op type contains ``query``."""
    q = query.lower()
    return sum(
        q in f"{d.get('name', '')} {d.get('op', '')} {d.get('tensor', {}).get('name', '')}".lower()
        for d in nodes
    )


def _png_colours(png: bytes) -> tuple[int, float]:
    """Distinct colours in an 8-bit RGB(A) PNG and the share of pixels that are not white."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, width, height, channels = 8, b"", 0, 0, 0
    while pos < len(png):
        (length,) = struct.unpack(">I", png[pos : pos + 4])
        kind, body = png[pos + 4 : pos + 8], png[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and colour in (2, 6), (depth, colour)
            channels = 3 if colour == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * channels
    prev = bytearray(stride)
    colours: set[bytes] = set()
    white = 0
    for y in range(height):
        kind = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - channels] if i >= channels else 0
            b, c = prev[i], prev[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + a) & 255
            elif kind == 2:
                line[i] = (line[i] + b) & 255
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        for x in range(0, stride, channels * 4):  # every 4th pixel is plenty
            px = bytes(line[x : x + 3])
            colours.add(px)
            white += px == b"\xff\xff\xff"
        prev = line
    sampled = height * len(range(0, stride, channels * 4))
    return len(colours), 1.0 - white / sampled


@pytest.fixture(scope="module")
def demo_page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("browser")
    model = folder / "demo.onnx"
    subprocess.run(
        [sys.executable, str(ROOT / "examples" / "make_demo_model.py"), str(model)], check=True
    )
    page = folder / "demo.html"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mixprec",
            "convert",
            str(model),
            "-o",
            str(folder / "o.onnx"),
            "--exclude",
            "conv2",
            "--report",
            str(page),
            "-q",
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return page


def test_demo_page_renders_and_answers(browser: Any, demo_page: Path) -> None:
    data = _data(demo_page)["g0"]
    page = _open(browser, demo_page)
    drawn = page.locator("#svg-g0 g.n")
    assert drawn.count() == len(data["nodes"]) > 10, (drawn.count(), len(data["nodes"]))
    colours, ink = _png_colours(page.locator("#canvas").screenshot())
    assert colours >= 6 and ink > 0.01, (colours, ink)

    # Click conv2 (kept FP32 by --exclude): the panel shows its class, step and reason.
    index = next(i for i, d in enumerate(data["nodes"]) if d.get("name") == "conv2")
    page.locator(f"#{data['ids'][index]}").click()
    panel = page.locator("#detail").inner_text()
    assert "Conv" in panel and "conv2" in panel, panel
    assert "FP32" in panel and "excluded" in panel, panel
    assert "MACs" in panel, panel

    # Search by op type: every Relu is a hit, the count says so.
    page.locator("#search").fill("relu")
    relus = _matches(data["nodes"], "relu")
    assert relus == sum(d.get("op") == "Relu" for d in data["nodes"]) == 3
    assert page.locator("#search-count").inner_text() == f"{relus} matches"
    assert page.locator("g.n.hit").count() == relus

    # The FP32 filter hides what is neither FP32 nor next to it.
    page.locator("#search").fill("")
    page.locator("#fp32-only").check()
    hidden = page.locator("#svg-g0 g.n.gone").count()
    assert 0 < hidden < len(data["nodes"]), hidden
    page.locator("#fp32-only").uncheck()
    assert page.locator("#svg-g0 g.n.gone").count() == 0

    # A reason group highlights its nodes.
    group = page.locator("button.group").first
    want = len(group.get_attribute("data-nodes").split())
    group.click()
    assert page.locator("g.n.hit").count() == want > 0
    page.close()


def test_subgraph_bodies_open_from_the_detail_panel(browser: Any, tmp_path: Path) -> None:
    from test_report_page import if_model

    result = annotate(if_model(), "fp16", calibrate=False)
    path = tmp_path / "if.html"
    write_report_html(result, path, converted=False)
    page = _open(browser, path)
    page.locator("#svg-g0 g.n", has_text="If").first.click()
    page.locator("#detail button[data-open='g0.2']").click()
    assert page.locator("#svg-g0").is_hidden()
    body = page.locator("#svg-g0\\.2")
    assert body.is_visible()
    assert body.locator("g.n", has_text="Mul").count() == 1
    page.close()


@pytest.mark.slow
def test_largest_corpus_model_opens_and_answers(
    browser: Any, corpus_dir: Path, tmp_path: Path
) -> None:
    """PP-OCRv4 rec (the corpus model with the most nodes): every node drawn, search."""
    model = corpus_dir / "models" / "rapidocr-onnxruntime__ch_PP-OCRv4_rec_infer.onnx"
    path = tmp_path / "rec.html"
    done = subprocess.run(
        [sys.executable, "-m", "mixprec", "report", str(model), "-o", str(path), "-q"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    data = _data(path)["g0"]
    page = _open(browser, path)
    assert page.locator("#svg-g0 g.n").count() == len(data["nodes"]) > 800
    colours, ink = _png_colours(page.locator("#canvas").screenshot())
    assert colours >= 6 and ink > 0.01, (colours, ink)
    convs = _matches(data["nodes"], "Conv")
    assert convs >= sum(d.get("op") == "Conv" for d in data["nodes"]) > 30
    page.locator("#search").fill("Conv")
    assert page.locator("#search-count").inner_text() == f"{convs} matches"
    assert "Conv" in page.locator("#detail h3").inner_text()
    page.close()


def test_two_thousand_nodes_open_and_respond(browser: Any, tmp_path: Path) -> None:
    model = tmp_path / "wide.onnx"
    subprocess.run([sys.executable, str(WIDE), str(model)], check=True)
    path = tmp_path / "wide.html"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mixprec",
            "report",
            str(model),
            "-o",
            str(path),
            "-q",
            "--no-calibrate",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    data = _data(path)["g0"]
    page = _open(browser, path)
    page.locator("#search").fill("relu17")
    assert (
        page.locator("#search-count").inner_text() == f"{_matches(data['nodes'], 'relu17')} matches"
    )
    page.locator("#fp32-only").check()
    page.locator("#svg-g0 g.n.gone").first.wait_for(state="attached")
    assert page.locator("#svg-g0 g.n").count() == len(data["nodes"]) >= 2000
    page.close()
