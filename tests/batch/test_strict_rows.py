"""What a batch writes for users is strict JSON: a model whose validation measured an
infinite (or NaN) error is ``"inf"`` (``"nan"``) in ``results.jsonl`` and in the
``--json`` lines, never ``Infinity``/``NaN``, and the zoo page still reads it back. No
worker process here: the rows are the ones a worker gives for such a model."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from helpers import strict_json
from mixprec.batch.page import write_page
from mixprec.batch.results import RESULTS, BatchResult, append_row, read_rows
from mixprec.cli.main import main


def _rows() -> list[dict[str, Any]]:
    """A model whose output went inf where FP32's is finite, and one within tolerance."""
    return [
        {
            "model": "inf.onnx",
            "status": "failed",
            "low_mac_share": 1.0,
            "seconds": 1.5,
            "validation": {"passed": False, "worst_rel_l2": math.inf, "max_abs": math.nan},
            "error": "validation failed: worst rel L2 inf",
        },
        {
            "model": "ok.onnx",
            "status": "ok",
            "low_mac_share": 0.5,
            "seconds": 1.0,
            "validation": {"passed": True, "worst_rel_l2": 1e-3, "max_abs": 0.01},
        },
    ]


def test_results_jsonl_is_strict_and_the_page_reads_an_inf_error_back(tmp_path: Path) -> None:
    for row in _rows():
        append_row(tmp_path, row)
    lines = [strict_json(line) for line in (tmp_path / RESULTS).read_text().splitlines()]
    assert lines[0]["validation"] == {"passed": False, "worst_rel_l2": "inf", "max_abs": "nan"}
    assert lines[1]["validation"]["worst_rel_l2"] == 1e-3
    assert read_rows(tmp_path) == lines  # what --resume reads back
    page = write_page(tmp_path, read_rows(tmp_path), "zoo").read_text()
    assert '<td data-v="inf">inf</td>' in page  # the rel L2 column, as a float inf showed
    assert page.count("<circle") == 1 and '"nan"' not in page  # the chart: finite errors


def test_batch_json_lines_are_strict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = _rows()

    def batch(sources: list[str], out: str, *, progress: Any, **_: Any) -> BatchResult:
        for done, row in enumerate(rows, 1):
            progress(row, done, len(rows))
        return BatchResult(Path(out), rows=rows)

    monkeypatch.setattr("mixprec.cli.batch.batch", batch)
    assert main(["batch", str(tmp_path), "-o", str(tmp_path / "out"), "--json"]) == 1
    lines = [strict_json(line) for line in capsys.readouterr().out.splitlines()]
    assert [line.get("model") for line in lines] == ["inf.onnx", "ok.onnx", None]
    assert lines[0]["validation"]["worst_rel_l2"] == "inf"
    assert lines[2]["batch"]["counts"]["failed"] == 1
