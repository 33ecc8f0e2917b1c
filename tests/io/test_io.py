"""Saving models (issue 7, cases F1-F4): atomic pairs, unique names, signals, full disks.

A model saved with external data is a *pair* (model file, data file). Whatever happens
during a save (an error at any step, SIGKILL between two renames, a concurrent save to
the same name, SIGINT/SIGTERM, a full disk), the folder holds the old pair or the new
pair, never the old model with new data; temporary files are removed wherever a process
can still remove them. Every pair is checked by running it in ONNX Runtime against the
FP32 model it came from.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import resource
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from test_external import X, assert_differs, conv_model, reference, save_external

import mixprec
import mixprec.io.models
from helpers import assert_close, run_ort, sha256_of
from mixprec.cli.main import main
from mixprec.io.models import save_model


@dataclass(frozen=True)
class Converted:
    """An FP32 model, its fp16 conversion, and the FP32 reference output."""

    fp32: onnx.ModelProto
    model: ir.Model
    ref: np.ndarray


@pytest.fixture(scope="module")
def pair() -> tuple[Converted, Converted]:
    """Two models with the same layout and different weights (A: seed 0, B: seed 1)."""
    out = []
    for seed in (0, 1):
        fp32 = conv_model(seed)
        model = mixprec.convert(fp32, "fp16", calibrate=False).model
        out.append(Converted(fp32, model, reference(fp32)))
    assert_differs(out[0].ref, out[1].ref, "fp16")
    return out[0], out[1]


def output(path: Path) -> np.ndarray:
    onnx.checker.check_model(str(path), full_check=True)
    return run_ort(path, {"x": X})["y"]


def data_refs(path: Path) -> set[str]:
    proto = onnx.load(path, load_external_data=False)
    return {
        e.value
        for t in proto.graph.initializer
        if t.data_location == onnx.TensorProto.EXTERNAL
        for e in t.external_data
        if e.key == "location"
    }


def files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def snapshot(folder: Path) -> dict[str, str]:
    return {p.name: sha256_of(p) for p in sorted(folder.iterdir()) if p.is_file()}


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# --------------------------------------------------------------------------- names


def test_external_data_goes_to_out_data_when_that_name_is_free(tmp_path: Path, pair) -> None:
    a, _ = pair
    out = tmp_path / "out.onnx"
    save_model(a.model, out, external_data=True)
    assert files(tmp_path) == ["out.onnx", "out.onnx.data"]
    assert data_refs(out) == {"out.onnx.data"}
    assert_close(a.ref, output(out), "fp16")
    for name in files(tmp_path):  # mkstemp's 0600 is not kept: the umask applies
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~_umask()


def test_saving_again_uses_a_fresh_data_name_and_removes_the_old(tmp_path: Path, pair) -> None:
    """out.onnx.data is in use by the old model: the new pair gets a unique data name;
    once the new model is in place, the data the old one used is removed."""
    a, b = pair
    out = tmp_path / "out.onnx"
    names = []
    for model, ref in ((a.model, a.ref), (b.model, b.ref), (a.model, a.ref)):
        save_model(model, out, external_data=True)
        (name,) = data_refs(out)
        names.append(name)
        assert files(tmp_path) == sorted(["out.onnx", name])
        assert_close(ref, output(out), "fp16")
    assert names[0] == "out.onnx.data"
    assert re.fullmatch(r"out\.onnx\.[0-9a-f]{8}\.data", names[1])
    assert names[2] == "out.onnx.data"  # free again
    save_model(b.model, out)  # weights inline now: the old data file goes
    assert files(tmp_path) == ["out.onnx"]
    assert_close(b.ref, output(out), "fp16")


def test_data_files_not_named_by_mixprec_are_kept(tmp_path: Path, pair) -> None:
    """A model the user saved as out.onnx + weights.bin: saving over out.onnx leaves
    weights.bin alone (mixprec did not name it; another model may use it)."""
    a, b = pair
    save_external(a.fp32, tmp_path / "out.onnx", "weights.bin")
    weights = sha256_of(tmp_path / "weights.bin")
    save_model(b.model, tmp_path / "out.onnx", external_data=True)
    assert files(tmp_path) == ["out.onnx", "out.onnx.data", "weights.bin"]
    assert sha256_of(tmp_path / "weights.bin") == weights
    assert_close(b.ref, output(tmp_path / "out.onnx"), "fp16")


def test_models_over_the_protobuf_limit_still_go_external(
    tmp_path: Path, pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The >2 GB rule (weights alone near 2 GB: external data) with the limit lowered."""
    a, _ = pair
    monkeypatch.setattr(mixprec.io.models, "INLINE_LIMIT", 1000)
    save_model(a.model, tmp_path / "big.onnx")
    assert files(tmp_path) == ["big.onnx", "big.onnx.data"]
    assert_close(a.ref, output(tmp_path / "big.onnx"), "fp16")


