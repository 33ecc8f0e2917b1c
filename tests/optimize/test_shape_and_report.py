"""``optimize --shape`` (the serving shape candidates are timed at) and ``--report
PAGE.html`` (the candidate table the last lines print, above the chosen model's graph:
well-formed, written atomically), through the API and the CLI, with real engines."""

from __future__ import annotations

import html
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

import mixprec
from guard_models import separable_samples
from mixprec.cli.main import main
from mixprec.report.optimize_page import write_optimize_html

pytest.importorskip("openvino")

#: Elements without an end tag in HTML.
_VOID = {"meta", "link", "br", "hr", "img", "input", "col", "area", "base", "wbr", "source"}


class _Strict(HTMLParser):
    """Checks that every element is closed in order (well-formed), and collects the
    candidate table's rows (the text of each cell)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.rows: list[list[str]] = []
        self._table = False
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag not in _VOID:
            self.stack.append(tag)
        if tag == "table" and ("class", "candidates") in attrs:
            self._table = True
        if self._table and tag == "tr":
            self.rows.append([])
        if self._table and tag == "td":
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in _VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes <{self.stack[-1] if self.stack else None}>")
            return
        self.stack.pop()
        if tag == "table":
            self._table = False
        if tag == "td" and self._cell is not None:
            self.rows[-1].append("".join(self._cell))
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def _parse(page: str) -> _Strict:
    parser = _Strict()
    parser.feed(page)
    parser.close()
    assert not parser.errors and not parser.stack, (parser.errors, parser.stack)
    return parser


@pytest.fixture
def calib(tmp_path: Path) -> Path:
    path = tmp_path / "calib.npz"
    np.savez(path, x=np.stack([s["x"] for s in separable_samples(12, rows=16)]))
    return path


def test_candidates_are_timed_at_the_serving_shape(model_file: Path) -> None:
    samples = separable_samples(12, rows=16)
    given = mixprec.optimize(
        str(model_file), samples, candidates=["fp32-ort", "fp32-openvino"], shapes={"x": [3, 16]}
    )
    assert "timed beside it at x [3, 16]" in given.notes[0]
    assert given.timed_at is not None and given.timed_at.shapes == {"x": [3, 16]}
    assert given.to_dict()["timed_at"] == {
        "shapes": {"x": [3, 16]},
        "batch": 3,
        "threads": given.timed_at.threads,
    }
    row = {r.name: r for r in given.table}["fp32-openvino"]
    assert row.accurate  # checked on the held-out samples (16 rows), whatever the shape
    default = mixprec.optimize(str(model_file), samples, candidates=["fp32-ort"])
    assert "at x [16, 16]" in default.notes[0]  # the first calibration sample's


@pytest.mark.parametrize(
    ("shape", "error"),
    [
        ("y=1,16", "'y'"),  # not an input
        ("x=4,8", "x"),  # a fixed dim clashes
        ("x=4", "x"),  # wrong rank
    ],
)
def test_cli_a_bad_shape_is_one_line_and_writes_nothing(
    model_file: Path, calib: Path, tmp_path: Path, capsys, shape: str, error: str
) -> None:
    out, page = tmp_path / "out.onnx", tmp_path / "page.html"
    argv = ["optimize", str(model_file), "-o", str(out), "--calibration-data", str(calib)]
    assert main([*argv, "--shape", shape, "--report", str(page)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mixprec: error: ") and error in err[0], err
    assert not out.exists() and not page.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.npz", "m.onnx"]


def test_cli_report_page_shows_the_printed_table(
    model_file: Path, calib: Path, tmp_path: Path, capsys
) -> None:
    out, page = tmp_path / "out.onnx", tmp_path / "page.html"
    argv = ["optimize", str(model_file), "-o", str(out), "--calibration-data", str(calib)]
    argv += ["--candidates", "fp32-ort,fp32-openvino,bf16-openvino", "--shape", "x=4,16"]
    assert main([*argv, "--report", str(page)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[:2] == [f"wrote {out}", f"wrote {page}"]
    table, where = printed[-5:-2], printed[-2]
    assert re.fullmatch(r"ratios timed at x \[4, 16\] \(batch 4\), \d+ thread\(s\)", where), where
    assert html.escape(where) in page.read_text()
    parsed = _parse(page.read_text())
    rows = [r for r in parsed.rows if r]
    assert [r[0] for r in rows] == [line.split()[0] for line in table]
    for cells, line in zip(rows, table, strict=True):
        ratio, verdict = cells[3], cells[7]
        assert line.split()[2] == ratio  # the same latency ratio
        assert line.endswith(verdict)  # the same verdict and reason
    assert "at x [4, 16]" in page.read_text()
    assert html.escape(printed[-1].removeprefix("mixprec: ")) in page.read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left


def test_cli_report_json_names_the_page(model_file: Path, calib: Path, tmp_path, capsys):
    out, page = tmp_path / "out.onnx", tmp_path / "page.html"
    argv = ["optimize", str(model_file), "-o", str(out), "--calibration-data", str(calib)]
    assert main([*argv, "--candidates", "fp32-ort", "--report", str(page), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["report"] == str(page) and page.is_file()
    assert data["timed_at"]["shapes"] == {"x": [16, 16]} and data["timed_at"]["batch"] == 16
    _parse(page.read_text())


@pytest.mark.parametrize("where", ["missing/page.html", "m.onnx", "out.onnx"])
def test_cli_a_bad_report_path_is_refused_before_any_work(
    model_file: Path, calib: Path, tmp_path: Path, capsys, where: str
) -> None:
    out = tmp_path / "out.onnx"
    before = model_file.read_bytes()
    argv = ["optimize", str(model_file), "-o", str(out), "--calibration-data", str(calib)]
    assert main([*argv, "--report", str(tmp_path / where)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mixprec: error: "), err
    assert not out.exists() and model_file.read_bytes() == before


def test_the_page_escapes_what_it_shows(model_file: Path, tmp_path: Path) -> None:
    """A user's candidate named with markup is text on the page, never markup."""
    from mixprec.optimize.candidates import Candidate

    odd = Candidate("<b>odd</b>&", "ort", None, "input", "markup in a name")
    result = mixprec.optimize(str(model_file), separable_samples(6, rows=4), candidates=[odd])
    page = tmp_path / "p.html"
    write_optimize_html(result, page)
    text = page.read_text()
    assert "<b>odd</b>" not in text and "&lt;b&gt;odd&lt;/b&gt;&amp;" in text
    parsed = _parse(text)
    assert [r[0] for r in parsed.rows if r] == ["fp32-ort", "<b>odd</b>&"]
