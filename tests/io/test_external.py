"""External data, tested the way an attacker would use it (issue 7, cases E1-E10).

Every model here keeps its weights in a data file beside it. Beside the attack, a *decoy*
data file with the same layout and other weights sits where a careless reader would look
(the current directory, the folder of a symbolic link, a folder outside the model's): a
conversion that read it would still "work", so every successful conversion is compared
with ONNX Runtime's run of the real FP32 model, and the decoy is shown to give another
answer. Every refused input ends in exactly one ``mixprec: error: ...`` line and exit 2
(in-process through ``main`` and, for some cases, as ``python -m mixprec``), the Python
API raises :class:`mixprec.MixprecError` with the same message, and the input files are
byte-identical afterwards.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import stat
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx.external_data_helper
import onnx.helper as oh
import onnx.numpy_helper as onh
import onnx_ir as ir
import pytest

import mixprec
from helpers import assert_close, run_ort, sha256_of
from mixprec.cli.main import main
from mixprec.core.metrics import rel_l2_error
from mixprec.passes.emulate import emulate_low_precision

X = np.random.default_rng(7).random((1, 3, 8, 8), dtype=np.float32)

# --------------------------------------------------------------------------- models


def conv_model(seed: int = 0, opset: int = 17) -> onnx.ModelProto:
    """Conv -> Relu -> MatMul with three initializers w, b, k (k: 9600 bytes).

    Models of every seed have the same tensors in the same order, so their data files
    have the same layout: a decoy of another seed is read without complaint.
    """
    rng = np.random.default_rng(seed)
    w = (0.3 * rng.standard_normal((8, 3, 3, 3))).astype(np.float32)
    b = (0.1 * rng.standard_normal(8)).astype(np.float32)
    k = (0.2 * rng.standard_normal((8, 300))).astype(np.float32)
    graph = oh.make_graph(
        [
            oh.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
            oh.make_node("Relu", ["c"], ["r"]),
            oh.make_node("MatMul", ["r", "k"], ["y"]),
        ],
        "conv",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3, 8, 8])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 8, 8, 300])],
        [onh.from_array(w, "w"), onh.from_array(b, "b"), onh.from_array(k, "k")],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def save_external(model: onnx.ModelProto, path: Path, location: str = "m.bin") -> onnx.ModelProto:
    """Save ``model`` at ``path`` with every tensor in ``location`` beside it."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)  # saving moves the tensors of the proto it saves
    onnx.external_data_helper.convert_model_to_external_data(
        copy,
        all_tensors_to_one_file=True,
        location=location,
        size_threshold=0,
        convert_attribute=True,  # Constant values too
    )
    onnx.save(copy, path)
    return copy


def reference(model: onnx.ModelProto) -> np.ndarray:
    return run_ort(model, {"x": X})["y"]


def assert_differs(ref: np.ndarray, other: np.ndarray, dtype: str) -> None:
    """The decoy's answer is not within ``dtype``'s tolerance of the real one."""
    with pytest.raises(AssertionError):
        assert_close(ref, other, dtype)


def output_of(model: onnx.ModelProto | str | Path, dtype: str) -> np.ndarray:
    """The converted model's output in ORT (bf16: its emulation, ORT's CPU lacks bf16)."""
    if dtype == "bf16":
        proto = model if isinstance(model, onnx.ModelProto) else onnx.load(model)
        return run_ort(emulate_low_precision(proto), {"x": X})["y"]
    return run_ort(model, {"x": X})["y"]


def set_entry(tensor: onnx.TensorProto, key: str, value: str) -> None:
    for entry in tensor.external_data:
        if entry.key == key:
            entry.value = value
            return
    entry = tensor.external_data.add()
    entry.key, entry.value = key, value


def snapshot(*folders: Path) -> dict[str, str]:
    """sha256 of every regular file below ``folders`` (FIFOs and devices by name only)."""
    out = {}
    for folder in folders:
        for p in sorted(folder.rglob("*")):
            mode = p.lstat().st_mode
            if stat.S_ISREG(mode):
                out[str(p)] = sha256_of(p)
            elif not stat.S_ISDIR(mode):
                out[str(p)] = f"special {stat.S_IFMT(mode)}"
    return out


@dataclass
class Site:
    """A model folder with its data file, a decoy outside it, and an empty output folder."""

    root: Path
    folder: Path  # the model and m.bin
    model: Path
    outside: Path  # secret.bin: a decoy with other weights
    decoy_cwd: Path  # m.bin: a decoy where the current directory would be
    out: Path
    proto: onnx.ModelProto  # the real model, weights inline
    ref: np.ndarray

    def edit(self, name: str, change: Callable[[onnx.ModelProto], None]) -> Path:
        """A copy of the model (same data file) whose proto ``change`` edits."""
        proto = onnx.load(self.model, load_external_data=False)
        change(proto)
        path = self.folder / name
        onnx.save(proto, path)
        return path


@pytest.fixture
def site(tmp_path: Path) -> Site:
    folder, outside, cwd, out = (tmp_path / d for d in ("model", "outside", "cwd", "out"))
    for d in (folder, outside, cwd, out):
        d.mkdir()
    real = conv_model(0)
    save_external(real, folder / "m.onnx")
    save_external(conv_model(99), outside / "secret.onnx", "secret.bin")
    save_external(conv_model(99), cwd / "decoy.onnx", "m.bin")
    ref = reference(real)
    assert_differs(ref, reference(conv_model(99)), "fp16")
    return Site(tmp_path, folder, folder / "m.onnx", outside, cwd, out, real, ref)