def test_large_initializers_are_streamed_into_one_file(tmp_path: Path) -> None:
    """_write_streaming (initializers over 64 KB appended one at a time) writes a valid
    model with the same answers."""
    rng = np.random.default_rng(5)
    k = rng.standard_normal((3 * 8 * 8, 400)).astype(np.float32)  # 300 KB
    fp32 = onnx.helper.make_model(
        onnx.helper.make_graph(
            [
                onnx.helper.make_node("Flatten", ["x"], ["f"]),
                onnx.helper.make_node("MatMul", ["f", "k"], ["y"]),
            ],
            "big",
            [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3, 8, 8])],
            [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 400])],
            [onnx.numpy_helper.from_array(k, "k")],
        ),
        opset_imports=[onnx.helper.make_opsetid("", 17)],
    )
    fp32.ir_version = 8
    result = mixprec.convert(fp32, "fp16", calibrate=False)
    result.save(tmp_path / "big.onnx")
    assert files(tmp_path) == ["big.onnx"]
    assert_close(run_ort(fp32, {"x": X})["y"], output(tmp_path / "big.onnx"), "fp16")


# --------------------------------------------------------------------------- F1


def _fail_model_rename(target: Path) -> Callable[..., None]:
    real = os.replace

    def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if os.fspath(dst) == str(target):
            raise OSError(28, "No space left on device")
        real(src, dst, *args, **kwargs)

    return replace


def _fail_after_data(monkeypatch: pytest.MonkeyPatch) -> None:
    real = ir.save

    def save(*args: Any, **kwargs: Any) -> None:
        real(*args, **kwargs)  # the data file is complete, the model file too
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mixprec.io.models.ir, "save", save)


def _fail_inside_data(monkeypatch: pytest.MonkeyPatch) -> None:
    def tofile(self: Any, file: Any) -> None:
        file.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ir.Tensor, "tofile", tofile, raising=False)
    monkeypatch.setattr(ir.Tensor, "tobytes", lambda self: tofile(self, io.BytesIO()))


@pytest.mark.parametrize("step", ["writing-data", "after-data", "model-rename"])
@pytest.mark.parametrize("old", ["pair", "none"])
def test_a_failed_save_leaves_the_old_pair(
    tmp_path: Path, pair, monkeypatch: pytest.MonkeyPatch, step: str, old: str
) -> None:
    """F1: an error at any step leaves the old model with its own data (or nothing), and
    no temporary or new data file."""
    a, b = pair
    out = tmp_path / "out.onnx"
    if old == "pair":
        save_model(a.model, out, external_data=True)
    before = snapshot(tmp_path)
    if step == "writing-data":
        _fail_inside_data(monkeypatch)
    elif step == "after-data":
        _fail_after_data(monkeypatch)
    else:
        monkeypatch.setattr(mixprec.io.models.os, "replace", _fail_model_rename(out))
    with pytest.raises(mixprec.MixprecError) as info:
        save_model(b.model, out, external_data=True)
    assert str(info.value) == (
        f"{out}: cannot write the model (No space left on device); nothing written"
    )
    monkeypatch.undo()
    assert snapshot(tmp_path) == before
    if old == "pair":
        assert_close(a.ref, output(out), "fp16")


