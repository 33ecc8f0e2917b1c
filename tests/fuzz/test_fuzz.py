"""The fuzz suite under pytest: a deterministic budget of cases, known defects as xfail.

``FUZZ_SEEDS_PER_MUTATION`` (default 4) is the number of seeds per mutation; every case must
be a valid success or a clean error, except the ones listed in ``known_defects.py``,
which must still show their recorded defect (``xfail(strict=True)``). A hypothesis test
applies short sequences of structured mutations (derandomized: the same examples in
every run). Bigger campaigns: ``make fuzz`` (``python -m tests.fuzz``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from . import mutators
from .campaign import plan, run_case
from .classify import CLEAN_ERROR, DEFECT, SUCCESS, classify
from .driver import Case, Observation, materialize
from .known_defects import CAUSES, KNOWN, REGRESSIONS, known_for, matches_known

SEEDS = int(os.environ.get("FUZZ_SEEDS_PER_MUTATION", "4"))
#: A safety net against a hang, not a speed test: every case of the budget takes seconds,
#: and one past this is reported as a hang (a campaign, ``make fuzz``, is stricter: 60 s).
TIMEOUT = 600.0


class KnownDefectSeen(Exception):
    """The case still shows the defect recorded in known_defects.py."""


def _cases() -> list:
    cases = plan(len(mutators.MUTATIONS) * SEEDS, 0)
    extra = [Case(tuple(k.mutation.split("+")), k.seed) for k in KNOWN]
    extra += [Case(tuple(name.split("+")), seed) for name, seed in REGRESSIONS]
    cases += [c for c in extra if c not in cases]
    params = []
    for case in cases:
        known = known_for(case.name, case.seed)
        marks = ()
        if known is not None:
            reason = f"known defect ({known.cause}): {CAUSES[known.cause].text}"
            marks = (pytest.mark.xfail(strict=True, raises=KnownDefectSeen, reason=reason),)
        params.append(pytest.param(case, marks=marks, id=str(case)))
    return params


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@pytest.mark.parametrize("case", _cases())
def test_case(case: Case, workdir: Path) -> None:
    result = run_case(case, workdir, timeout=TIMEOUT)
    if not result.outcome.is_defect:
        return
    if result.known is not None:
        raise KnownDefectSeen(result.report())
    raise AssertionError(f"fuzz defect\n{result.report()}")


def test_a_case_through_python_m_mixprec(workdir: Path) -> None:
    """The subprocess path (``python -m mixprec``) classifies like the in-process one."""
    for case in (Case(("none",), 0), Case(("truncate",), 0)):
        inproc = run_case(case, workdir)
        sub = run_case(case, workdir, subprocess_mode=True)
        assert (sub.outcome.cls, sub.obs.rc) == (inproc.outcome.cls, inproc.obs.rc), sub.report()

        def same(text: str) -> str:
            return re.sub(r"case-\w+", "case-X", text)

        assert same(sub.obs.stderr) == same(inproc.obs.stderr)


STRUCTURED = [m.name for m in mutators.MUTATIONS if m.structured and m.name != "none"]


@settings(
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "12")),
    derandomize=True,
    deadline=None,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    names=st.lists(st.sampled_from(STRUCTURED), min_size=2, max_size=3, unique=True),
    seed=st.integers(0, 10**6),
)
def test_mutation_sequences(names: list[str], seed: int, workdir: Path) -> None:
    """Sequences of structured mutations: a defect must be one of a known cause."""
    result = run_case(Case(tuple(names), seed), workdir, timeout=TIMEOUT)
    if result.outcome.is_defect:
        cause = matches_known(result.outcome.kind, result.outcome.detail)
        assert cause is not None, f"fuzz defect of no known cause\n{result.report()}"


# --------------------------------------------------------------------------- the harness


def test_materialize_is_deterministic() -> None:
    for m in mutators.MUTATIONS:
        case = Case((m.name,), 7)
        assert materialize(case).files == materialize(case).files, m.name


def test_known_defects_name_real_mutations_and_causes() -> None:
    for entry in KNOWN:
        for name in entry.mutation.split("+"):
            mutators.by_name(name)
        assert entry.cause in CAUSES, entry


@pytest.mark.parametrize(
    ("obs", "cls", "kind"),
    [
        (Observation(rc=0, out_exists=True, input_ran=True), SUCCESS, None),
        (Observation(rc=2, stderr="mixprec: error: x.onnx: bad\n"), CLEAN_ERROR, None),
        (
            Observation(rc=2, stderr="mixprec: error: a\nmixprec: error: b\n"),
            DEFECT,
            "error-not-one-line",
        ),
        (
            Observation(rc=2, stderr="mixprec: warning: w\nmixprec: error: e\n"),
            DEFECT,
            "warning-before-error",
        ),
        (
            Observation(rc=2, stderr="mixprec: error: e\n", out_exists=True),
            DEFECT,
            "output-on-error",
        ),
        (
            Observation(rc=2, stderr="mixprec: error: e\n", leftovers=[".o.tmp"]),
            DEFECT,
            "leftover-files",
        ),
        (
            Observation(rc=3, stderr="mixprec: internal error in convert: X\n"),
            DEFECT,
            "internal-error",
        ),
        (
            Observation(rc=1, stderr="Traceback (most recent call last):\nKeyError: 1\n"),
            DEFECT,
            "uncaught-exception",
        ),
        (Observation(rc=0, out_exists=True, checker_error="bad"), DEFECT, "invalid-output"),
        (
            Observation(rc=0, out_exists=True, input_ran=True, output_error="e"),
            DEFECT,
            "output-fails-in-ort",
        ),
        (Observation(rc=0, out_exists=True, stderr="[W:onnxruntime] x\n"), DEFECT, "stray-stderr"),
        (
            Observation(rc=2, stderr="mixprec: error: e\n", inputs_changed=["m"]),
            DEFECT,
            "input-modified",
        ),
        (Observation(timed_out=True), DEFECT, "hang"),
        (Observation(signal="SIGSEGV"), DEFECT, "crash"),
    ],
)
def test_classify(obs: Observation, cls: str, kind: str | None) -> None:
    outcome = classify(obs)
    assert (outcome.cls, outcome.kind) == (cls, kind), outcome