def tensor(proto: onnx.ModelProto, name: str) -> onnx.TensorProto:
    return next(t for t in proto.graph.initializer if t.name == name)


# --------------------------------------------------------------------------- CLI runner


@dataclass
class Result:
    rc: int
    out: str
    err: str


def run_cli(
    args: Sequence[object],
    mode: str,
    monkeypatch: pytest.MonkeyPatch,
    *,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 120,
) -> Result:
    """``mixprec ARGS`` in-process (``main``) or as ``python -m mixprec`` (``subproc``)."""
    argv = [str(a) for a in args]
    if mode == "subproc":
        clean = {k: v for k, v in os.environ.items() if not k.startswith("MIXPREC_")}
        proc = subprocess.run(
            [sys.executable, "-m", "mixprec", *argv],
            capture_output=True,
            text=True,
            cwd=cwd,
            env={**clean, **(env or {})},
            timeout=timeout,
            check=False,
        )
        return Result(proc.returncode, proc.stdout, proc.stderr)
    if cwd is not None:
        monkeypatch.chdir(cwd)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return Result(rc, out.getvalue(), err.getvalue())


def assert_one_error(res: Result, pattern: str) -> None:
    """Exit 2, nothing on stdout, and stderr is exactly one line matching ``pattern``."""
    assert res.rc == 2, (res.rc, res.out, res.err)
    assert "Traceback" not in res.err, res.err
    lines = res.err.splitlines()
    assert len(lines) == 1, res.err
    assert re.fullmatch(r"mixprec: error: " + pattern, lines[0]), lines[0]
    assert res.out == ""


# --------------------------------------------------------------------------- E1


@pytest.mark.parametrize("mode", ["api", "inproc", "subproc"])
def test_e1_bf16_opset_upgrade_reads_the_model_folder_not_the_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """bf16 raises an opset-13 Conv model to 22; its external weights still come from the
    model's folder, not from the decoy ``m.bin`` in the current directory."""
    folder, cwd = tmp_path / "model", tmp_path / "cwd"
    folder.mkdir()
    cwd.mkdir()
    real, decoy = conv_model(0, opset=13), conv_model(99, opset=13)
    save_external(real, folder / "m.onnx")
    save_external(decoy, cwd / "decoy.onnx")  # writes cwd/m.bin
    ref = reference(real)
    assert_differs(ref, reference(decoy), "bf16")
    before = snapshot(folder, cwd)
    out = tmp_path / "out.onnx"
    if mode == "api":
        monkeypatch.chdir(cwd)
        result = mixprec.convert(folder / "m.onnx", "bf16", calibration_data={"x": X})
        assert any("opset raised 13 -> 22" in n for n in result.report.notes)
        converted = result.model_proto
    else:
        res = run_cli(
            ["convert", folder / "m.onnx", "-o", out, "--dtype", "bf16"],
            mode,
            monkeypatch,
            cwd=cwd,
        )
        assert res.rc == 0, res.err
        converted = onnx.load(out)
    assert converted.opset_import[0].version == 22
    assert onnx.TensorProto.BFLOAT16 in {t.data_type for t in converted.graph.initializer}
    assert_close(ref, output_of(converted, "bf16"), "bf16")
    assert snapshot(folder, cwd) == before


# --------------------------------------------------------------------------- E2-E5, E7, E10


def _entry(key: str, value: str, name: str = "w") -> Callable[[onnx.ModelProto], None]:
    return lambda proto: set_entry(tensor(proto, name), key, value)


@dataclass(frozen=True)
class Bad:
    """A model file whose external data is bad: how to make it, what stderr says."""

    change: Callable[[Site], Path]
    message: Callable[[Site, Path], str]  # regex after "mixprec: error: "


def _w(site: Site, path: Path, rest: str) -> str:
    return f"{re.escape(str(path))}: tensor 'w': {rest}"


def _outside(location: str) -> Callable[[Site], Path]:
    return lambda s: s.edit("bad.onnx", _entry("location", location))


def _symlink_out(s: Site) -> Path:
    (s.folder / "link.bin").symlink_to(s.outside / "secret.bin")
    return s.edit("bad.onnx", _entry("location", "link.bin"))


def _fifo(s: Site) -> Path:
    os.mkfifo(s.folder / "fifo.bin")
    return s.edit("bad.onnx", _entry("location", "fifo.bin"))


def _device(s: Site) -> Path:
    try:  # /dev/zero's numbers: reads never end
        os.mknod(s.folder / "zero.bin", 0o600 | stat.S_IFCHR, os.makedev(1, 5))
    except (PermissionError, OSError) as exc:
        pytest.skip(f"cannot create a device node here ({exc})")
    return s.edit("bad.onnx", _entry("location", "zero.bin"))


def _subfolder(s: Site) -> Path:
    (s.folder / "sub").mkdir()
    return s.edit("bad.onnx", _entry("location", "sub"))


def _truncated(s: Site) -> Path:
    """A copy of the data file missing its last 100 bytes (inside k, the last tensor)."""
    data = (s.folder / "m.bin").read_bytes()
    (s.folder / "short.bin").write_bytes(data[:-100])

    def change(proto: onnx.ModelProto) -> None:
        for t in proto.graph.initializer:
            set_entry(t, "location", "short.bin")

    return s.edit("bad.onnx", change)


