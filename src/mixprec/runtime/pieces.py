"""A large model run one piece at a time, in bounded memory (in ONNX Runtime by default,
through the engine door).

An ONNX Runtime session holds every weight of its model: for a model of several GB that
is several GB of memory (twice that with MatMul prepacking), whatever its inputs. Here the
main graph is cut, in its (topological) order, into consecutive pieces that each read at
most ``max_bytes`` of initializers (a node whose weights alone are larger is a piece of
its own). Each piece becomes a small model: its inputs are the values it reads from
earlier pieces or the graph's inputs (a value an If/Loop/Scan body reads from the outer
graph counts as read by that node), its outputs the values later pieces or the graph's
outputs read. Its session is built, run on every sample, and dropped before the next
piece's; only the boundary values are kept between pieces (and dropped once no later
piece reads them).

The weights reach ONNX Runtime without a copy in Python: a weight that is a span of the
model's external data file is given as a reference to it (ONNX Runtime maps the file
itself), any other large one as an in-memory initializer
(:func:`~mixprec.io.protos.weightless_proto`). Sessions are built without prepacking by
default (no second, repacked copy of the weights). Both run at the graph optimizations
of the engine's own sessions (``optimization="all"``: what a deployment gets).

:func:`tap_in_pieces` runs the pieces only as far as the last one that makes a value asked
for, and hands each such value to a callback as its piece makes it (the layer inputs a
data-aware weight method sums over, for a model no single session can hold).

:func:`run_saved` runs a model held in memory (a weight-only result) from a temporary
file with external data, which ONNX Runtime maps: on a 366 MB MatMulNBits model one
prepacked session took 580 MB beside the model, against 900 MB when the same weights were
handed over in memory; on a 660 MB one, 910 MB in one session, 340 MB in pieces of
256 MB.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx.helper
import onnx_ir as ir

from mixprec.core.errors import MixprecError
from mixprec.io.external import DATA_FOLDER
from mixprec.io.models import load_model, save_model
from mixprec.io.protos import iter_node_graphs, weightless_proto
from mixprec.runtime.engine import LoadHints, RuntimeLoadError, RuntimeOptions, RuntimeRunError
from mixprec.runtime.engines import engine_for

__all__ = [
    "PIECE_BYTES",
    "Piece",
    "Taps",
    "plan_pieces",
    "run_in_pieces",
    "run_saved",
    "tap_in_pieces",
]

#: Initializer bytes one piece reads at most (unless one node alone reads more).
PIECE_BYTES = 256 << 20
Outputs = dict[str, np.ndarray]


@dataclasses.dataclass
class Piece:
    """Consecutive main-graph nodes and the names they read, make and hand on."""

    nodes: list[onnx.NodeProto]
    initializers: list[str]
    inputs: list[str] = dataclasses.field(default_factory=list)
    outputs: list[str] = dataclasses.field(default_factory=list)


def _reads(node: onnx.NodeProto) -> set[str]:
    """The names ``node`` reads, those its subgraphs read included (an over-estimate:
    names made inside a subgraph are not main-graph values and are filtered out later)."""
    names = {n for n in node.input if n}
    for graph in iter_node_graphs(node):
        for inner in graph.node:
            names.update(n for n in inner.input if n)
    return names


def _group(graph: onnx.GraphProto, sizes: Mapping[str, int], max_bytes: int) -> list[Piece]:
    """The nodes in consecutive groups of at most ``max_bytes`` of initializers each."""
    names = {t.name for t in graph.initializer}
    pieces: list[Piece] = []
    nodes: list[onnx.NodeProto] = []
    held: set[str] = set()
    total = 0
    for node in graph.node:
        used = _reads(node) & names
        extra = sum(sizes.get(n, 0) for n in used - held)
        if nodes and total + extra > max_bytes:
            pieces.append(Piece(nodes, sorted(held)))
            nodes, held, total = [], set(), 0
            extra = sum(sizes.get(n, 0) for n in used)
        nodes.append(node)
        held |= used
        total += extra
    if nodes:
        pieces.append(Piece(nodes, sorted(held)))
    return pieces


def plan_pieces(
    graph: onnx.GraphProto,
    sizes: Mapping[str, int],
    max_bytes: int = PIECE_BYTES,
    extra: Collection[str] = (),
) -> list[Piece]:
    """``graph``'s main nodes cut into pieces (module doc); ``sizes``: bytes by initializer;
    ``extra``: values a piece hands on as well, whoever reads them (the taps)."""
    pieces = _group(graph, sizes, max_bytes)
    initializers = {t.name for t in graph.initializer}
    available = {v.name for v in graph.input} - initializers
    needed = {v.name for v in graph.output} | set(extra)
    later: list[set[str]] = []
    for piece in reversed(pieces):  # what the pieces after each one read
        later.append(set(needed))
        for node in piece.nodes:
            needed |= _reads(node)
    later.reverse()
    for piece, after in zip(pieces, later, strict=True):
        made = [o for node in piece.nodes for o in node.output if o]
        reads = set().union(*(_reads(node) for node in piece.nodes))
        piece.inputs = sorted((reads & available) - set(made))
        piece.outputs = [o for o in made if o in after]
        available |= set(made)
    return pieces


def _value_info(name: str, array: np.ndarray) -> onnx.ValueInfoProto:
    elem = onnx.helper.np_dtype_to_tensor_dtype(array.dtype)
    return onnx.helper.make_tensor_value_info(name, elem, [None] * array.ndim)


def _piece_model(model: onnx.ModelProto, piece: Piece, env: Mapping[str, np.ndarray]) -> bytes:
    """The serialized model of one piece: its nodes, its initializers (references to the
    data file, or placeholders), inputs typed from the arrays they will be fed."""
    wanted = set(piece.initializers)
    graph = onnx.helper.make_graph(
        piece.nodes,
        f"{model.graph.name or 'graph'}_piece",
        [_value_info(n, np.asarray(env[n])) for n in piece.inputs],
        [onnx.ValueInfoProto(name=n) for n in piece.outputs],
        initializer=[t for t in model.graph.initializer if t.name in wanted],
    )
    small = onnx.ModelProto(ir_version=model.ir_version, graph=graph)
    small.opset_import.extend(model.opset_import)
    small.functions.extend(model.functions)
    return small.SerializeToString()


def run_in_pieces(
    model: ir.Model,
    feeds: Sequence[Mapping[str, np.ndarray]],
    *,
    threads: int,
    max_bytes: int | None = PIECE_BYTES,
    prepack: bool = False,
    what: str = "ONNX Runtime cannot run the model",
    runtime: RuntimeOptions | None = None,
) -> list[Outputs]:
    """``model``'s graph outputs on each of ``feeds``, one piece at a time (module doc);
    ``max_bytes`` None: one piece (one session, still without copies of the weights);
    ``runtime``: the engine (default ONNX Runtime's CPU provider, ``threads`` threads).

    Raises:
        MixprecError: ONNX Runtime cannot load or run a piece (``what``: the message).
    """
    options = runtime or RuntimeOptions(threads=threads)
    envs = _run_pieces(model, feeds, options, max_bytes, prepack, what, Taps())
    outputs = [v.name for v in model.graph.outputs if v.name]
    return [{n: env[n] for n in outputs if n in env} for env in envs]


@dataclasses.dataclass(frozen=True)
class Taps:
    """Values handed to ``consume(sample_index, name, array)`` as soon as a piece makes
    them, instead of the graph's outputs: a run with taps stops after the last piece
    that makes one, and keeps no value longer than a later piece reads it."""

    names: frozenset[str] = frozenset()
    consume: Callable[[int, str, np.ndarray], None] | None = None


def tap_in_pieces(
    model: ir.Model,
    feeds: Sequence[Mapping[str, np.ndarray]],
    taps: Taps,
    *,
    threads: int,
    max_bytes: int | None = None,
    what: str = "ONNX Runtime cannot run the model",
) -> None:
    """Runs ``model`` one piece at a time (module doc) and hands each value of ``taps``
    (made by a main-graph node, or a graph input) to ``taps.consume`` per sample: the
    layer inputs of a model too large for one session, in bounded memory. ``max_bytes``
    None: :data:`PIECE_BYTES`.

    Raises:
        MixprecError: ONNX Runtime cannot load or run a piece (``what``: the message).
    """
    options = RuntimeOptions(threads=threads)
    _run_pieces(model, feeds, options, max_bytes or PIECE_BYTES, False, what, taps)


def _run_pieces(
    model: ir.Model,
    feeds: Sequence[Mapping[str, np.ndarray]],
    options: RuntimeOptions,
    max_bytes: int | None,
    prepack: bool,
    what: str,
    taps: Taps,
) -> list[dict[str, np.ndarray]]:
    """Each piece built, run on every feed dict and dropped in turn; the values each
    later piece reads (and the graph's outputs, or the taps) kept per feed dict."""
    folder = model.meta.get(DATA_FOLDER)
    proto, arrays = weightless_proto(model, data_folder=folder)
    sizes = {
        name: value.const_value.nbytes
        for name, value in model.graph.initializers.items()
        if value.const_value is not None
    }
    pieces = plan_pieces(proto.graph, sizes, max_bytes or sys.maxsize, extra=taps.names)
    envs = [dict(f) for f in feeds]
    keep = set() if taps.consume else {o.name for o in proto.graph.output}
    _hand(envs, taps, {v.name for v in proto.graph.input})
    last = max((i for i, p in enumerate(pieces) if taps.names & set(p.outputs)), default=-1)
    for index, piece in enumerate(pieces):
        if not piece.outputs or (taps.consume and index > last):
            continue  # nothing after it reads what it makes (dead nodes, or past the taps)
        source = _piece_model(proto, piece, envs[0])
        external = {n: arrays[n] for n in piece.initializers if n in arrays}
        hints = LoadHints(external=external, data_folder=folder, prepack=prepack)
        try:
            session = engine_for(options).session(source, options, hints=hints)
            for env in envs:
                env.update(session.run({n: env[n] for n in piece.inputs}, piece.outputs))
        except (RuntimeLoadError, RuntimeRunError) as e:
            raise MixprecError(f"{what}: {e}") from None
        del session
        _hand(envs, taps, set(piece.outputs))
        later = keep | {n for p in pieces[index + 1 :] for n in p.inputs}
        for env in envs:
            for name in [n for n in env if n not in later]:
                del env[name]
    return envs


def _hand(envs: list[dict[str, np.ndarray]], taps: Taps, made: set[str]) -> None:
    """Hands the tapped values among ``made`` to ``taps.consume``, sample by sample."""
    if taps.consume is None:
        return
    for name in sorted(taps.names & made):
        for index, env in enumerate(envs):
            if name in env:
                taps.consume(index, name, np.asarray(env[name]))


def run_saved(
    model: ir.Model,
    feeds: Sequence[Mapping[str, np.ndarray]],
    *,
    threads: int,
    max_bytes: int | None = None,
    what: str = "ONNX Runtime cannot run the model",
    runtime: RuntimeOptions | None = None,
) -> list[Outputs]:
    """``model``'s outputs on each of ``feeds``, from a temporary copy saved with external
    data (module doc), removed afterwards; ``max_bytes``: run in pieces of at most that
    many bytes of weights (prepacked), None: in one session.

    Raises:
        MixprecError: ONNX Runtime cannot load or run it (``what``: the message).
    """
    with tempfile.TemporaryDirectory(prefix="mixprec-check-") as folder:
        path = Path(folder) / "model.onnx"
        save_model(model, path, external_data=True)
        if max_bytes is not None:
            saved = load_model(path)
            return run_in_pieces(
                saved,
                feeds,
                threads=threads,
                max_bytes=max_bytes,
                prepack=True,
                what=what,
                runtime=runtime,
            )
        options = runtime or RuntimeOptions(threads=threads)
        try:
            session = engine_for(options).session(str(path), options, hints=LoadHints(owned=True))
            return [session.run(f, None) for f in feeds]
        except (RuntimeLoadError, RuntimeRunError) as e:
            raise MixprecError(f"{what}: {e}") from None
