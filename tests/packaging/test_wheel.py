"""The wheel works outside the checkout.

``python -m build`` makes the sdist and, from the sdist, the wheel (each in its own isolated
build environment, as a release would), from a copy of the working tree's files (tracked
ones plus untracked ones git does not ignore), so nothing is written into the checkout. The
wheel is installed into a fresh venv (its dependencies from the package index or pip's
cache), and from a folder outside the checkout that venv runs ``mixprec --version`` and a
``mixprec convert --validate --report`` of a tiny model made here: the report page inlines
``report_assets/*``, which must come from the installed package.

When the build or the install cannot get what it needs (``build`` not installed, no network
and no cache, no ``git``), the tests are skipped saying why; under CI (``$CI`` set) they fail
instead.
"""

from __future__ import annotations

import email.message
import email.parser
import fnmatch
import os
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx.checker
import onnx.helper
import onnx.numpy_helper
import pytest
from packaging.requirements import Requirement

#: slow: each test builds or installs the package in a fresh venv
pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text("utf-8"))["project"]
NAME: str = PROJECT["name"]
VERSION: str = PROJECT["version"]
PACKAGE_DIR = "src/mixprec/"

#: Output of pip or build that means the package index could not be reached.
_OFFLINE_SIGNS = (
    "No matching distribution found",
    "Could not find a version that satisfies",
    "Failed to establish a new connection",
    "NewConnectionError",
    "Network is unreachable",
    "Temporary failure in name resolution",
    "Name or service not known",
    "ReadTimeoutError",
    "ConnectTimeoutError",
)


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"wheel test cannot run in CI: {reason}", pytrace=False)
    pytest.skip(f"wheel test cannot run here: {reason}")


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _clean_env(extra_path: Path | None = None) -> dict[str, str]:
    """The caller's environment, less what would make Python find the checkout or the dev
    venv (PYTHONPATH, VIRTUAL_ENV, ...) and less the MIXPREC_* variables mixprec reads."""
    drop = {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "VIRTUAL_ENV"}
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("MIXPREC_")}
    env["PIP_NO_INPUT"] = "1"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    if extra_path is not None:
        env["PATH"] = f"{extra_path}{os.pathsep}{env.get('PATH', '')}"
    return env


def _run(
    cmd: list[str | Path], *, cwd: Path, env: dict[str, str], timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _check_fetch(proc: subprocess.CompletedProcess[str], what: str) -> None:
    """Fail on a failed ``what``, or skip (fail under CI) when it failed for want of network."""
    if proc.returncode == 0:
        return
    out = proc.stdout + proc.stderr
    if any(sign in out for sign in _OFFLINE_SIGNS):
        _unavailable(
            f"{what} could not fetch its dependencies (no network and no cache?):\n{_tail(out, 8)}"
        )
    pytest.fail(f"{what} failed (exit {proc.returncode}):\n{_tail(out)}", pytrace=False)


def _project_files() -> list[str]:
    """The working tree's files a clone plus the uncommitted work would have: tracked files
    that still exist, and untracked files git does not ignore (paths relative to the repo)."""
    if shutil.which("git") is None:
        _unavailable("git is not installed (it lists the project's files to build from)")
    proc = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO_ROOT,
        capture_output=True,
        check=False,
    )
    if proc.returncode != 0:
        _unavailable(f"{REPO_ROOT} is not a git checkout: {proc.stderr.decode(errors='replace')}")
    names = sorted({n for n in proc.stdout.decode().split("\0") if n})
    return [n for n in names if (REPO_ROOT / n).is_file() or (REPO_ROOT / n).is_symlink()]


def _copy_tree(files: list[str], dest: Path) -> None:
    for name in files:
        src, dst = REPO_ROOT / name, dest / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst, follow_symlinks=False)


def _build_outputs() -> dict[str, int]:
    """What a build run in the checkout would leave there, with modification times."""
    found = [REPO_ROOT / "build", REPO_ROOT / "dist"]
    found += [*REPO_ROOT.glob("*.egg-info"), *REPO_ROOT.glob("src/*.egg-info")]
    return {str(p): p.stat().st_mtime_ns for p in found if p.exists()}


@dataclass(frozen=True)
class Built:
    sdist: Path
    wheel: Path
    #: the project's files (relative paths) under src/mixprec/ that the build started from
    package_files: tuple[str, ...]