def _past_end(rest: str) -> Callable[[Site, Path], str]:
    return lambda s, p: _w(s, p, rest)


BAD: dict[str, Bad] = {
    # E2: offset or length past the end of the file, a length silently ignored before
    "offset-past-end": Bad(
        lambda s: s.edit("bad.onnx", _entry("offset", "1000000")),
        _past_end(
            r"external data at offset 1000000 with length 864 runs past the end of "
            r"'m\.bin' \(10496 bytes\)"
        ),
    ),
    "data-file-truncated": Bad(
        _truncated,
        lambda s, p: (
            re.escape(str(p)) + r": tensor 'k': external data at offset 896 with "
            r"length 9600 runs past the end of 'short\.bin' \(10396 bytes\)"
        ),
    ),
    "length-too-long": Bad(
        lambda s: s.edit("bad.onnx", _entry("length", "1000000")),
        _past_end(
            r"external data length 1000000 does not match the tensor's size "
            r"\(864 bytes\)"
        ),
    ),
    "length-ignored": Bad(
        lambda s: s.edit("bad.onnx", _entry("length", "4")),
        _past_end(r"external data length 4 does not match the tensor's size \(864 bytes\)"),
    ),
    "offset-negative": Bad(
        lambda s: s.edit("bad.onnx", _entry("offset", "-8")),
        _past_end(r"external data offset '-8' is not a non-negative integer"),
    ),
    "offset-not-a-number": Bad(
        lambda s: s.edit("bad.onnx", _entry("offset", "0x10")),
        _past_end(r"external data offset '0x10' is not a non-negative integer"),
    ),
    # E3/E4: a location that is empty, '.', a folder, or missing
    "location-empty": Bad(_outside(""), _past_end(r"external data location is empty")),
    "location-dot": Bad(
        _outside("."), _past_end(r"external data location '\.' is a folder, not a file")
    ),
    "location-folder": Bad(
        _subfolder, _past_end(r"external data location 'sub' is a folder, not a file")
    ),
    "location-missing": Bad(
        _outside("nope.bin"),
        lambda s, p: _w(
            s,
            p,
            r"external data file 'nope\.bin' is missing \(looked in "
            + re.escape(str(s.folder.resolve()))
            + r"\)",
        ),
    ),
    # E5: a NUL byte (the old code passed it to open(): "embedded null byte", exit 3)
    "location-nul": Bad(
        _outside("m.bin\x00.txt"),
        _past_end(r"external data location 'm\.bin\\x00\.txt' contains a NUL byte"),
    ),
    # E7 in path form, and symbolic links out of the folder
    "location-dotdot": Bad(
        _outside("../outside/secret.bin"),
        lambda s, p: _w(
            s,
            p,
            r"external data location '\.\./outside/secret\.bin' points outside the model's "
            r"folder " + re.escape(str(s.folder.resolve())),
        ),
    ),
    "location-absolute": Bad(
        lambda s: s.edit("bad.onnx", _entry("location", str(s.outside / "secret.bin"))),
        lambda s, p: _w(
            s,
            p,
            f"external data location '{re.escape(str(s.outside / 'secret.bin'))}' is an "
            r"absolute path; it must be relative to the model's folder",
        ),
    ),
    "location-symlink-out": Bad(
        _symlink_out,
        lambda s, p: _w(
            s,
            p,
            r"external data location 'link\.bin' points outside the model's folder "
            + re.escape(str(s.folder.resolve()))
            + r" \(through a symbolic link, to "
            + re.escape(str((s.outside / "secret.bin").resolve()))
            + r"\)",
        ),
    ),
    # E10: a FIFO (the old code hung on it) or a device
    "location-fifo": Bad(
        _fifo,
        _past_end(
            r"external data file 'fifo\.bin' is not a regular file \(a FIFO, socket or "
            r"device\)"
        ),
    ),
    "location-device": Bad(
        _device,
        _past_end(
            r"external data file 'zero\.bin' is not a regular file \(a FIFO, socket or "
            r"device\)"
        ),
    ),
}
SUBPROC = ("offset-past-end", "length-ignored", "location-nul", "location-dotdot", "location-fifo")


@pytest.mark.parametrize(
    ("case", "mode"),
    [(c, "inproc") for c in BAD] + [(c, "subproc") for c in SUBPROC],
)
def test_bad_external_data_is_one_error_line(
    site: Site, monkeypatch: pytest.MonkeyPatch, case: str, mode: str
) -> None:
    bad = BAD[case]
    path = bad.change(site)
    before = snapshot(site.folder, site.outside, site.decoy_cwd)
    res = run_cli(
        ["convert", path, "-o", site.out / "o.onnx"],
        mode,
        monkeypatch,
        cwd=site.decoy_cwd,
        timeout=60,  # a FIFO opened for reading would block forever
    )
    assert_one_error(res, bad.message(site, path))
    assert snapshot(site.folder, site.outside, site.decoy_cwd) == before
    assert list(site.out.iterdir()) == []


