"""Where a weight-only run keeps its FP32 model, and how its checks run models.

**A large model held in memory** (one ``.onnx`` file with over :data:`MAP_ABOVE` of
weights and no external data) is first written to a temporary folder with external data
and read back memory-mapped (:func:`maps_a_copy`), then run as a mapped model (below).

**Streamed models.** A model whose external data is over :data:`STREAM_ABOVE` (or any
model with ``WeightsConfig.stream=True``) is not copied into protobuf: the source stays
the loaded ``onnx_ir`` model, whose weights are read-only maps of its data files; each
quantization works on a copy of its graph that shares those maps and reads a weight a
slice at a time (:mod:`mixprec.weights.slices`), and the checks run the FP32 and the
quantized model in pieces of at most :data:`~mixprec.runtime.pieces.PIECE_BYTES` of
weights (:mod:`mixprec.runtime.pieces`), so no whole session of either is built. A
data-aware method (AWQ, GPTQ) reads its layer statistics the same way: the calibration
samples run the FP32 model piece by piece, and each layer input is summed as its piece
makes it (:func:`~mixprec.runtime.pieces.tap_in_pieces`).
**Mapped models.** A smaller model read from a file with external data is not copied into
protobuf either: the source is the loaded ``onnx_ir`` model (its weights memory-mapped),
each quantization works on a copy of its graph that shares the maps, and the checks run
the FP32 model in one ONNX Runtime session that maps the data file itself (a proto that
refers to the file, no weight bytes in it), with the same options as a proto's session
and so the same outputs. One copy of a 622 MB model in protobuf, its serialized bytes
and a session parsed from them held 2.6 GB at once; the mapped session, 0.7 GB.
Other models (no external data) are one proto, parsed again for each quantization and
run in one session.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import numpy as np
import onnx
import onnx_ir as ir

from mixprec.core.errors import MixprecError
from mixprec.core.limits import PROTO_LIMIT
from mixprec.io.external import DATA_FOLDER, clone_model, external_bytes
from mixprec.io.protos import weightless_proto
from mixprec.runtime.engine import LoadHints, RuntimeLoadError, RuntimeRunError
from mixprec.runtime.engines import engine_for
from mixprec.runtime.pieces import PIECE_BYTES, run_in_pieces, run_saved
from mixprec.weights.config import WeightsConfig

__all__ = [
    "CANNOT_RUN",
    "STREAM_ABOVE",
    "ModelRuns",
    "Outputs",
    "Source",
    "keeps_mapped",
    "maps_a_copy",
    "streamed_note",
    "streams",
    "work_copy",
]

Outputs = dict[str, np.ndarray]
#: What a weight-only model that ONNX Runtime cannot load or run is told.
CANNOT_RUN = "ONNX Runtime cannot run the weight-only model (not written)"
#: A model with more external data than this is streamed (module doc): it is over
#: protobuf's 2 GB, and a copy in memory would cost several times its size.
STREAM_ABOVE = PROTO_LIMIT
#: The FP32 model as the stages get it: a proto (its weights in memory), or the loaded
#: ``onnx_ir`` model of a streamed run (its weights memory-mapped).
Source = onnx.ModelProto | ir.Model


#: A model held in memory (no external data) with more weight bytes than this is run from
#: a mapped copy (:func:`~mixprec.io.models.mapped_copy`): held as a protobuf beside its
#: parsed form, SmolLM2-135M given as one 652 MB file peaked at 3.78 GB.
MAP_ABOVE = 256 << 20


def maps_a_copy(model: ir.Model, config: WeightsConfig) -> bool:
    """Whether ``model`` (as loaded) is held in memory with over :data:`MAP_ABOVE` bytes of
    weights, and so is run from a memory-mapped copy."""
    if keeps_mapped(model, config):
        return False
    weights = (v.const_value for v in model.graph.initializers.values())
    return sum(t.nbytes for t in weights if t is not None) > MAP_ABOVE


def streams(model: ir.Model, config: WeightsConfig) -> bool:
    """Whether ``model`` (as loaded) is quantized streamed: ``config.stream`` when set,
    else when its external data is over :data:`STREAM_ABOVE`."""
    if config.stream is not None:
        return config.stream
    return external_bytes(model) > STREAM_ABOVE


def keeps_mapped(model: ir.Model, config: WeightsConfig) -> bool:
    """Whether ``model`` (as loaded) stays the source as it is, its weights memory-mapped:
    a streamed model, or one with external data (module doc)."""
    return streams(model, config) or external_bytes(model) > 0


def work_copy(source: Source) -> ir.Model:
    """A model the passes may change: parsed from a proto, or a copy of a streamed
    model's graphs that shares its (memory-mapped) weights."""
    return ir.from_proto(source) if isinstance(source, onnx.ModelProto) else clone_model(source)


