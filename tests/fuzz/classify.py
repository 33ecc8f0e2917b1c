"""Classify an :class:`~.driver.Observation`: valid success, clean error, or a defect.

* **valid success**: exit 0, the output exists and passes
  ``onnx.checker.check_model(full_check=True)``, keeps the graph's input and output names,
  and runs in ONNX Runtime when the input did (bf16: a missing CPU kernel is accepted),
  while an input ONNX Runtime refuses for its own fault (inference fails) was refused;
  stderr holds only one-line ``mixprec: ...`` messages (or progress lines).
* **clean error**: exit 2, exactly one stderr line, starting ``mixprec: error:``, nothing
  on stdout, no output file.

In both cases the input files are byte-identical afterwards, no temporary file is left in
the folder and no text anywhere holds a traceback. Anything else is a **defect**, named by
a short kind (``internal-error``, ``hang``, ``invalid-output``...), see :data:`KINDS`.
"""

from __future__ import annotations

import dataclasses
import re

from .driver import Observation

__all__ = ["KINDS", "Outcome", "classify"]

SUCCESS = "valid success"
CLEAN_ERROR = "clean error"
DEFECT = "defect"

#: Defect kinds, most serious first: an observation gets the first that applies.
KINDS = {
    "harness": "the fuzz harness itself failed (a bug in tests/fuzz)",
    "hang": "ran past the timeout",
    "crash": "the process died of a signal",
    "input-modified": "an input file changed",
    "internal-error": "exit 3 (mixprec: internal error)",
    "uncaught-exception": "an exception escaped main (exit 1 with a traceback)",
    "bad-exit": "an exit status other than 0, 2 or 3",
    "traceback": "a traceback in stdout or stderr",
    "invalid-output": "exit 0 but the output fails onnx.checker (full_check)",
    "output-fails-in-ort": "the input runs in ONNX Runtime, the output does not",
    "written-though-refused": "exit 0 though ONNX Runtime refuses the input for a fault of "
    "the model's own (shape or type inference fails): say so, exit 2, write nothing",
    "signature-changed": "the graph's input/output names changed",
    "no-output": "exit 0 but no output file",
    "output-on-error": "exit 2 but the output file was written",
    "leftover-files": "files other than the input and output left in the folder",
    "warning-before-error": "exit 2: one-line warnings, then the error line (not one line)",
    "error-not-one-line": "exit 2 without exactly one stderr line 'mixprec: error: ...'",
    "stray-stderr": "a stderr line that is not a one-line 'mixprec: ...' message",
}

_PROGRESS = re.compile(r"^\[\s*\d+\.\d+s\] ")
#: ONNX Runtime's words for a model it refuses for the model's own fault (not for a kernel
#: or an op it lacks, which mixprec may convert without running).
_MODEL_FAULT = re.compile(r"ShapeInferenceError|TypeInferenceError|INVALID_GRAPH")


@dataclasses.dataclass(frozen=True)
class Outcome:
    """The class of an observation and, for a defect, its kind and the line that says why."""

    cls: str
    kind: str | None = None
    detail: str = ""

    @property
    def is_defect(self) -> bool:
        return self.cls == DEFECT

    def __str__(self) -> str:
        if self.kind is None:
            return self.cls
        return f"{self.kind}: {self.detail}" if self.detail else self.kind


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def first_stderr_line(obs: Observation) -> str:
    lines = _lines(obs.stderr)
    return lines[0][:300] if lines else "(no stderr)"


def classify(obs: Observation) -> Outcome:
    """The outcome of ``obs`` (see the module docstring)."""

    def defect(kind: str, detail: str = "") -> Outcome:
        return Outcome(DEFECT, kind, detail or first_stderr_line(obs))

    err = _lines(obs.stderr)
    if obs.harness_error:
        return defect("harness", obs.harness_error)
    if obs.timed_out:
        return defect("hang", f"no result after the timeout, in phase {obs.phase!r}")
    if obs.signal:
        return defect("crash", f"killed by {obs.signal} in phase {obs.phase!r}")
    if obs.inputs_changed:
        return defect("input-modified", ", ".join(obs.inputs_changed))
    if obs.rc == 3:
        internal = [ln for ln in err if ln.startswith("mixprec: internal error")]
        return defect("internal-error", (internal or err or ["(no stderr)"])[-1][:300])
    if obs.rc == 1 and "Traceback" in obs.stderr:
        tail = err[-1] if err else ""
        return defect("uncaught-exception", tail[:300])
    if obs.rc not in (0, 2):
        return defect("bad-exit", f"exit {obs.rc}: {first_stderr_line(obs)}")
    if "Traceback (most recent call last)" in obs.stderr + obs.stdout:
        return defect("traceback")
    if obs.rc == 0:
        if not obs.out_exists:
            return defect("no-output")
        if obs.checker_error:
            return defect("invalid-output", obs.checker_error)
        if obs.output_error:
            return defect("output-fails-in-ort", obs.output_error)
        if obs.input_refused and _MODEL_FAULT.search(obs.input_refused):
            return defect("written-though-refused", obs.input_refused)
        if obs.signature_error:
            return defect("signature-changed", obs.signature_error)
        if obs.leftovers:
            return defect("leftover-files", ", ".join(obs.leftovers))
        stray = [ln for ln in err if not (ln.startswith("mixprec: ") or _PROGRESS.match(ln))]
        if stray:
            return defect("stray-stderr", stray[0][:300])
        return Outcome(SUCCESS)
    if obs.out_exists:
        return defect("output-on-error")
    if obs.leftovers:
        return defect("leftover-files", ", ".join(obs.leftovers))
    if (
        len(err) > 1
        and err[-1].startswith("mixprec: error: ")
        and all(ln.startswith("mixprec: warning: ") for ln in err[:-1])
        and not obs.stdout.strip()
    ):
        detail = f"{err[0][:160]} ... {len(err) - 1} warning(s), then {err[-1][:140]}"
        return defect("warning-before-error", detail)
    if len(err) != 1 or not err[0].startswith("mixprec: error: ") or obs.stdout.strip():
        detail = " | ".join(err)[:300] or "(no stderr)"
        if obs.stdout.strip():
            detail += f" (stdout: {_lines(obs.stdout)[0][:100]})"
        return defect("error-not-one-line", detail)
    return Outcome(CLEAN_ERROR)