@pytest.mark.parametrize("case", list(BAD))
def test_bad_external_data_through_the_api(
    site: Site, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """The same refusals from ``convert``/``inspect`` given the path, and from an
    ``onnx_ir`` model loaded from it (which carries the folder)."""
    bad = BAD[case]
    path = bad.change(site)
    before = snapshot(site.folder, site.outside)
    monkeypatch.chdir(site.decoy_cwd)
    pattern = bad.message(site, path)
    for call in (mixprec.convert, mixprec.inspect):
        with pytest.raises(mixprec.MixprecError) as info:
            call(path, "fp16", calibrate=False)
        assert re.fullmatch(pattern, str(info.value)), str(info.value)
    if case not in ("offset-negative", "offset-not-a-number"):  # ir.load cannot parse those
        with pytest.raises(mixprec.MixprecError) as info:
            mixprec.convert(ir.load(path), "fp16", calibrate=False)
        in_memory = pattern.replace(re.escape(str(path)), "model", 1)
        assert re.fullmatch(in_memory, str(info.value)), str(info.value)
    assert snapshot(site.folder, site.outside) == before


# --------------------------------------------------------------------------- E6, E7 (API)


def _proto_at(site: Site, location: str) -> onnx.ModelProto:
    proto = onnx.load(site.model, load_external_data=False)
    for t in proto.graph.initializer:
        set_entry(t, "location", location)
    return proto


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_e7_in_memory_models_cannot_point_outside(
    site: Site, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A ModelProto or onnx_ir.Model whose locations leave the folder is refused, with or
    without ``base_dir`` (the old code read the secret file and converted its weights)."""
    location = "../outside/secret.bin" if where == "relative" else str(site.outside / "secret.bin")
    proto = _proto_at(site, location)
    path = site.folder / "evil.onnx"
    onnx.save(proto, path)
    before = snapshot(site.folder, site.outside)
    monkeypatch.chdir(site.folder)  # where the old code resolved the location from
    problem = "points outside the model's folder" if where == "relative" else "absolute path"
    attempts: list[tuple[object, dict[str, object]]] = [
        (proto, {"base_dir": site.folder}),
        (ir.load(path), {}),
        (ir.load(path), {"base_dir": site.folder}),
        (ir.from_proto(proto), {"base_dir": site.folder}),
    ]
    for model, kwargs in attempts:
        with pytest.raises(mixprec.MixprecError, match=re.escape(problem)) as info:
            mixprec.convert(model, "fp16", calibrate=False, **kwargs)  # type: ignore[arg-type]
        assert str(info.value).startswith("model: tensor 'w': external data location ")
    with pytest.raises(mixprec.MixprecError, match="has no folder to read it from"):
        mixprec.convert(proto, "fp16", calibrate=False)
    assert snapshot(site.folder, site.outside) == before


def test_e6_model_without_its_data_converted_from_another_folder(
    site: Site, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``onnx.load(..., load_external_data=False)`` then convert from a folder holding a
    decoy ``m.bin``: refused without ``base_dir``; with it, the real weights are used."""
    proto = onnx.load(site.model, load_external_data=False)
    untouched = proto.SerializeToString()
    monkeypatch.chdir(site.decoy_cwd)
    message = (
        "model: tensor 'w' keeps its data in the external file 'm.bin' and an in-memory "
        "model has no folder to read it from: pass base_dir= (the folder of the .onnx "
        "file), or the model's path"
    )
    with pytest.raises(mixprec.MixprecError) as info:
        mixprec.convert(proto, "fp16")
    assert str(info.value) == message
    with pytest.raises(mixprec.MixprecError, match=re.escape(message)):
        mixprec.inspect(proto, "fp16")
    with pytest.raises(mixprec.MixprecError, match="has no folder"):
        mixprec.convert(ir.from_proto(proto), "fp16")  # onnx_ir tensors without base_dir
    result = mixprec.convert(proto, "fp16", base_dir=site.folder, calibration_data={"x": X})
    assert_close(site.ref, output_of(result.model_proto, "fp16"), "fp16")
    assert mixprec.inspect(proto, "fp16", base_dir=site.folder, calibrate=False).nodes
    # validate and quantize read in-memory models the same way
    with pytest.raises(mixprec.MixprecError, match="has no folder to read it from"):
        mixprec.validate(proto, result.model_proto, inputs={"x": X})
    report = mixprec.validate(proto, result.model_proto, inputs={"x": X}, base_dir=site.folder)
    assert report.passed, report.format_table()
    with pytest.raises(mixprec.MixprecError, match="has no folder to read it from"):
        mixprec.quantize(proto, {"x": X})
    int8 = mixprec.quantize(proto, {"x": X}, base_dir=site.folder)
    got = run_ort(int8.model_proto, {"x": X})["y"]
    rel = rel_l2_error(site.ref, got)
    assert rel < 0.1, f"INT8 relative L2 {rel:.3g} vs the FP32 model (real weights: < 0.1)"
    assert proto.SerializeToString() == untouched  # the caller's proto is not changed


def test_onnx_ir_model_carries_its_folder(site: Site, monkeypatch: pytest.MonkeyPatch) -> None:
    """``ir.load(path)`` sets each tensor's base_dir: accepted from any current directory,
    and with a ``base_dir`` that names the same folder; refused with another one."""
    model = ir.load(site.model)
    monkeypatch.chdir(site.decoy_cwd)
    result = mixprec.convert(model, "fp16", calibration_data={"x": X})
    assert_close(site.ref, output_of(result.model_proto, "fp16"), "fp16")
    assert isinstance(result.converted, ir.Model)
    link = site.root / "model-link"
    link.symlink_to(site.folder)
    again = mixprec.convert(model, "fp16", base_dir=link, calibrate=False)  # same real folder
    assert_close(site.ref, output_of(again.model_proto, "fp16"), "fp16")
    with pytest.raises(mixprec.MixprecError, match=r"was loaded from .* which is not base_dir="):
        mixprec.convert(model, "fp16", base_dir=site.decoy_cwd, calibrate=False)
    # the caller's model still refers to its file, unchanged
    w = model.graph.initializers["w"].const_value
    assert isinstance(w, ir.ExternalTensor) and w.location == "m.bin"


def test_path_with_another_base_dir_is_refused(site: Site) -> None:
    with pytest.raises(mixprec.MixprecError, match=r"is not the folder of the model file"):
        mixprec.convert(site.model, "fp16", base_dir=site.decoy_cwd, calibrate=False)
    with pytest.raises(mixprec.MixprecError, match=r"base_dir .*: not a folder"):
        mixprec.convert(site.model, "fp16", base_dir=site.root / "nope", calibrate=False)
    result = mixprec.convert(site.model, "fp16", base_dir=site.folder, calibration_data={"x": X})
    assert_close(site.ref, output_of(result.model_proto, "fp16"), "fp16")


# --------------------------------------------------------------------------- E8


@pytest.mark.parametrize("mode", ["inproc", "subproc"])
def test_e8_model_reached_through_a_symlink_reads_its_real_folder(
    site: Site, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """``elsewhere/m.onnx`` links to the real model; ``elsewhere/m.bin`` is a decoy."""
    elsewhere = site.decoy_cwd  # holds a decoy m.bin
    (elsewhere / "m.onnx").symlink_to(site.model)
    before = snapshot(site.folder, elsewhere)
    out = site.out / "o.onnx"
    res = run_cli(
        ["convert", elsewhere / "m.onnx", "-o", out, "--inputs", _npz(site)],
        mode,
        monkeypatch,
        cwd=elsewhere,
    )
    assert res.rc == 0, res.err
    assert_close(site.ref, output_of(out, "fp16"), "fp16")
    result = mixprec.convert(elsewhere / "m.onnx", "fp16", calibration_data={"x": X})
    assert_close(site.ref, output_of(result.model_proto, "fp16"), "fp16")
    assert snapshot(site.folder, elsewhere) == before


def test_hugging_face_style_cache_of_blobs_is_refused_with_a_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``snapshot/m.onnx`` and ``snapshot/m.onnx.data`` link to hash-named blobs: the data
    beside the link is not beside the target, so it is refused in one line that says why
    and what to do (reading it would follow a link out of the model's real folder)."""
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir()
    snap.mkdir()
    save_external(conv_model(), blobs / "m.onnx", "m.onnx.data")
    (blobs / "m.onnx").rename(blobs / "3f2a")
    (blobs / "m.onnx.data").rename(blobs / "9c1d")
    (snap / "m.onnx").symlink_to("../blobs/3f2a")
    (snap / "m.onnx.data").symlink_to("../blobs/9c1d")
    res = run_cli(["convert", snap / "m.onnx", "-o", tmp_path / "o.onnx"], "inproc", monkeypatch)
    assert_one_error(
        res,
        r".*external data file 'm.onnx.data' is missing \(looked in .*blobs\); .* is a "
        r"symbolic link into that folder .* \(e.g. huggingface-cli download --local-dir DIR\)",
    )
    assert not (tmp_path / "o.onnx").exists()


def _npz(site: Site) -> Path:
    path = site.root / "x.npz"
    np.savez(path, x=X)
    return path


# --------------------------------------------------------------------------- E9


@pytest.mark.parametrize("mode", ["inproc", "subproc"])
def test_e9_output_data_name_is_the_inputs_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """in.onnx keeps its weights in out.onnx.data: ``-o out.onnx --external-data`` would
    write over them. Refused before anything is written."""
    save_external(conv_model(0), tmp_path / "in.onnx", "out.onnx.data")
    before = snapshot(tmp_path)
    res = run_cli(
        ["convert", tmp_path / "in.onnx", "-o", tmp_path / "out.onnx", "--external-data"],
        mode,
        monkeypatch,
    )
    assert_one_error(
        res,
        re.escape(f"{tmp_path / 'out.onnx'}.data")
        + r": the input model reads this file; refusing to write over it \(choose another "
        r"output name\)",
    )
    assert snapshot(tmp_path) == before  # nothing new, nothing changed


def test_output_model_over_the_inputs_data_is_refused(
    site: Site, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``-o m.bin`` (the input's data file), also through a symbolic link or a hard link."""
    (site.out / "alias.bin").symlink_to(site.folder / "m.bin")
    os.link(site.folder / "m.bin", site.out / "hard.bin")
    before = snapshot(site.folder)
    for target in (site.folder / "m.bin", site.out / "alias.bin", site.out / "hard.bin"):
        res = run_cli(["convert", site.model, "-o", target], "inproc", monkeypatch)
        assert_one_error(res, re.escape(str(target)) + r": the input model reads this file; .*")
        result = mixprec.convert(site.model, "fp16", calibrate=False)
        with pytest.raises(mixprec.MixprecError, match="the input model reads this file"):
            result.save(target)
    assert snapshot(site.folder) == before
    assert sorted(p.name for p in site.out.iterdir()) == ["alias.bin", "hard.bin"]


def test_log_dir_never_writes_over_an_input(site: Site, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model named before.onnx, logged into its own folder, is not overwritten."""
    save_external(site.proto, site.out / "before.onnx", "before.bin")
    before = snapshot(site.out)
    res = run_cli(
        ["convert", site.out / "before.onnx", "-o", site.root / "o.onnx", "--log-dir", site.out],
        "inproc",
        monkeypatch,
    )
    assert_one_error(
        res,
        "--log-dir " + re.escape(str(site.out)) + r": before\.onnx is a file the input model "
        r"reads; refusing to write over it \(choose another log folder\)",
    )
    after = snapshot(site.out)
    assert {k: v for k, v in after.items() if k in before} == before
    assert not (site.root / "o.onnx").exists()


# --------------------------------------------------------------------------- subgraphs, Constant


def _nested_model(seed: int) -> onnx.ModelProto:
    """A Constant node's value and an If branch's initializer, both external when saved."""
    rng = np.random.default_rng(seed)
    c = (0.5 * rng.standard_normal((8, 8))).astype(np.float32)
    t = (0.5 * rng.standard_normal((1, 8))).astype(np.float32)
    then = oh.make_graph(
        [oh.make_node("Add", ["m", "t"], ["then_y"])],
        "then",
        [],
        [oh.make_tensor_value_info("then_y", onnx.TensorProto.FLOAT, [1, 8])],
        [onh.from_array(t, "t")],
    )
    other = oh.make_graph(
        [oh.make_node("Relu", ["m"], ["else_y"])],
        "else",
        [],
        [oh.make_tensor_value_info("else_y", onnx.TensorProto.FLOAT, [1, 8])],
    )
    graph = oh.make_graph(
        [
            oh.make_node("Constant", [], ["cst"], value=onh.from_array(c, "cst")),
            oh.make_node("MatMul", ["x", "cst"], ["m"]),
            oh.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other),
        ],
        "nested",
        [
            oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 8]),
            oh.make_tensor_value_info("cond", onnx.TensorProto.BOOL, []),
        ],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 8])],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def _attribute_tensor(proto: onnx.ModelProto) -> onnx.TensorProto:
    return proto.graph.node[0].attribute[0].t


def _branch_tensor(proto: onnx.ModelProto) -> onnx.TensorProto:
    then = next(a for a in proto.graph.node[2].attribute if a.name == "then_branch")
    return then.g.initializer[0]


def test_constant_values_and_subgraph_initializers_are_resolved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, cwd = tmp_path / "model", tmp_path / "cwd"
    folder.mkdir()
    cwd.mkdir()
    real = _nested_model(0)
    saved = save_external(real, folder / "m.onnx")
    save_external(_nested_model(99), cwd / "decoy.onnx")
    on_disk = onnx.load(folder / "m.onnx", load_external_data=False)
    assert _attribute_tensor(on_disk).data_location == onnx.TensorProto.EXTERNAL
    assert _branch_tensor(on_disk).data_location == onnx.TensorProto.EXTERNAL
    monkeypatch.chdir(cwd)
    x = np.random.default_rng(3).random((1, 8), dtype=np.float32)
    for cond in (True, False):
        feeds = {"x": x, "cond": np.array(cond)}
        ref = run_ort(real, feeds)["y"]
        assert_differs(ref, run_ort(_nested_model(99), feeds)["y"], "fp16")
        for model, kwargs in (
            (folder / "m.onnx", {}),
            (saved, {"base_dir": folder}),
            (ir.load(folder / "m.onnx"), {}),
        ):
            result = mixprec.convert(model, "fp16", calibration_data=feeds, **kwargs)  # type: ignore[arg-type]
            out = run_ort(result.model_proto, feeds)["y"]
            assert_close(ref, out, "fp16", name=f"cond={cond}")


@pytest.mark.parametrize("where", ["constant", "branch"])
def test_escapes_in_constants_and_subgraphs_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    save_external(_nested_model(0), folder / "m.onnx")
    save_external(_nested_model(99), tmp_path / "secret.onnx", "secret.bin")
    proto = onnx.load(folder / "m.onnx", load_external_data=False)
    target = _attribute_tensor(proto) if where == "constant" else _branch_tensor(proto)
    set_entry(target, "location", "../secret.bin")
    onnx.save(proto, folder / "evil.onnx")
    before = snapshot(tmp_path)
    res = run_cli(
        ["convert", folder / "evil.onnx", "-o", tmp_path / "o.onnx"],
        "inproc",
        monkeypatch,
        cwd=folder,
    )
    name = "cst" if where == "constant" else "t"
    assert_one_error(
        res,
        re.escape(str(folder / "evil.onnx"))
        + f": tensor '{name}': external data location "
        + r"'\.\./secret\.bin' points outside the model's folder .*",
    )
    assert snapshot(tmp_path) == before


# --------------------------------------------------------------------------- sparse


def _sparse_model(values_tensor: onnx.TensorProto, indices: np.ndarray) -> onnx.ModelProto:
    sparse = oh.make_sparse_tensor(values_tensor, onh.from_array(indices, "k_idx"), [2, 6])
    graph = oh.make_graph(
        [oh.make_node("MatMul", ["x", "k"], ["y"])],
        "sparse",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 2])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 6])],
        sparse_initializer=[sparse],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("indices", ["linear", "coordinates"])
def test_sparse_initializer_with_external_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, indices: str
) -> None:
    """onnx_ir drops sparse initializers (the old code failed, exit 3): they are read,
    also from external data, and made dense."""
    values = np.array([1.5, -2.0, 0.25, 3.0], np.float32)
    linear = np.array([0, 4, 7, 11], np.int64)
    idx = linear if indices == "linear" else np.stack(np.unravel_index(linear, (2, 6)), axis=1)
    inline = _sparse_model(onh.from_array(values, "k"), idx)
    x = np.array([[0.5, -1.0]], np.float32)
    ref = run_ort(inline, {"x": x})["y"]
    (tmp_path / "k.bin").write_bytes(b"\0" * 16 + values.tobytes())
    (tmp_path / "decoy.bin").write_bytes(b"\0" * 16 + (values * 7).tobytes())
    ext = onnx.TensorProto(name="k", data_type=onnx.TensorProto.FLOAT, dims=[4])
    ext.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", "k.bin"), ("offset", "16"), ("length", "16")):
        set_entry(ext, key, value)
    model = _sparse_model(ext, idx)
    onnx.save(model, tmp_path / "sparse.onnx")
    monkeypatch.chdir(tmp_path)
    for source, kwargs in ((tmp_path / "sparse.onnx", {}), (model, {"base_dir": tmp_path})):
        result = mixprec.convert(source, "fp16", calibration_data={"x": x}, **kwargs)  # type: ignore[arg-type]
        assert not result.model_proto.graph.sparse_initializer
        assert_close(ref, run_ort(result.model_proto, {"x": x})["y"], "fp16")
    with pytest.raises(mixprec.MixprecError, match="has no folder to read it from"):
        mixprec.convert(model, "fp16", calibrate=False)
    set_entry(model.graph.sparse_initializer[0].values, "location", "../k.bin")
    with pytest.raises(mixprec.MixprecError, match=r"tensor 'k': .*points outside"):
        mixprec.convert(model, "fp16", calibrate=False, base_dir=tmp_path)


def test_sparse_indices_out_of_range_are_refused() -> None:
    bad = _sparse_model(
        onh.from_array(np.array([1.0, 2.0], np.float32), "k"), np.array([0, 12], np.int64)
    )
    with pytest.raises(mixprec.MixprecError, match=r"sparse tensor 'k': its indices do not fit"):
        mixprec.convert(bad, "fp16", calibrate=False)


# --------------------------------------------------------------------------- the pass


def test_resolve_pass_replaces_every_external_tensor(site: Site) -> None:
    """The pass on its own: exact ``modified``, no ExternalTensor left, files in meta."""
    from mixprec.io.external import INPUT_FILES, ResolveExternalDataPass

    model = ir.load(site.model)
    result = ResolveExternalDataPass()(model)
    assert result.modified and result.resolved == 3
    assert result.files == [str((site.folder / "m.bin").resolve())]
    assert model.meta[INPUT_FILES] == result.files
    for value in model.graph.initializers.values():
        assert not isinstance(value.const_value, ir.ExternalTensor)
    np.testing.assert_array_equal(
        model.graph.initializers["k"].const_value.numpy(),  # type: ignore[union-attr]
        onh.to_array(tensor(site.proto, "k")),
    )
    assert not ResolveExternalDataPass()(model).modified


# --------------------------------------------------------------------------- validate


@pytest.mark.parametrize("mode", ["inproc", "subproc"])
def test_validate_reads_both_models_from_their_own_folders(
    site: Site, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """``convert --validate --external-data`` and ``validate`` from the decoy's folder:
    both models are read from their folders (a decoy read for either would fail the
    comparison), and the log folder's before.onnx holds the real weights inline."""
    out, logs = site.out / "o.onnx", site.root / "logs"
    argv = ["convert", site.model, "-o", out, "--validate", "--external-data", "--log-dir", logs]
    res = run_cli(argv, mode, monkeypatch, cwd=site.decoy_cwd)
    assert res.rc == 0, res.err
    assert "(validated: passed)" in res.out
    assert sorted(p.name for p in site.out.iterdir()) == ["o.onnx", "o.onnx.data"]
    assert_close(site.ref, output_of(out, "fp16"), "fp16")
    before = onnx.load(logs / "before.onnx")
    assert all(t.data_location != onnx.TensorProto.EXTERNAL for t in before.graph.initializer)
    np.testing.assert_array_equal(site.ref, reference(before))
    res = run_cli(["validate", site.model, out], mode, monkeypatch, cwd=site.decoy_cwd)
    assert res.rc == 0, res.err
    assert "PASSED" in res.out


# --------------------------------------------------------------------------- odd tensors


def test_packed_and_bfloat16_tensors_keep_bytes_and_doc_strings(tmp_path: Path) -> None:
    """int4 (2 per byte, unpacked by onnx_ir) and bfloat16 (an ml_dtypes array over the
    map) read from one file at their offsets, doc strings kept."""
    import ml_dtypes

    from mixprec.io.external import ResolveExternalDataPass

    int4 = np.array([1, -2, 3, -4, 5], dtype=ml_dtypes.int4)
    packed = ir.Tensor(int4, dtype=ir.DataType.INT4).tobytes()
    bf16 = np.array([1.5, -2.0, 3.25, 0.0], dtype=ml_dtypes.bfloat16)
    (tmp_path / "d.bin").write_bytes(packed + bf16.tobytes())
    tensors = [
        ir.ExternalTensor(
            "d.bin", 0, 3, ir.DataType.INT4, shape=ir.Shape([5]), name="a", doc_string="A"
        ),
        ir.ExternalTensor("d.bin", 3, 8, ir.DataType.BFLOAT16, shape=ir.Shape([4]), name="b"),
    ]
    graph = ir.Graph(
        [], [], nodes=[], initializers=[ir.Value(name=t.name, const_value=t) for t in tensors]
    )
    model = ir.Model(graph, ir_version=10)
    result = ResolveExternalDataPass(tmp_path)(model)
    assert result.resolved == 2
    a, b = (model.graph.initializers[n].const_value for n in "ab")
    assert a is not None and b is not None
    np.testing.assert_array_equal(a.numpy(), int4)
    np.testing.assert_array_equal(b.numpy(), bf16)
    assert (a.doc_string, a.dtype, b.dtype) == ("A", ir.DataType.INT4, ir.DataType.BFLOAT16)


def test_a_fifo_or_device_as_the_model_file_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """onnx.load on a FIFO blocks forever; /dev/zero never ends."""
    os.mkfifo(tmp_path / "m.onnx")
    for path in (tmp_path / "m.onnx", Path("/dev/zero")):
        res = run_cli(
            ["convert", path, "-o", tmp_path / "o.onnx"], "subproc", monkeypatch, timeout=60
        )
        assert_one_error(
            res, re.escape(str(path)) + r": not a regular file \(a FIFO, socket or device\)"
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_stages_run_directly_never_read_from_the_cwd(
    site: Site, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Pipeline.run`` skips ``convert``'s loading: a model whose external tensors have
    no folder is refused (they would be read from the current directory); one from
    ``ir.load(path)`` reads its own folder."""
    config = mixprec.ConvertConfig.resolve("fp16", calibrate=False)
    monkeypatch.chdir(site.decoy_cwd)
    bare = ir.from_proto(onnx.load(site.model, load_external_data=False))
    with pytest.raises(mixprec.MixprecError, match="has no folder to read it from"):
        mixprec.Pipeline(config).run(bare)
    model = mixprec.Pipeline(config).run(ir.load(site.model))
    assert_close(site.ref, output_of(ir.to_proto(model), "fp16"), "fp16")


# --------------------------------------------------------------------------- bounded memory


def test_calibration_lets_ort_map_the_model_files_and_measures_the_same(tmp_path: Path) -> None:
    """A model read from files is calibrated by an ORT session that maps those files
    itself (no copy of the weights); the ranges equal those of the same model in memory."""
    from mixprec.calibrate.runner import calibrate
    from mixprec.io.external import DATA_FOLDER, ResolveExternalDataPass
    from mixprec.io.protos import weightless_proto

    model = conv_model()
    save_external(model, tmp_path / "m.onnx")
    on_disk = ir.load(tmp_path / "m.onnx")
    ResolveExternalDataPass()(on_disk)
    folder = on_disk.meta[DATA_FOLDER]
    assert folder == os.path.realpath(tmp_path)
    proto, arrays = weightless_proto(on_disk, data_folder=folder)
    refs = {
        t.name: {e.key: e.value for e in t.external_data}
        for t in proto.graph.initializer
        if t.data_location == onnx.TensorProto.EXTERNAL
    }
    assert refs["k"]["location"] == "m.bin" and "k" not in arrays, (refs, sorted(arrays))
    assert int(refs["k"]["length"]) == 8 * 300 * 4
    from mixprec.calibrate.probes import ProbeSession

    probe = ProbeSession.create(on_disk, [("c", ir.DataType.FLOAT)], threads=1)
    assert probe is not None, "ORT could not build the session that maps the model's files"
    lo, hi, shape = probe.run({"x": X})["c"]
    assert shape == [1, 8, 8, 8] and lo < hi

    feeds = [{"x": X}, {"x": X[..., ::-1].copy()}]
    from_files = calibrate(on_disk, feeds, observer="minmax").stats
    in_memory = calibrate(ir.from_proto(model), feeds, observer="minmax").stats
    assert set(from_files) == set(in_memory)
    differ = {
        n: (from_files[n], in_memory[n])
        for n in in_memory
        if (from_files[n].min, from_files[n].max) != (in_memory[n].min, in_memory[n].max)
    }
    assert not differ, differ


def test_weight_scans_match_numpy_and_keep_nan() -> None:
    from mixprec.calibrate.observers import absmax_of, channel_range

    rng = np.random.default_rng(3)
    w = rng.standard_normal((5, 7, 3)).astype(np.float32)
    assert absmax_of(w) == float(np.max(np.abs(w)))
    assert absmax_of(np.zeros((0, 4), np.float32)) == 0.0
    w_nan = w.copy()
    w_nan[1, 2, 0] = np.nan
    assert np.isnan(absmax_of(w_nan))
    for axis in (0, 1, -1):
        lo, hi = channel_range(w_nan, axis)
        moved = np.moveaxis(w_nan, axis, 0).reshape(w.shape[axis], -1)
        np.testing.assert_array_equal(lo, np.nanmin(moved, axis=1))
        np.testing.assert_array_equal(hi, np.nanmax(moved, axis=1))
