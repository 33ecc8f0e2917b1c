"""Error classes, their one-line descriptions, the CLI's one-line log formatter and the
``error.txt`` writer."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

import mixprec
from mixprec.cli.terminal import OneLineFormatter
from mixprec.core.errors import describe
from mixprec.report.logdir import ERROR_FILE, write_error_file


def test_mixprec_error_is_a_value_error_with_a_stage() -> None:
    err = mixprec.MixprecError("bad dtype 'fp8'")
    assert isinstance(err, ValueError)
    assert err.stage is None and str(err) == "bad dtype 'fp8'"
    err = mixprec.MixprecError("bad", stage="prepare/NameFixPass")
    assert err.stage == "prepare/NameFixPass" and str(err) == "bad"
    with pytest.raises(ValueError, match="bad"):
        raise err


def test_internal_error_is_not_a_user_error() -> None:
    err = mixprec.InternalError("checker failed", stage="check")
    assert isinstance(err, RuntimeError)
    assert not isinstance(err, ValueError | mixprec.MixprecError)
    assert err.stage == "check"
    assert "InternalError" in mixprec.__all__


@pytest.mark.parametrize(
    ("exc", "expect"),
    [
        (mixprec.MixprecError("x: no such file"), "x: no such file"),
        (mixprec.MixprecError("a\nb", stage="check"), "in stage 'check': a"),
        (mixprec.InternalError("fails onnx.checker", stage="check"), "in stage 'check': fails"),
        (mixprec.InternalError("no stage"), "no stage"),
        (KeyError("w"), "KeyError: 'w'"),
        (RuntimeError(""), "RuntimeError"),
        (TypeError("  first\nsecond"), "TypeError: first"),
    ],
)
def test_describe_is_one_line(exc: Exception, expect: str) -> None:
    text = describe(exc)
    assert text.startswith(expect), text
    assert "\n" not in text


def _record(
    msg: str,
    args: tuple[object, ...] | None = None,
    *,
    name: str = "onnx_ir.passes",
    level: int = logging.WARNING,
    exc: BaseException | None = None,
) -> logging.LogRecord:
    exc_info = None
    if exc is not None:
        try:
            raise exc
        except BaseException:
            exc_info = sys.exc_info()
    return logging.LogRecord(name, level, __file__, 1, msg, args, exc_info, sinfo="Stack (x)")


@pytest.mark.parametrize(
    ("record", "expect"),
    [
        # onnx_ir's ShapeInferencePass: exc_info and a %s it never fills in
        (
            _record(
                "Shape inference failed: %s. Model is left unchanged",
                exc=ValueError("[ShapeInferenceError] dims differ\n(op_type:Relu)"),
            ),
            "mixprec: warning: onnx_ir: Shape inference failed: ValueError: "
            "[ShapeInferenceError] dims differ. Model is left unchanged",
        ),
        # more placeholders than arguments, and the reverse: shown as written
        (_record("bad %s %s", ("one",)), "mixprec: warning: onnx_ir: bad %s %s ('one',)"),
        (_record("no placeholder", ("extra",)), "mixprec: warning: onnx_ir: no placeholder"),
        (_record("%d items", ("many",)), "mixprec: warning: onnx_ir: %d items ('many',)"),
        # multi-line message with an exception already named in it
        (
            _record("failed: %s\ndetails", (KeyError("k"),), exc=KeyError("k")),
            "mixprec: warning: onnx_ir: failed: 'k' (KeyError: 'k')",
        ),
        (
            _record("range %d", (3,), name="mixprec._runtime", level=logging.ERROR),
            "mixprec: error: range 3",
        ),
        (_record("x.py:1: UserWarning: w\n  src", name="py.warnings"), "mixprec: warning: x.py:1"),
    ],
)
def test_one_line_formatter(record: logging.LogRecord, expect: str) -> None:
    line = OneLineFormatter().format(record)
    assert line.startswith(expect), line
    assert "\n" not in line and "Traceback" not in line and "Stack" not in line


def test_one_line_formatter_leaves_the_record_for_other_handlers() -> None:
    record = _record("failed: %s", exc=ValueError("v"))
    OneLineFormatter().format(record)
    full = logging.Formatter().format(record)
    assert "Traceback (most recent call last)" in full and "Stack (x)" in full


def test_write_error_file(tmp_path: Path) -> None:
    try:
        raise mixprec.InternalError("checker failed", stage="check")
    except mixprec.InternalError as exc:
        path = write_error_file(tmp_path / "new", ["convert", "a b.onnx", "-o", "o.onnx"], exc)
    assert path == tmp_path / "new" / ERROR_FILE
    text = path.read_text()
    assert "command: mixprec convert 'a b.onnx' -o o.onnx" in text
    assert "stage: check" in text
    assert "Traceback (most recent call last)" in text
    assert "mixprec.core.errors.InternalError: checker failed" in text


def test_write_error_file_never_raises(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert write_error_file(blocker / "logs", ["convert"], RuntimeError("x")) is None
