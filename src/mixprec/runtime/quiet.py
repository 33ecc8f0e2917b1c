"""ONNX Runtime imported without its own log lines on the user's terminal.

ORT writes some warnings straight to file descriptor 2 while it is imported, before any
Python setting can reach it: a user whose home folder is not writable saw "Failed to
persist telemetry device ID" above mixprec's one-line error. The import runs with fd 2
pointed at /dev/null (Python's exceptions are unaffected), and ORT's default logger is then
set to :func:`~mixprec.core.config.ort_log_severity` (``MIXPREC_LOG_LEVEL=warning`` shows
its warnings again, import-time ones included). Importing this module does it; the
package imports it before anything else.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

from mixprec.core.config import ort_log_severity

__all__ = ["stderr_silenced"]


@contextlib.contextmanager
def stderr_silenced() -> Iterator[None]:
    """File descriptor 2 points at /dev/null inside the block (C++ writes included)."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


if "onnxruntime" not in sys.modules and ort_log_severity() >= 3:
    with stderr_silenced():  # ORT's import-time lines go to /dev/null
        import onnxruntime as ort
import onnxruntime as ort  # noqa: E402  (imported above, quietly, or here as asked)

ort.set_default_logger_severity(ort_log_severity())
