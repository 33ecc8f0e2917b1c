"""Run one fuzz case: build the mutated model, run ``mixprec convert`` on it, observe.

A case is ``(mutations, seed)``: the seed picks the seed model, its opset, the dtype and
``-q``, and drives every mutation, so the same pair always gives the same bytes.

Each case runs in a forked child (the parent never loads an ONNX Runtime session, so
forking is safe): the child points file descriptors 1 and 2 at capture files (so text
ONNX Runtime writes from C++ is seen too), calls ``mixprec.cli.main.main`` in-process (or,
in ``subprocess`` mode, ``python -m mixprec``), then checks what was written:
``onnx.checker.check_model(full_check=True)``, and whether ONNX Runtime runs the output
when it ran the input. The parent kills a child that runs past the timeout (a hang) and
notices one that dies of a signal (a crash), then compares the input files' sha256 and
lists what was left in the folder. :func:`.classify.classify` turns the
:class:`Observation` into an outcome.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import resource
import select
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from . import mutators, seeds

__all__ = ["Case", "Materialized", "Observation", "materialize", "observe"]

DTYPES = ("fp16", "bf16", None)  # None: no --dtype (the default, fp16)
OUT_FILE = "out.onnx"
MEMORY_LIMIT = 4 << 30  # address space of a case (bytes)
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Case:
    """A fuzz case: one or more mutations applied in order, all driven by ``seed``."""

    mutations: tuple[str, ...]
    seed: int

    @property
    def name(self) -> str:
        return "+".join(self.mutations)

    def __str__(self) -> str:
        return f"{self.name}/{self.seed}"

    def repro(self) -> str:
        """A shell command that runs this case again and keeps its files."""
        return (
            f".venv/bin/python -m tests.fuzz --mutation {self.name} --seed {self.seed} "
            f"--keep /tmp/mixprec-fuzz"
        )


@dataclasses.dataclass
class Materialized:
    """A case's files and the command line options it runs with."""

    case: Case
    seed_model: str
    opset: int
    dtype: str | None
    quiet: bool
    files: dict[str, bytes]
    applied: list[str]  # mutations that applied (the others found nothing to change)

    def argv(self, folder: Path) -> list[str]:
        args = ["convert", str(folder / seeds.MODEL_FILE), "-o", str(folder / OUT_FILE)]
        if self.dtype is not None:
            args += ["--dtype", self.dtype]
        if self.quiet:
            args.append("-q")
        return args

    def describe(self) -> str:
        return (
            f"seed model {self.seed_model} opset {self.opset}, dtype {self.dtype or 'default'}"
            f"{', -q' if self.quiet else ''}, applied: {', '.join(self.applied) or 'nothing'}"
        )


def materialize(case: Case) -> Materialized:
    """The files of ``case`` (deterministic in ``case``)."""
    rng = random.Random(f"{case.name}/{case.seed}")
    muts = [mutators.by_name(n) for n in case.mutations]
    allowed = set(seeds.NAMES)
    for mut in muts:
        allowed &= set(mut.seeds)
    seed_model = rng.choice(sorted(allowed) or sorted(muts[0].seeds))
    opset = rng.choice(seeds.OPSETS)
    dtype = rng.choice(DTYPES)
    quiet = rng.random() < 0.5
    model = seeds.build(seed_model, opset, seed=case.seed)
    applied = []
    for mut in [m for m in muts if m.structured]:
        assert mut.model is not None
        try:
            mut.model(rng, model)
            applied.append(mut.name)
        except mutators.NotApplicable:
            pass
    files = mutators.apply_bytes(model)
    for mut in [m for m in muts if not m.structured]:
        assert mut.data is not None
        mut.data(rng, files)
        applied.append(mut.name)
    return Materialized(case, seed_model, opset, dtype, quiet, files, applied)


