"""What a batch is made of: the models its sources name, each with its options, the data
found for it, where its result goes, and the key that says whether an earlier result is
still good (``--resume``).

Sources are ``.onnx`` files, folders (searched recursively; hidden folders and the output
folder skipped) and TOML manifests::

    [defaults]                 # optional: options for every model of the manifest
    dtype = "fp16"
    validate = true

    [[models]]
    path = "vision/resnet50.onnx"          # relative to the manifest
    dtype = "int8"
    calibration_data = "data/resnet50"     # relative to the manifest
    exclude = ["^head/"]

    [[models]]
    path = "vision/mobilenet.onnx"
    optimize = true                        # mixprec optimize (candidates = [...] a subset)
    timeout = 600                          # seconds this model may take

Data by convention, beside a model ``NAME.onnx`` (used when the options name none):
``NAME.calib.npz`` or ``NAME.calib/`` (calibration), ``NAME.inputs.npz`` or
``NAME.inputs/`` (validation samples), ``NAME.eval.npz`` or ``NAME.eval/`` (the INT8
accuracy guard's held-out samples).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from mixprec.core.errors import MixprecError
from mixprec.core.ops import parse_dtype, short_name
from mixprec.core.version import __version__
from mixprec.io.external import external_locations
from mixprec.optimize.candidates import select_candidates
from mixprec.runtime.engine import runtime_names

__all__ = [
    "DATA_KINDS",
    "OPTIMIZED",
    "OPTION_NAMES",
    "Job",
    "external_files",
    "find_jobs",
    "model_bytes",
    "output_name",
]

#: The options a batch (or one manifest entry) takes, with their defaults.
DEFAULTS: dict[str, Any] = {
    "dtype": "fp16",
    "validate": False,
    "rtol": None,
    "tune": False,
    "budget": None,
    "metric": "rel-l2",
    "calibration_data": None,
    "inputs": None,
    "eval_data": None,
    "external_data": False,
    "runtime": None,
    "policy": {},
    "optimize": False,
    "candidates": None,
    "timeout": None,
}
#: Options that change how a model is run, not its result: not part of its key.
_NOT_KEYED = ("timeout",)
OPTION_NAMES = (*DEFAULTS, "exclude")
#: The ``dtype`` of an optimize job (its output: ``NAME.optimized.onnx``).
OPTIMIZED = "optimized"
#: Option -> the suffix of the file or folder found beside a model by convention.
DATA_KINDS = {"calibration_data": ".calib", "inputs": ".inputs", "eval_data": ".eval"}


@dataclass(frozen=True)
class Job:
    """One model of a batch.

    Attributes:
        source: the model file.
        name: its path relative to its source (a folder, a manifest's folder), POSIX form.
        output: where its result goes, relative to the output folder.
        options: the resolved options (:data:`DEFAULTS`' keys).
        data: option -> where its samples were found (as given, beside, or none).
        key: a hash of the model's bytes (external data included), its data files, the
            options and mixprec's version: an ``ok`` row with this key is still good.
    """

    source: str
    name: str
    output: str
    options: Mapping[str, Any]
    data: Mapping[str, str] = field(default_factory=dict)
    key: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "name": self.name,
            "output": self.output,
            "options": dict(self.options),
            "data": dict(self.data),
            "key": self.key,
        }


def output_name(name: str, options: Mapping[str, Any]) -> str:
    """``sub/model.onnx`` -> ``sub/model.fp16.onnx`` (the dtype before the suffix)."""
    path = Path(name)
    return path.with_name(f"{path.stem}.{options['dtype']}.onnx").as_posix()


def _options(given: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``given`` merged over the defaults, checked: unknown names and bad values fail."""
    unknown = sorted(set(given) - set(OPTION_NAMES))
    if unknown:
        raise MixprecError(
            f"{where}: unknown option(s) {', '.join(unknown)}; known: {', '.join(OPTION_NAMES)}"
        )
    options = {**DEFAULTS, **{k: v for k, v in given.items() if k != "exclude"}}
    policy = dict(options["policy"] or {})
    if "exclude" in given:
        policy["exclude_nodes"] = list(given["exclude"])
    options["policy"] = policy
    try:
        options["dtype"] = short_name(parse_dtype(options["dtype"]))
    except (MixprecError, TypeError) as exc:
        raise MixprecError(f"{where}: {exc}") from exc
    if options["runtime"] is not None and options["runtime"] not in runtime_names():
        raise MixprecError(
            f"{where}: unknown runtime {options['runtime']!r}; use {', '.join(runtime_names())}"
        )
    if options["optimize"]:
        _optimize_options(options, where)
    timeout = options["timeout"]
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0
    ):
        raise MixprecError(f"{where}: timeout must be a number of seconds > 0, not {timeout!r}")
    if isinstance(options["budget"], str):
        with contextlib.suppress(ValueError):
            options["budget"] = float(options["budget"])
    return options


def _optimize_options(options: dict[str, Any], where: str) -> None:
    """An optimize job's options checked (its candidates, in its runtime), before any
    work; its ``dtype`` becomes ``optimized``: the precision is chosen per model, and
    the output is ``NAME.optimized.onnx``."""
    if options["tune"]:
        raise MixprecError(f"{where}: optimize and tune are separate jobs: choose one")
    names = options["candidates"]
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    try:
        chosen = select_candidates(names, options["runtime"] or "auto")
    except MixprecError as exc:
        raise MixprecError(f"{where}: {exc}") from None
    options["candidates"] = None if names is None else [c.name for c in chosen]
    options["dtype"] = OPTIMIZED


def _beside(model: Path, suffix: str) -> Path | None:
    for candidate in (model.with_name(model.stem + suffix + ".npz"), model.with_suffix(suffix)):
        if candidate.exists():
            return candidate
    return None


def _with_data(model: Path, options: dict[str, Any], base: Path) -> tuple[dict, dict]:
    """The data options as absolute paths, found by convention where not given."""
    data = {}
    for kind, suffix in DATA_KINDS.items():
        given = options.get(kind)
        if given:
            path = (base / given).resolve()
            if not path.exists():
                raise MixprecError(f"{model}: {kind} {given}: no such file or folder")
            options[kind] = str(path)
            data[kind] = f"{given} (given)"
            continue
        found = _beside(model, suffix)
        if found is not None:
            options[kind] = str(found)
            data[kind] = f"{found.name} (beside the model)"
        else:
            data[kind] = "none"
    return options, data


def _hash_path(digest: Any, path: Path) -> None:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        digest.update(f.name.encode())
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 20):
                digest.update(chunk)


