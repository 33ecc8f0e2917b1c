"""How each output is read is shown where a user looks (issue 43): ``inspect``, the lines
before quantize's last line, the report page's accuracy-guard table, and the optimize
page."""

from __future__ import annotations

import html
from pathlib import Path

import numpy as np
import onnx

import mixprec
from guard_models import separable_classifier, separable_samples
from mixprec.cli.main import main
from mixprec.report.optimize_page import candidates_html

READ = "read 'probs': "
WHY = "class scores: Softmax 'softmax' (class axis -1, 4 classes)"


def _files(tmp_path: Path) -> tuple[Path, Path]:
    model, calib = tmp_path / "m.onnx", tmp_path / "calib.npz"
    onnx.save(separable_classifier(), model)
    np.savez(calib, x=np.stack([s["x"] for s in separable_samples(12, rows=16)]))
    return model, calib


def test_inspect_says_how_each_output_is_read(tmp_path: Path, capsys) -> None:
    model, _ = _files(tmp_path)
    assert main(["inspect", str(model)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"{READ}top1: {WHY}" in lines


def test_quantize_shows_the_readings_before_its_last_line_and_on_its_page(
    tmp_path: Path, capsys
) -> None:
    model, calib = _files(tmp_path)
    page = tmp_path / "q.html"
    argv = ["quantize", str(model), "-o", str(tmp_path / "q.onnx"), "--speed", "off"]
    assert main([*argv, "--calibration-data", str(calib), "--report", str(page)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("mixprec: ") and lines[-2] == f"{READ}{WHY}"
    text = page.read_text()
    assert "Accuracy guard: <span" in text and html.escape(WHY) in text


def test_the_optimize_page_lists_the_readings(tmp_path: Path) -> None:
    model, _ = _files(tmp_path)
    result = mixprec.optimize(str(model), separable_samples(12, rows=16), candidates=["fp32-ort"])
    section = candidates_html(result)
    assert "How each output was read" in section and html.escape(f"{READ}{WHY}") in section