@dataclasses.dataclass
class Observation:
    """What one run did: exit status, output, and the state of the folder afterwards."""

    rc: int | None = None
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    signal: str | None = None  # the signal that killed the child
    phase: str = "start"  # the last phase the child reached
    checker_error: str | None = None
    input_ran: bool | None = None  # did ONNX Runtime run the input? None: not tried
    input_refused: str | None = None  # why ONNX Runtime would not load the input
    output_error: str | None = None  # why ONNX Runtime could not run the output
    signature_error: str | None = None  # input/output names of the graph changed
    harness_error: str | None = None  # a fault of the fuzz harness itself
    inputs_changed: list[str] = dataclasses.field(default_factory=list)
    out_exists: bool = False
    leftovers: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def observe(
    mat: Materialized,
    workdir: Path,
    *,
    timeout: float = 60.0,
    subprocess_mode: bool = False,
    keep: bool = False,
) -> Observation:
    """Run ``mat`` in a fresh folder under ``workdir`` and observe what happened."""
    folder = Path(tempfile.mkdtemp(prefix="case-", dir=workdir))
    capture = Path(tempfile.mkdtemp(prefix="capture-", dir=workdir))
    seeds.write_files(mat.files, folder)
    before = {name: _sha256(data) for name, data in mat.files.items()}
    argv = mat.argv(folder)
    start = time.monotonic()
    obs = _run_child(argv, folder, capture, timeout, subprocess_mode, mat.dtype)
    obs.seconds = time.monotonic() - start
    obs.stdout = _read(capture / "stdout")
    obs.stderr = _read(capture / "stderr")
    present = {p.name for p in folder.iterdir()}
    obs.out_exists = OUT_FILE in present
    for name, digest in before.items():
        path = folder / name
        if not path.is_file() or _sha256(path.read_bytes()) != digest:
            obs.inputs_changed.append(name)
    expected = set(before) | ({OUT_FILE} if obs.rc == 0 else set())
    obs.leftovers = sorted(present - expected)
    if not keep:
        _rmtree(folder)
    _rmtree(capture)
    return obs


def _read(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8", "replace")
    except OSError:
        return ""


def _rmtree(folder: Path) -> None:
    for path in sorted(folder.rglob("*"), reverse=True):
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        else:
            path.unlink()
    folder.rmdir()


def _run_child(
    argv: list[str],
    folder: Path,
    capture: Path,
    timeout: float,
    subprocess_mode: bool,
    dtype: str | None,
) -> Observation:
    obs = Observation()
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read_fd)
        code = 0
        try:
            _child(argv, folder, capture, write_fd, timeout, subprocess_mode, dtype)
        except BaseException:
            code = 70
        finally:
            os._exit(code)
    os.close(write_fd)
    deadline = time.monotonic() + timeout
    buffer = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            obs.timed_out = True
            os.kill(pid, signal.SIGKILL)
            break
        ready, _, _ = select.select([read_fd], [], [], left)
        if ready:
            chunk = os.read(read_fd, 65536)
            if not chunk:
                break
            buffer += chunk
    os.close(read_fd)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status) and not obs.timed_out:
        obs.signal = signal.Signals(os.WTERMSIG(status)).name
    for line in buffer.decode("utf-8", "replace").splitlines():
        kind, _, value = line.partition(" ")
        if kind == "phase":
            obs.phase = value
        elif kind == "result":
            for key, item in json.loads(value).items():
                setattr(obs, key, item)
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 70 and obs.harness_error is None:
        obs.harness_error = "the child failed before reporting"
    return obs


def _child(
    argv: list[str],
    folder: Path,
    capture: Path,
    wfd: int,
    timeout: float,
    subprocess_mode: bool,
    dtype: str | None,
) -> None:  # pragma: no cover - runs in the forked child
    def send(kind: str, value: str) -> None:
        os.write(wfd, f"{kind} {value}\n".encode())

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    for var in [v for v in os.environ if v.startswith("MIXPREC_")]:
        del os.environ[var]
    result: dict[str, object] = {}
    out_fd = os.open(capture / "stdout", os.O_WRONLY | os.O_CREAT, 0o644)
    err_fd = os.open(capture / "stderr", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        send("phase", "convert")
        if subprocess_mode:
            proc = subprocess.run(
                [sys.executable, "-m", "mixprec", *argv],
                stdout=out_fd,
                stderr=err_fd,
                env={**os.environ, "PYTHONPATH": str(REPO_ROOT / "src")},
                timeout=timeout,
                check=False,
            )
            rc = proc.returncode
        else:
            rc = _main_with_fds(argv, out_fd, err_fd)
        result["rc"] = rc
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)  # what the checks' ONNX Runtime prints is not mixprec's output
        os.dup2(devnull, 2)
        if rc == 0:
            send("phase", "checker")
            result.update(_check_output(folder, dtype, send))
    except BaseException as exc:
        result["harness_error"] = "".join(traceback.format_exception_only(exc)).strip()
    send("result", json.dumps(result))


