"""The CLI owns the terminal: every log record and Python warning becomes one line.

Library loggers (onnx_ir, onnx, onnxruntime) and ``warnings.warn`` calls are routed to
stderr as ``mixprec: LEVEL: [library: ]message``, never with a traceback unless
``--debug``; with a log folder every record also goes in full to ``DIR/mixprec.log``.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

from mixprec.report.logdir import LOG_FILE

__all__ = ["OneLineFormatter", "Terminal", "terminal_logging"]


def _exception_line(exc: BaseException) -> str:
    text = str(exc).strip()
    first = text.splitlines()[0].strip() if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _record_message(record: logging.LogRecord) -> str:
    """The record's message on one line, whatever its arguments.

    A format whose arguments do not match (``logger.warning("failed: %s")`` with no
    arguments, or too many) is shown as written instead of raising; a placeholder left
    unfilled while the record carries an exception gets that exception's first line.
    """
    try:
        message = record.getMessage()
    except Exception:
        message = f"{record.msg} {record.args!r}"
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    message = lines[0] if lines else ""
    exc = record.exc_info[1] if record.exc_info else None
    if exc is not None:
        summary = _exception_line(exc)
        if not record.args and "%s" in message:
            message = message.replace("%s", summary, 1)
        elif summary not in message:
            message = f"{message} ({summary})"
    return message


class OneLineFormatter(logging.Formatter):
    """``mixprec: LEVEL: [library: ]message``, one line, no traceback or stack, never raises.

    The record is not changed, so other handlers (the ``--log-dir`` file) still get its
    traceback.
    """

    def format(self, record: logging.LogRecord) -> str:
        source = record.name.split(".")[0]
        prefix = "" if source in ("mixprec", "py", "root") else f"{source}: "
        return f"mixprec: {record.levelname.lower()}: {prefix}{_record_message(record)}"


class _FullFormatter(logging.Formatter):
    """Like :class:`OneLineFormatter`'s prefix, then the whole message and any traceback."""

    def format(self, record: logging.LogRecord) -> str:
        try:
            return super().format(record)
        except Exception:
            return f"{record.levelname}:{record.name}: {_record_message(record)}"


def _is_mixprec(record: logging.LogRecord) -> bool:
    return record.name == "mixprec" or record.name.startswith("mixprec.")


class _QuietFileHandler(logging.FileHandler):
    """The log file: a write that fails (a full disk) is dropped, never a traceback."""

    def handleError(self, record: logging.LogRecord) -> None:
        pass


class _HeldLines(logging.Handler):
    """Keeps formatted lines until :meth:`Terminal.release` prints (or drops) them."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(self.format(record))
        except Exception:  # a record that cannot be formatted is not worth a traceback
            self.lines.append(f"mixprec: {record.levelname.lower()}: {record.msg!s:.200}")


class Terminal:
    """What ``main`` tells the terminal: the command failed, so hold the warnings back."""

    def __init__(self, held: _HeldLines | None) -> None:
        self._held = held
        self._failed = False

    def failed(self) -> None:
        self._failed = True

    def release(self) -> None:
        if self._held is None:
            return
        lines, self._held.lines = self._held.lines, []
        if not self._failed:
            for line in lines:
                print(line, file=sys.stderr)
        self._held = None


@contextlib.contextmanager
def terminal_logging(*, quiet: bool, debug: bool, log_dir: str | None) -> Iterator[Terminal]:
    """Route every log record and Python warning to one stderr line each (and the log file).

    Without ``--debug`` the lines are held until the command ends: a command that fails
    (``Terminal.failed()``) prints only its one error line, and the warnings that led to
    it stay in the log file. Restores the logging configuration on exit, so that ``main``
    can run in-process.
    """
    root = logging.getLogger()
    ours = logging.getLogger("mixprec")
    saved = (root.level, ours.level)
    added: list[logging.Handler] = []

    terminal: logging.Handler
    if debug:
        terminal = logging.StreamHandler(sys.stderr)
        terminal.setFormatter(_FullFormatter("mixprec: %(levelname)s: %(name)s: %(message)s"))
        terminal.setLevel(logging.DEBUG)
    else:
        terminal = _HeldLines()
        terminal.setFormatter(OneLineFormatter())
        terminal.setLevel(logging.WARNING)
    if quiet:
        terminal.addFilter(lambda r: r.levelno >= logging.ERROR or _is_mixprec(r))
    added.append(terminal)
    if log_dir is not None:
        try:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            file = _QuietFileHandler(Path(log_dir) / LOG_FILE, mode="w", encoding="utf-8")
        except OSError:
            pass  # the command reports the folder as unusable in its own words
        else:
            file.setFormatter(_FullFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
            file.setLevel(logging.DEBUG)
            added.append(file)
    root.setLevel(logging.INFO if len(added) > 1 else logging.WARNING)
    if debug or len(added) > 1:
        ours.setLevel(logging.DEBUG)
    for handler in added:
        root.addHandler(handler)
    logging.captureWarnings(True)
    control = Terminal(terminal if isinstance(terminal, _HeldLines) else None)
    try:
        yield control
    finally:
        logging.captureWarnings(False)
        control.release()
        for handler in added:
            root.removeHandler(handler)
            handler.close()
        root.setLevel(saved[0])
        ours.setLevel(saved[1])