@dataclasses.dataclass(frozen=True)
class ModelRuns:
    """How the check runs models in ONNX Runtime: the FP32 ``source`` and a candidate.

    In memory (a proto source, or a mapped ``onnx_ir`` one that is not ``streamed``): one
    session per model. Streamed (module doc): the FP32 model in pieces of at most
    :data:`~mixprec.runtime.pieces.PIECE_BYTES` of weights, and so the quantized one,
    from a temporary file ONNX Runtime maps (one session of an int8 result would cost
    about 1.6x its size beside mixprec's copy: over half the model for a large model).
    """

    source: Source
    config: WeightsConfig
    streamed: bool = False

    def fp32(self, feeds: list[dict[str, np.ndarray]]) -> list[Outputs]:
        """The FP32 model's outputs on each feed dict; one line when it cannot run."""
        what = "ONNX Runtime cannot run the FP32 model"
        if isinstance(self.source, ir.Model) and self.streamed:
            threads = self.config.runtime.threads
            return run_in_pieces(self.source, feeds, threads=threads, what=what)
        if isinstance(self.source, ir.Model):
            return _mapped_outputs(self.source, feeds, self.config, what)
        return _outputs(self.source, feeds, self.config, what)

    @contextlib.contextmanager
    def fp32_runner(self) -> Iterator[Callable[[list[dict[str, np.ndarray]]], list[Outputs]]]:
        """Runs of the FP32 model that follow one another (greedy steps, then the check
        windows): one session kept while the block runs where the model is held whole (a
        mapped model's without prepacked weights: its weights are the file's pages, with
        no repacked copy beside them), pieces per call where it is streamed."""
        what = "ONNX Runtime cannot run the FP32 model"
        if isinstance(self.source, ir.Model) and self.streamed:
            yield self.fp32
            return
        if isinstance(self.source, ir.Model):
            folder = self.source.meta.get(DATA_FOLDER)
            proto, arrays = weightless_proto(self.source, data_folder=folder)
            model: onnx.ModelProto | bytes = proto.SerializeToString()
            hints = LoadHints(external=arrays, data_folder=folder, prepack=False)
        else:
            model, hints = self.source, LoadHints()
        try:
            held = [
                engine_for(self.config.runtime).session(model, self.config.runtime, hints=hints)
            ]
        except RuntimeLoadError as e:
            raise MixprecError(f"{what}: {e}") from None

        def run(feeds: list[dict[str, np.ndarray]]) -> list[Outputs]:
            try:
                return [held[0].run(f) for f in feeds]
            except RuntimeRunError as e:
                raise MixprecError(f"{what}: {e}") from None

        try:
            yield run
        finally:
            held.clear()  # the session (and the weights it holds) goes here

    def quantized(self, model: ir.Model, feeds: list[dict[str, np.ndarray]]) -> list[Outputs]:
        """A weight-only model's outputs on each feed dict; one line when it cannot run."""
        if self.streamed:
            threads = self.config.runtime.threads
            return run_saved(model, feeds, threads=threads, max_bytes=PIECE_BYTES, what=CANNOT_RUN)
        return _outputs(ir.to_proto(model), feeds, self.config, CANNOT_RUN)


def _outputs(
    model: onnx.ModelProto | bytes,
    feeds: list[dict[str, np.ndarray]],
    config: WeightsConfig,
    what: str,
    hints: LoadHints | None = None,
) -> list[Outputs]:
    """``model``'s outputs on each feed dict, in ONNX Runtime; one line when it cannot."""
    try:
        session = engine_for(config.runtime).session(model, config.runtime, hints=hints)
        return [session.run(f) for f in feeds]
    except (RuntimeLoadError, RuntimeRunError) as e:
        raise MixprecError(f"{what}: {e}") from None


def _mapped_outputs(
    source: ir.Model, feeds: list[dict[str, np.ndarray]], config: WeightsConfig, what: str
) -> list[Outputs]:
    """A mapped model's outputs in one session: the proto refers to the data file, which
    ONNX Runtime maps (other large weights are handed over in memory); no weight bytes
    are copied into protobuf."""
    folder = source.meta.get(DATA_FOLDER)
    proto, arrays = weightless_proto(source, data_folder=folder)
    hints = LoadHints(external=arrays, data_folder=folder)
    return _outputs(proto.SerializeToString(), feeds, config, what, hints)


def streamed_note(source: ir.Model) -> str:
    """The report's note on a streamed run."""
    size = external_bytes(source) / 1e9
    read = (
        f"{size:.2f} GB of external data read one weight (slice) at a time from the "
        "memory-mapped data file, never copied"
        if size
        else "stream=True: the weights shared, never copied"
    )
    return (
        f"streamed: {read}; the checks run the FP32 and the quantized model in pieces of "
        f"at most {PIECE_BYTES >> 20} MB of weights"
    )