@dataclass(frozen=True)
class Installed:
    venv: Path
    bin: Path
    work: Path  # a folder outside the checkout to run in


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    try:
        import build  # noqa: F401
    except ImportError:
        _unavailable("the 'build' package is not installed (pip install -e '.[test]')")
    root = tmp_path_factory.mktemp("wheel-build")
    assert not root.resolve().is_relative_to(REPO_ROOT), "the build must happen outside"
    files = _project_files()
    tree, dist = root / "tree", root / "dist"
    _copy_tree(files, tree)
    before = _build_outputs()
    t0 = time.perf_counter()
    # the sdist, then the wheel built from the unpacked sdist (build's default)
    proc = _run(
        [sys.executable, "-m", "build", "--outdir", dist, tree],
        cwd=root,
        env=_clean_env(),
        timeout=300,
    )
    _check_fetch(proc, "python -m build")
    print(f"\nbuild: {time.perf_counter() - t0:.1f} s")
    assert _build_outputs() == before, "the build wrote build outputs into the checkout"
    sdists = sorted(dist.glob("*.tar.gz"))
    wheels = sorted(dist.glob("*.whl"))
    assert [p.name for p in sdists] == [f"{NAME}-{VERSION}.tar.gz"], sdists
    assert [p.name for p in wheels] == [f"{NAME}-{VERSION}-py3-none-any.whl"], wheels
    package_files = tuple(n for n in files if n.startswith(PACKAGE_DIR))
    assert f"{PACKAGE_DIR}report_assets/report.js" in package_files
    return Built(sdists[0], wheels[0], package_files)


@pytest.fixture(scope="module")
def installed(built: Built, tmp_path_factory: pytest.TempPathFactory) -> Installed:
    root = tmp_path_factory.mktemp("wheel-venv")
    venv = root / "venv"
    t0 = time.perf_counter()
    proc = _run([sys.executable, "-m", "venv", venv], cwd=root, env=_clean_env(), timeout=120)
    if proc.returncode != 0:
        out = proc.stdout + proc.stderr
        if "ensurepip" in out:
            _unavailable(f"python -m venv has no pip (ensurepip missing):\n{_tail(out, 5)}")
        pytest.fail(f"python -m venv failed:\n{_tail(out)}", pytrace=False)
    bin_dir = venv / "bin"
    proc = _run(
        [bin_dir / "python", "-m", "pip", "install", built.wheel],
        cwd=root,
        env=_clean_env(bin_dir),
        timeout=400,
    )
    _check_fetch(proc, "pip install of the wheel into a fresh venv")
    print(f"\nfresh venv + install: {time.perf_counter() - t0:.1f} s")
    work = root / "run"
    work.mkdir()
    return Installed(venv, bin_dir, work)


def _members_sdist(sdist: Path) -> tuple[str, set[str]]:
    prefix = f"{NAME}-{VERSION}/"
    with tarfile.open(sdist) as tar:
        names = {m.name for m in tar.getmembers() if m.isfile()}
        pkg_info = tar.extractfile(prefix + "PKG-INFO")
        assert pkg_info is not None, "sdist has no PKG-INFO"
        meta = pkg_info.read().decode("utf-8")
    assert all(n.startswith(prefix) for n in names), "sdist members outside its folder"
    return meta, {n[len(prefix) :] for n in names}


def _declared_files() -> list[str]:
    """Files pyproject.toml declares (readme, license file, license-files globs), relative."""
    declared: list[str] = []
    readme = PROJECT.get("readme")
    if isinstance(readme, str):
        declared.append(readme)
    elif isinstance(readme, dict) and "file" in readme:
        declared.append(readme["file"])
    lic = PROJECT.get("license")
    if isinstance(lic, dict) and "file" in lic:
        declared.append(lic["file"])
    return declared


def _check_license(meta: email.message.Message, files: set[str]) -> None:
    lic = PROJECT.get("license")
    if isinstance(lic, dict) and "text" in lic:
        assert meta.get("License") == lic["text"], meta.get("License")
    elif isinstance(lic, str):
        assert meta.get("License-Expression") == lic, meta.get("License-Expression")
    for pattern in PROJECT.get("license-files", []):
        assert fnmatch.filter(sorted(files), pattern), f"no file for license-files {pattern!r}"


def test_sdist_holds_the_package_data_and_declared_files(built: Built) -> None:
    text, files = _members_sdist(built.sdist)
    meta = email.parser.HeaderParser().parsestr(text)
    assert (meta["Name"], meta["Version"]) == (NAME, VERSION)
    for name in ("PKG-INFO", "pyproject.toml", *_declared_files()):
        assert name in files, f"sdist lacks {name}"
    missing = sorted(set(built.package_files) - files)
    assert not missing, f"sdist lacks package files: {missing}"
    _check_license(meta, files)
    readme = PROJECT.get("readme")
    if isinstance(readme, str) and readme.endswith(".md"):
        assert meta["Description-Content-Type"] == "text/markdown"


