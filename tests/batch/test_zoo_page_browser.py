"""The zoo page (``index.html``) of a real batch in a real headless Chromium: offline, one
table row and one chart dot per validated model, sortable, links to each model's page."""

from __future__ import annotations

import pytest
from batch_zoo import make_zoo

import mixprec

#: slow: a batch of worker processes, then a browser
pytestmark = pytest.mark.slow


def _column(page, index: int) -> list[str]:
    return page.eval_on_selector_all(
        "tbody tr", f"rows => rows.map(r => r.cells[{index}].textContent)"
    )


def test_zoo_page_is_offline_sortable_and_links_each_model(tmp_path, browser):
    zoo = make_zoo(tmp_path)
    out = tmp_path / "out"
    result = mixprec.batch(zoo, out, validate=True, workers=2)
    assert result.page is not None
    requests: list[str] = []
    page = browser.new_page()
    page.on("request", lambda r: requests.append(r.url))
    page.goto(result.page.as_uri())
    assert page.locator("tbody tr").count() == 4
    assert page.locator("svg circle").count() == 3  # the 3 validated models
    headers = page.eval_on_selector_all("th", "hs => hs.map(h => h.textContent)")
    seconds = headers.index("seconds")
    page.locator("th", has_text="seconds").click()
    up = [float(x) for x in _column(page, seconds)]
    page.locator("th", has_text="seconds").click()
    down = [float(x) for x in _column(page, seconds)]
    assert up == sorted(up) and down == sorted(up, reverse=True)
    page.locator("a", has_text="vision/conv.onnx").click()
    page.wait_for_load_state()
    assert page.url.endswith("vision/conv.fp16.html")
    page.close()
    assert all(url.startswith("file://") for url in requests), requests