def test_killed_between_the_data_and_the_model_leaves_a_consistent_pair(
    tmp_path: Path, pair
) -> None:
    """F1: SIGKILL after the new data is complete and before the model is renamed (no
    cleanup can run). The old code had already renamed the new data over the old model's
    data: the old model then read the new weights."""
    a, b = pair
    out = tmp_path / "out.onnx"
    save_model(a.model, out, external_data=True)
    b_path = tmp_path / "b_in.onnx"
    save_external(b.fp32, b_path, "b_in.bin")
    script = textwrap.dedent(
        f"""
        import os, signal, mixprec, mixprec.io.models
        real = os.replace
        def replace(src, dst, *args, **kwargs):
            if os.fspath(dst) == {str(out)!r}:
                os.kill(os.getpid(), signal.SIGKILL)
            real(src, dst, *args, **kwargs)
        mixprec.io.models.os.replace = replace
        result = mixprec.convert({str(b_path)!r}, "fp16", calibrate=False)
        result.save({str(out)!r}, external_data=True)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert data_refs(out) == {"out.onnx.data"}
    assert_close(a.ref, output(out), "fp16")  # the old model, with its own weights
    left = [n for n in files(tmp_path) if n not in ("out.onnx", "out.onnx.data")]
    left = [n for n in left if not n.startswith("b_in.")]
    assert len(left) == 2, left  # what SIGKILL leaves: the new data, the temporary model
    assert any(re.fullmatch(r"out\.onnx\.[0-9a-f]{8}\.data", n) for n in left), left
    assert any(re.fullmatch(r"\.out\.onnx\..+\.tmp", n) for n in left), left


# --------------------------------------------------------------------------- F2


def test_concurrent_saves_to_one_name_do_not_mix(
    tmp_path: Path, pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """F2: A writes its pair and stops just before renaming its model; B saves to the
    same name from start to end; then A renames. Every temporary name was unique, so
    out.onnx is A's model with A's data (the old code shared `.out.onnx.data.tmp` and
    out.onnx.data: A's model read B's weights)."""
    a, b = pair
    out = tmp_path / "out.onnx"
    a_at_rename, b_done = threading.Event(), threading.Event()
    real = os.replace

    def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if threading.current_thread().name == "A" and os.fspath(dst) == str(out):
            a_at_rename.set()
            assert b_done.wait(60)
        real(src, dst, *args, **kwargs)

    monkeypatch.setattr(mixprec.io.models.os, "replace", replace)
    errors: list[BaseException] = []

    def save(model: ir.Model, done: threading.Event | None) -> None:
        try:
            save_model(model, out, external_data=True)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
        finally:
            if done is not None:
                done.set()

    thread_a = threading.Thread(target=save, args=(a.model, None), name="A")
    thread_a.start()
    assert a_at_rename.wait(60)
    thread_b = threading.Thread(target=save, args=(b.model, b_done), name="B")
    thread_b.start()
    thread_b.join(60)
    thread_a.join(60)
    assert not errors, errors
    monkeypatch.undo()
    (name,) = data_refs(out)
    assert_close(a.ref, output(out), "fp16")
    # no temporary file left; B's data is the one file no model uses
    left = [n for n in files(tmp_path) if n not in ("out.onnx", name)]
    assert len(left) == 1 and re.fullmatch(r"out\.onnx(\.[0-9a-f]{8})?\.data", left[0]), left


# --------------------------------------------------------------------------- F3


_SLOW_WRITE = """
import sys, time, pathlib
import mixprec.io.models, mixprec.cli.main
flag = pathlib.Path(sys.argv[1])
real = mixprec.io.models.{name}
def slow(*args, **kwargs):
    real(*args, **kwargs)
    flag.write_text("writing")
    time.sleep(120)
mixprec.io.models.{target} = slow
sys.exit(mixprec.cli.main.main(sys.argv[2:]))
"""


@pytest.mark.parametrize("external", [False, True])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_writing_removes_the_temporary_files(
    tmp_path: Path, pair, external: bool, sig: signal.Signals
) -> None:
    """F3: SIGTERM/SIGINT while the model (and its data) are being written: the
    temporary files go, the old output stays, and the exit status is 143 / 130."""
    a, b = pair
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "o.onnx"
    save_model(a.model, out, external_data=external)
    before = snapshot(out_dir)
    b_path = tmp_path / "b.onnx"
    onnx.save(b.fp32, b_path)
    flag = tmp_path / "flag"
    name, target = ("ir.save", "ir.save") if external else ("_write_streaming",) * 2
    script = _SLOW_WRITE.format(name=name, target=target)
    argv = ["convert", b_path, "-o", out, "--no-calibrate", "-q"]
    if external:
        argv.append("--external-data")
    proc = subprocess.Popen(
        [sys.executable, "-c", script, flag, *map(str, argv)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not flag.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert flag.exists(), proc.communicate(timeout=10)
        assert len(files(out_dir)) > len(before)  # the temporary files are there
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, (proc.returncode, stderr)
    assert "Traceback" not in stderr
    if sig == signal.SIGINT:
        assert stderr.splitlines() == ["mixprec: interrupted"]
    assert snapshot(out_dir) == before
    assert_close(a.ref, output(out), "fp16")


def test_handlers_are_installed_only_while_writing(tmp_path: Path, pair) -> None:
    a, _ = pair
    seen = []
    real = mixprec.io.models._write_streaming

    def spy(*args: Any, **kwargs: Any) -> None:
        seen.append(signal.getsignal(signal.SIGTERM))
        real(*args, **kwargs)

    before = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mixprec.io.models, "_write_streaming", spy)
        save_model(a.model, tmp_path / "o.onnx")
    assert seen and seen[0] not in (signal.SIG_DFL, before[1])
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_a_signal_goes_to_the_previous_python_handler_after_cleanup(
    tmp_path: Path, pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An application's own SIGTERM handler still runs, after the temporary files are
    gone; the save reports that nothing was written."""
    a, _ = pair
    calls: list[tuple[int, list[str]]] = []

    def handler(signum: int, frame: Any) -> None:
        calls.append((signum, files(tmp_path)))

    real = mixprec.io.models._write_streaming

    def interrupted(*args: Any, **kwargs: Any) -> None:
        real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler runs at once; never reached

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        monkeypatch.setattr(mixprec.io.models, "_write_streaming", interrupted)
        with pytest.raises(mixprec.MixprecError, match="interrupted by SIGTERM; nothing written"):
            save_model(a.model, tmp_path / "o.onnx")
        assert signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert calls == [(signal.SIGTERM, [])]
    assert files(tmp_path) == []


_FREED_SIGNAL_STACK = """
import ctypes, mmap, os, signal, sys, time
import onnx, onnx_ir as ir
import mixprec.io.models
from mixprec.core.errors import MixprecError

class Stack(ctypes.Structure):
    _fields_ = [("sp", ctypes.c_void_p), ("flags", ctypes.c_int), ("size", ctypes.c_size_t)]

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
size = 1 << 16
flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
sp = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
assert libc.sigaltstack(ctypes.byref(Stack(sp, 0, size)), None) == 0
assert libc.munmap(sp, size) == 0  # what OpenVINO's CPU plugin leaves (module doc)
got = []
signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
real = mixprec.io.models._write_streaming
def interrupted(*args, **kwargs):
    real(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
mixprec.io.models._write_streaming = interrupted
try:
    mixprec.io.models.save_model(ir.from_proto(onnx.load(sys.argv[1])), sys.argv[2])
except MixprecError as exc:
    print(exc)
print("handled", got)
"""


def test_a_signal_stack_left_freed_by_a_library_does_not_crash_a_save(tmp_path: Path, pair) -> None:
    """The main thread's alternate signal stack points at freed memory, as OpenVINO's CPU
    plugin leaves it on an AMX CPU when two Cores are released out of order (seen in this
    suite: a SIGSEGV, the pytest worker lost). A save interrupted by SIGTERM still runs
    the handler and cleans up (mixprec.core.sigstack), instead of dying with SIGSEGV."""
    a, _ = pair
    onnx.save(a.fp32, tmp_path / "a.onnx")
    proc = subprocess.run(
        [sys.executable, "-c", _FREED_SIGNAL_STACK, tmp_path / "a.onnx", tmp_path / "o.onnx"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"exit {proc.returncode} (-11: SIGSEGV): {proc.stderr[-800:]}"
    assert proc.stdout.splitlines()[-2:] == [
        f"{tmp_path / 'o.onnx'}: writing interrupted by SIGTERM; nothing written",
        "handled [15]",
    ], proc.stdout
    assert files(tmp_path) == ["a.onnx"]


def test_ctrl_c_in_process_exits_130_without_leftovers(
    tmp_path: Path, pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, _ = pair
    onnx.save(a.fp32, tmp_path / "a.onnx")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    real = mixprec.io.models._write_streaming

    def interrupted(*args: Any, **kwargs: Any) -> None:
        real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)

    monkeypatch.setattr(mixprec.io.models, "_write_streaming", interrupted)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["convert", str(tmp_path / "a.onnx"), "-o", str(out_dir / "o.onnx"), "-q"])
    assert rc == 130
    assert err.getvalue().splitlines() == ["mixprec: interrupted"]
    assert files(out_dir) == []


# --------------------------------------------------------------------------- F4


def _limited(argv: Sequence[object], max_bytes: int, cwd: Path) -> subprocess.CompletedProcess:
    """``python -m mixprec ARGV`` where no file may grow past ``max_bytes`` (a full disk:
    writes fail with EFBIG; Python ignores SIGXFSZ)."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))

    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXPREC_")}
    return subprocess.run(
        [sys.executable, "-m", "mixprec", *map(str, argv)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        preexec_fn=limit,
        timeout=120,
        check=False,
    )


def _one_error(proc: subprocess.CompletedProcess, pattern: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert re.fullmatch("mixprec: error: " + pattern, lines[0]), lines[0]


@pytest.mark.parametrize("external", [False, True])
def test_full_disk_while_saving_is_one_error_line(tmp_path: Path, pair, external: bool) -> None:
    a, b = pair
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    save_model(a.model, out_dir / "o.onnx", external_data=external)
    before = snapshot(out_dir)
    onnx.save(b.fp32, tmp_path / "b.onnx")
    argv = ["convert", tmp_path / "b.onnx", "-o", out_dir / "o.onnx", "--no-calibrate"]
    proc = _limited([*argv, "--external-data"] if external else argv, 4000, tmp_path)
    _one_error(
        proc,
        re.escape(str(out_dir / "o.onnx"))
        # EFBIG, or the short write that reaches the limit (onnx_ir's data writer)
        + r": cannot write the model \((File too large|\d+ requested and \d+ written)\); "
        r"nothing written",
    )
    assert snapshot(out_dir) == before
    assert_close(a.ref, output(out_dir / "o.onnx"), "fp16")


def test_full_disk_in_the_log_dir_is_one_error_line(tmp_path: Path, pair) -> None:
    """F4: --log-dir on a full disk: one line, exit 2, no half-written log file left
    under its name, no output model."""
    a, _ = pair
    onnx.save(a.fp32, tmp_path / "a.onnx")
    logs = tmp_path / "logs"
    proc = _limited(
        ["convert", "a.onnx", "-o", "o.onnx", "--log-dir", logs, "--no-calibrate"],
        4000,
        tmp_path,
    )
    _one_error(
        proc,
        "--log-dir " + re.escape(str(logs)) + r": cannot write its before files \(File too "
        r"large\)",
    )
    assert not (tmp_path / "o.onnx").exists()
    assert "before.onnx" not in files(logs)
    assert not [n for n in files(logs) if n.endswith(".tmp")]


@pytest.mark.parametrize("mode", ["file-in-the-way", "folder-in-the-way"])
def test_unusable_log_dir_is_one_error_line(
    tmp_path: Path, pair, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """F4: the log folder is a file, or one of its files is a folder: one error line."""
    a, _ = pair
    onnx.save(a.fp32, tmp_path / "a.onnx")
    logs = tmp_path / "logs"
    if mode == "file-in-the-way":
        logs.write_text("not a folder")
        expect = r": cannot create \(File exists\)"
    else:
        (logs / "before.onnx").mkdir(parents=True)
        expect = r": cannot write its before files \(Is a directory\)"
    err = io.StringIO()
    argv = ["convert", str(tmp_path / "a.onnx"), "-o", str(tmp_path / "o.onnx")]
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main([*argv, "--log-dir", str(logs), "--no-calibrate"])
    lines = err.getvalue().splitlines()
    assert rc == 2 and len(lines) == 1, err.getvalue()
    assert re.fullmatch("mixprec: error: --log-dir " + re.escape(str(logs)) + expect, lines[0])
    assert not (tmp_path / "o.onnx").exists()
    if mode == "folder-in-the-way":
        assert not [n for n in files(logs) if n.endswith(".tmp")]


def test_a_signal_during_the_final_rename_keeps_the_new_pair(
    tmp_path: Path, pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM right as the model is renamed into place: the signal waits until the
    save's bookkeeping is done (removing the new data file then would break the new
    model), then goes to the previous handler; the save succeeded."""
    a, b = pair
    out = tmp_path / "out.onnx"
    save_model(a.model, out, external_data=True)
    calls: list[int] = []
    real = os.replace

    def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        real(src, dst, *args, **kwargs)
        if os.fspath(dst) == str(out):
            os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    try:
        monkeypatch.setattr(mixprec.io.models.os, "replace", replace)
        save_model(b.model, out, external_data=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    monkeypatch.undo()
    assert calls == [signal.SIGTERM]
    (name,) = data_refs(out)
    assert files(tmp_path) == sorted(["out.onnx", name])
    assert_close(b.ref, output(out), "fp16")