def test_wheel_holds_the_package_data_and_metadata(built: Built) -> None:
    dist_info = f"{NAME}-{VERSION}.dist-info"
    with zipfile.ZipFile(built.wheel) as whl:
        names = set(whl.namelist())
        metadata = whl.read(f"{dist_info}/METADATA").decode("utf-8")
        entry_points = whl.read(f"{dist_info}/entry_points.txt").decode("utf-8")
    tops = {n.split("/", 1)[0] for n in names}
    assert tops == {"mixprec", dist_info}, f"unexpected top-level entries: {sorted(tops)}"
    expected = {n.removeprefix("src/") for n in built.package_files}
    missing = sorted(expected - names)
    assert not missing, f"wheel lacks package files (package-data patterns?): {missing}"
    meta = email.parser.HeaderParser().parsestr(metadata)
    assert (meta["Name"], meta["Version"]) == (NAME, VERSION)
    assert meta["Requires-Python"] == PROJECT["requires-python"]
    required = {Requirement(r).name: Requirement(r) for r in meta.get_all("Requires-Dist", [])}
    for dep in map(Requirement, PROJECT["dependencies"]):
        assert dep.name in required, f"METADATA lacks Requires-Dist {dep}"
        assert required[dep.name].specifier == dep.specifier, (dep, required[dep.name])
        assert required[dep.name].marker is None, f"{dep.name} is declared conditional"
    for script, target in PROJECT["scripts"].items():
        assert f"{script} = {target}" in entry_points, entry_points


def test_version_outside_the_checkout(installed: Installed) -> None:
    env = _clean_env(installed.bin)
    proc = _run([installed.bin / "mixprec", "--version"], cwd=installed.work, env=env, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == f"mixprec {VERSION}", proc.stdout
    proc = _run(
        [installed.bin / "python", "-m", "mixprec", "--version"],
        cwd=installed.work,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == f"mixprec {VERSION}", proc.stdout


def test_imports_the_installed_package(installed: Installed) -> None:
    code = (
        "import sys, mixprec\n"
        "from importlib import resources\n"
        "print(mixprec.__file__)\n"
        "print(resources.files('mixprec').joinpath('report_assets', 'report.js'))\n"
        "print(mixprec.__version__)\n"
        "print('\\n'.join(p for p in sys.path if p))\n"
    )
    proc = _run(
        [installed.bin / "python", "-c", code],
        cwd=installed.work,
        env=_clean_env(installed.bin),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    module, asset, version, *path = proc.stdout.splitlines()
    venv = installed.venv.resolve()
    for found in (module, asset):
        assert Path(found).resolve().is_relative_to(venv), f"{found} is not in the venv {venv}"
        assert not Path(found).resolve().is_relative_to(REPO_ROOT), found
    assert version == VERSION
    leaked = [p for p in path if Path(p).resolve().is_relative_to(REPO_ROOT)]
    assert not leaked, f"the fresh venv's sys.path reaches into the checkout: {leaked}"


def _tiny_model(path: Path) -> None:
    rng = np.random.default_rng(0)
    weights = onnx.numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "w")
    bias = onnx.numpy_helper.from_array(np.full(4, 0.1, np.float32), "b")
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node("MatMul", ["x", "w"], ["h"]),
            onnx.helper.make_node("Add", ["h", "b"], ["a"]),
            onnx.helper.make_node("Relu", ["a"], ["y"]),
        ],
        "tiny",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 8])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 4])],
        [weights, bias],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, path)


def test_convert_with_report_outside_the_checkout(installed: Installed) -> None:
    work = installed.work
    _tiny_model(work / "m.onnx")
    proc = _run(
        [installed.bin / "mixprec", "convert", "m.onnx", "-o", "m16.onnx",
         "--dtype", "fp16", "--validate", "--report", "r.html"],
        cwd=work,
        env=_clean_env(installed.bin),
        timeout=180,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{out}"
    assert "validated: passed" in out, out
    converted = onnx.load(work / "m16.onnx")
    onnx.checker.check_model(converted, full_check=True)
    dtypes = {init.name: init.data_type for init in converted.graph.initializer}
    assert dtypes.get("w") == onnx.TensorProto.FLOAT16, dtypes
    page = (work / "r.html").read_text("utf-8")
    # the page inlines the assets as read from the installed package, byte for byte the
    # project's (resources.files resolves them in the venv: test_imports_the_installed_package)
    site = next(installed.venv.glob("lib/python*/site-packages"))
    for name, wrap in (("report.css", "<style>{}</style>"), ("report.js", "<script>{}</script>")):
        asset = site / "mixprec" / "report_assets" / name
        assert asset.is_file(), f"{name} is not installed"
        text = asset.read_text("utf-8")
        assert text.strip(), f"installed {name} is empty"
        assert text == (REPO_ROOT / PACKAGE_DIR / "report_assets" / name).read_text("utf-8")
        assert wrap.format(text) in page, f"the report does not inline the installed {name}"