def external_files(model: Path) -> list[Path]:
    """The external-data files beside ``model`` (none for a file onnx cannot read: its
    worker reports that as the model's error)."""
    try:
        proto = onnx.load(str(model), load_external_data=False)
    except Exception:
        return []
    names = external_locations(proto)
    return [model.parent / n for n in names if (model.parent / n).is_file()]


def model_bytes(model: Path) -> int:
    """A model's bytes, its external data beside it included."""
    return model.stat().st_size + sum(f.stat().st_size for f in external_files(model))


def job_key(model: Path, options: Mapping[str, Any]) -> str:
    """The model's bytes, its external data, its data files, the options (but the
    timeout), the version."""
    digest = hashlib.sha256()
    _hash_path(digest, model)
    for extra in external_files(model):
        _hash_path(digest, extra)
    for kind in DATA_KINDS:
        if options.get(kind):
            _hash_path(digest, Path(options[kind]))
    keyed = {k: v for k, v in options.items() if k not in _NOT_KEYED}
    digest.update(json.dumps(keyed, sort_keys=True, default=str).encode())
    digest.update(__version__.encode())
    return digest.hexdigest()[:32]


def _job(model: Path, name: str, given: Mapping[str, Any], base: Path, where: str) -> Job:
    options, data = _with_data(model, _options(given, where), base)
    return Job(
        source=str(model),
        name=name,
        output=output_name(name, options),
        options=options,
        data=data,
        key=job_key(model, options),
    )


def _in_folder(folder: Path, skip: Path | None) -> Iterable[Path]:
    for path in sorted(folder.rglob("*.onnx")):
        rel = path.relative_to(folder)
        if any(part.startswith(".") for part in rel.parts[:-1]):
            continue
        if skip is not None and path.resolve().is_relative_to(skip):
            continue
        if path.is_file():
            yield path


def _manifest(path: Path, given: Mapping[str, Any]) -> list[Job]:
    try:
        text = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise MixprecError(f"{path}: not a readable TOML manifest ({exc})") from exc
    defaults = {**given, **text.get("defaults", {})}
    entries = text.get("models")
    if not isinstance(entries, list) or not entries:
        raise MixprecError(f"{path}: a manifest lists its models as [[models]] tables")
    jobs = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or "path" not in entry:
            raise MixprecError(f"{path}: [[models]] entry {i + 1} has no path")
        model = (path.parent / entry["path"]).resolve()
        if not model.is_file():
            raise MixprecError(f"{path}: {entry['path']}: no such model")
        options = {**defaults, **{k: v for k, v in entry.items() if k != "path"}}
        where = f"{path.name} [[models]] {entry['path']}"
        jobs.append(_job(model, Path(entry["path"]).as_posix(), options, path.parent, where))
    return jobs


def find_jobs(
    sources: Sequence[str | os.PathLike[str]],
    options: Mapping[str, Any],
    out_dir: Path | None = None,
) -> list[Job]:
    """The models ``sources`` name, each with its options; fails on a source that names
    nothing and on two models that would write the same output. Every path of a job (the
    model, its data) is absolute: a worker may run in another folder or on another node."""
    skip = out_dir.resolve() if out_dir is not None else None
    jobs: list[Job] = []
    for source in sources:
        path = Path(source)
        if path.is_dir():
            found = [
                _job(m.absolute(), m.relative_to(path).as_posix(), options, Path.cwd(), str(source))
                for m in _in_folder(path, skip)
            ]
            if not found:
                raise MixprecError(f"{source}: no .onnx model in this folder")
            jobs.extend(found)
        elif path.suffix == ".toml" and path.is_file():
            jobs.extend(_manifest(path, options))
        elif path.is_file():
            jobs.append(_job(path.resolve(), path.name, options, Path.cwd(), str(source)))
        else:
            raise MixprecError(f"{source}: no such model, folder or manifest")
    seen: dict[str, str] = {}
    for job in jobs:
        if job.output in seen:
            raise MixprecError(
                f"{seen[job.output]} and {job.source} would both write {job.output}; "
                "give them different names or folders"
            )
        seen[job.output] = job.source
    return jobs
