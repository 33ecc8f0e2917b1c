"""The models of the candidates that may still win, kept on disk while the rest are built.

optimize keeps each accurate candidate's model until it has chosen (to write the winner,
or to time two tied ones head to head). Held in memory, they stacked under the INT8
candidates' build, the run's peak: MiniLM's bf16-marked copy (90 MB) sat under the
tuner's sensitivity run. A kept model is written to a temporary folder and read back
when asked for; the input itself (a candidate that runs it as it is) is kept by
reference, as are models too large for one protobuf.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import onnx

from mixprec.core.limits import PROTO_LIMIT

__all__ = ["KeptModels"]


class KeptModels(Mapping[str, onnx.ModelProto]):
    """Candidate name -> model, the models other than ``source`` on disk until
    :meth:`close` (or the object's end)."""

    def __init__(self, source: onnx.ModelProto) -> None:
        self.source = source
        self._folder = tempfile.TemporaryDirectory(prefix="mixprec-optimize-")
        self._kept: dict[str, Path | onnx.ModelProto] = {}

    @property
    def folder(self) -> Path:
        """Where the models on disk are."""
        return Path(self._folder.name)

    def keep(self, name: str, model: onnx.ModelProto) -> None:
        """Keep ``model`` under ``name``: on disk unless it is the input or too large."""
        if model is self.source or model.ByteSize() >= PROTO_LIMIT:
            self._kept[name] = model
            return
        path = self.folder / f"{len(self._kept)}.onnx"
        path.write_bytes(model.SerializeToString())
        self._kept[name] = path

    def __getitem__(self, name: str) -> onnx.ModelProto:
        kept = self._kept[name]
        if isinstance(kept, Path):
            return onnx.ModelProto.FromString(kept.read_bytes())
        return kept

    def __iter__(self) -> Iterator[str]:
        return iter(self._kept)

    def __len__(self) -> int:
        return len(self._kept)

    def close(self) -> None:
        """Remove the folder (the models on disk are gone)."""
        self._folder.cleanup()