def _main_with_fds(argv: list[str], out_fd: int, err_fd: int) -> int:  # pragma: no cover
    """``mixprec.cli.main.main(argv)`` with stdout/stderr (Python's and the C level's) in files."""
    from mixprec.cli.main import main

    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - lives until the child exits
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
    try:
        return main(argv)
    except SystemExit as exc:  # argparse
        return exc.code if isinstance(exc.code, int) else 2
    except BaseException:  # escaped main: what the interpreter would print and return
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _check_output(folder: Path, dtype: str | None, send) -> dict[str, object]:  # pragma: no cover
    import onnx

    found: dict[str, object] = {}
    out = folder / OUT_FILE
    model = folder / seeds.MODEL_FILE
    try:
        onnx.checker.check_model(str(out), full_check=True)
    except Exception as exc:
        found["checker_error"] = _first_line(exc)
    try:
        a = onnx.load(str(model), load_external_data=False).graph
        b = onnx.load(str(out), load_external_data=False).graph
        names_in = ([i.name for i in a.input], [o.name for o in a.output])
        names_out = ([i.name for i in b.input], [o.name for o in b.output])
        if names_in != names_out:
            found["signature_error"] = f"inputs/outputs {names_in} became {names_out}"
    except Exception as exc:
        found["signature_error"] = f"cannot compare signatures: {_first_line(exc)}"
    send("phase", "ort-input")
    found["input_refused"] = _load_error(model)
    feeds = _run_ort(model, None)
    found["input_ran"] = feeds is not None
    if feeds is not None:
        send("phase", "ort-output")
        try:
            _run_ort(out, feeds, strict=True)
        except Exception as exc:
            text = _first_line(exc)
            no_kernel = "NOT_IMPLEMENTED" in text or "Could not find an implementation" in text
            if not (dtype == "bf16" and no_kernel):  # ORT's CPU provider lacks bf16 kernels
                found["output_error"] = text
    return found


def _run_ort(path: Path, feeds: dict | None, *, strict: bool = False) -> dict | None:
    """Run ``path`` in ONNX Runtime on ``feeds`` (generated when None); returns the feeds.

    Returns None when the model does not run and ``strict`` is false.
    """
    import numpy as np
    import onnxruntime as ort

    try:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.intra_op_num_threads = 1
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        if feeds is None:
            feeds = {}
            for arg in session.get_inputs():
                shape = [d if isinstance(d, int) and d > 0 else 1 for d in arg.shape or []]
                if int(np.prod(shape)) > 10**7:
                    return None
                kind = arg.type[len("tensor(") : -1] if arg.type.startswith("tensor(") else ""
                dtypes = {
                    "float": np.float32,
                    "int64": np.int64,
                    "int32": np.int32,
                    "double": np.float64,
                    "bool": np.bool_,
                    "float16": np.float16,
                }
                if kind not in dtypes:
                    return None
                rng = np.random.default_rng(0)
                feeds[arg.name] = (
                    rng.random(shape).astype(dtypes[kind])
                    if kind in ("float", "double", "float16")
                    else np.zeros(shape, dtypes[kind])
                )
        session.run(None, feeds)
        return feeds
    except Exception:
        if strict:
            raise
        return None


def _load_error(path: Path) -> str | None:
    """Why ONNX Runtime will not load ``path`` (its first line), None when it loads."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:
        return _first_line(exc)
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first}"[:400]


def command_line(mat: Materialized, folder: Path) -> str:
    """The ``mixprec`` command of ``mat`` for files kept in ``folder``."""
    return shlex.join([".venv/bin/mixprec", *mat.argv(folder)])
