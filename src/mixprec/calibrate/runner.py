"""Range calibration: run the FP32 model on a stream of samples and observe every tensor.

:func:`calibrate` takes one feed dict, a list, or any iterable (a generator) of feed
dicts and consumes it one sample at a time: memory does not grow with the number of
samples. Per sample:

* graph inputs are observed from the feeds;
* every float tensor of the main graph is measured by ``ReduceMin``/``ReduceMax``
  probes placed right after its producer (the fast path: one ONNX Runtime session,
  built once, reused for every sample; no full-size intermediate leaves the session);
* observers that need the data (:class:`HistogramObserver`), tensors holding NaN, and
  models the probes cannot run in, fetch the tensors as extra graph outputs, in chunks
  of at most ``chunk_size`` tensors and about :data:`FETCH_BYTES` (sizes learnt from the
  first sample), bisecting a chunk that ONNX Runtime refuses.

Initializers and Constant tensors (subgraphs included) are observed once from their
data, with per-output-channel min/max for weights; no ORT run is needed for them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper

from mixprec.calibrate.observers import (
    DEFAULT_BINS,
    OBSERVERS,
    ChannelObserver,
    Observer,
    TensorStats,
    channel_range,
    chunks_of,
    is_float_array,
    make_observer,
)
from mixprec.core.errors import MixprecError
from mixprec.core.graphs import all_graphs, is_constant_node
from mixprec.core.ops import FLOAT_TYPES, trans_b
from mixprec.io.external import DATA_FOLDER, RELEASE_EVERY, release_mapped_pages
from mixprec.io.feeds import Feeds, calibration_feeds, feeds_for
from mixprec.io.protos import weightless_proto
from mixprec.runtime.emulate import element_types
from mixprec.runtime.probes import ProbeSession, VariantRunner

__all__ = ["CalibrationResult", "calibrate", "collect_absmax", "stream_tensors"]

logger = logging.getLogger(__name__)

# Bisection depth when a fetched chunk fails in ONNX Runtime.
_MAX_BISECT_DEPTH = 12
#: Bytes of fetched tensors per ONNX Runtime run (each fetched tensor stays alive until
#: the run returns); tensors of unknown size count as FETCH_BYTES / 32.
FETCH_BYTES = 128 << 20
# Weight input of ops whose output channel is not axis 0: (op, input index) -> axis.
_CHANNEL_AXIS = {("MatMul", 1): -1, ("ConvTranspose", 1): 1}


@dataclass
class CalibrationResult:
    """What :func:`calibrate` observed.

    Attributes:
        stats: Statistics by tensor name.
        shapes: Shape of each measured tensor in the first sample.
        samples: Number of samples consumed.
        observer: The observer kind used.
        channel_means: Per-channel means of the tensors asked for (``channel_means=`` of
            :func:`calibrate`), averaged over samples (bias correction reads them).
        channel_absmax: Per-channel ``max |x|`` over all samples of the tensors asked for
            (``channel_absmax=``; SmoothQuant reads them).
        rows: A sample of rows (last axis: channels) of the tensors asked for (``rows=``),
            ``[rows, channels]``, at most the asked number from each sample.
    """

    stats: dict[str, TensorStats] = field(default_factory=dict)
    shapes: dict[str, list[int]] = field(default_factory=dict)
    samples: int = 0
    observer: str = "absmax"
    channel_means: dict[str, np.ndarray] = field(default_factory=dict)
    channel_absmax: dict[str, np.ndarray] = field(default_factory=dict)
    rows: dict[str, np.ndarray] = field(default_factory=dict)

    def absmax(self) -> dict[str, float]:
        """``max |x|`` over all samples by tensor name (what the painter reads)."""
        return {name: s.absmax for name, s in self.stats.items()}


def _channel_axis(value: ir.Value) -> int:
    for user, index in value.uses():
        if user.op_type == "Gemm" and index == 1:
            return 0 if trans_b(user) else -1
        axis = _CHANNEL_AXIS.get((user.op_type, index))
        if axis is not None:
            return axis
    return 0


def _constant_array(node: ir.Node) -> np.ndarray | None:
    for key, attr in node.attributes.items():
        if key == "value":
            return attr.as_tensor().numpy()
        if key == "value_float":
            return np.asarray(attr.as_float(), np.float32)
        if key == "value_floats":
            return np.asarray(attr.as_floats(), np.float32)
    return None


def _weight_stats(array: np.ndarray, kind: str, bins: int, axis: int | None) -> TensorStats:
    observer = make_observer(kind, bins)
    if kind in ("absmax", "minmax"):
        for chunk in chunks_of(array):  # same result, no full-size temporaries
            observer.update(chunk)
    else:
        observer.update(array)
    stats = observer.stats()
    if axis is None or array.ndim < 2 or array.size == 0:
        return stats
    axis %= array.ndim
    lo, hi = channel_range(array, axis)
    return dataclasses.replace(stats, channel_axis=axis, channel_min=lo, channel_max=hi)


def static_stats(
    model: ir.Model,
    external: Mapping[str, np.ndarray],
    kind: str,
    bins: int,
    only: Collection[str] | None = None,
) -> dict[str, TensorStats]:
    """Statistics of initializers and Constant tensors of every graph, from their data
    (of the names in ``only`` when given)."""
    found: dict[str, TensorStats] = {}
    for graph in all_graphs(model.graph):
        for name, value in graph.initializers.items():
            if only is not None and name not in only:
                continue
            try:
                array = external[name] if name in external else value.const_value.numpy()  # type: ignore[union-attr]
            except Exception as e:  # placeholders without data, unreadable tensors
                logger.debug("range analysis: cannot read tensor %r: %s", name, e)
                continue
            if is_float_array(array):
                found[name] = _weight_stats(np.asarray(array), kind, bins, _channel_axis(value))
                if array.nbytes >= RELEASE_EVERY:
                    release_mapped_pages(model)  # read once: let a mapped file's pages go
        for node in graph:
            if not is_constant_node(node) or not node.outputs[0].name:
                continue
            if only is not None and node.outputs[0].name not in only:
                continue
            array = _constant_array(node)
            if array is not None and is_float_array(array):
                axis = _channel_axis(node.outputs[0])
                found[node.outputs[0].name] = _weight_stats(array, kind, bins, axis)
    return found


def _candidates(model: ir.Model, skip: set[str]) -> list[tuple[str, ir.DataType]]:
    """Float node outputs of the main graph to measure (types from the IR, else inferred)."""
    dtypes = element_types(model)
    found: list[tuple[str, ir.DataType]] = []
    unknown = 0
    for node in model.graph:
        if is_constant_node(node):
            continue
        for value in node.outputs:
            if not value.name or value.name in skip:
                continue
            dtype = dtypes.get(value)
            if dtype is None:
                unknown += 1
            elif dtype in FLOAT_TYPES:
                found.append((value.name, dtype))
    if unknown:
        logger.debug("range analysis: %d value(s) of unknown type skipped", unknown)
    return found


class _Observed:
    """The observers of one calibration run, by tensor name, and first-sample shapes."""

    def __init__(self, kind: str, bins: int, shapes: dict[str, list[int]]) -> None:
        self.kind = kind
        self.bins = bins
        self.observers: dict[str, Observer] = {}
        self.shapes = shapes
        self.nbytes: dict[str, int] = {}  # fetched tensors' sizes, for the next chunks
        self.mean_axes: dict[str, int] = {}  # tensors whose per-channel mean is wanted
        self.mean_sums: dict[str, np.ndarray] = {}
        self.mean_counts: dict[str, int] = {}
        self.channels: dict[str, ChannelObserver] = {}  # channel absmax, kept rows

    def want_channels(
        self, absmax: Mapping[str, int] | None, rows: Mapping[str, int] | None
    ) -> None:
        """Per-channel ``max |x|`` of ``absmax`` (tensor -> axis); ``rows`` (tensor ->
        rows per sample) kept."""
        for name in {*(absmax or {}), *(rows or {})}:
            axis = (absmax or {}).get(name)
            self.channels[name] = ChannelObserver(axis, (rows or {}).get(name, 0))

    def channel_results(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """(per-channel ``max |x|``, kept rows) by tensor name."""
        absmax = {n: c.absmax for n, c in self.channels.items() if c.absmax is not None}
        rows = {n: kept for n, c in self.channels.items() if (kept := c.kept_rows()) is not None}
        return absmax, rows

    def channel_mean(self, name: str, mean: np.ndarray) -> None:
        """Adds one sample's per-channel mean of ``name``."""
        mean = np.asarray(mean, np.float64).reshape(-1)
        if name in self.mean_sums and self.mean_sums[name].shape != mean.shape:
            return  # channel count changed between samples: not a per-channel quantity
        self.mean_sums[name] = self.mean_sums.get(name, 0) + mean
        self.mean_counts[name] = self.mean_counts.get(name, 0) + 1

    def means(self) -> dict[str, np.ndarray]:
        return {
            n: (self.mean_sums[n] / self.mean_counts[n]).astype(np.float32)
            for n in self.mean_sums
            if np.all(np.isfinite(self.mean_sums[n]))
        }

    def _observer(self, name: str) -> Observer:
        if name not in self.observers:
            self.observers[name] = make_observer(self.kind, self.bins)
        return self.observers[name]

    def array(self, name: str, array: np.ndarray) -> None:
        self.shapes.setdefault(name, [int(d) for d in np.shape(array)])
        if is_float_array(array):
            self._observer(name).update(np.asarray(array))
            axis = self.mean_axes.get(name)
            if axis is not None and np.ndim(array) > 0:
                axis %= np.ndim(array)
                others = tuple(i for i in range(np.ndim(array)) if i != axis)
                self.channel_mean(name, np.asarray(np.mean(array, axis=others, dtype=np.float64)))
            if name in self.channels:
                self.channels[name].update(np.asarray(array))

    def reduced(self, name: str, lo: float, hi: float, shape: list[int]) -> None:
        self.shapes.setdefault(name, shape)
        self._observer(name).update_range(lo, hi)

    def record(self, outs: dict[str, np.ndarray], wanted: set[str]) -> None:
        """Observes the wanted arrays of ``outs`` and drops each one right away."""
        for name in list(outs):
            array = outs.pop(name)
            self.nbytes[name] = int(array.nbytes)
            if name in wanted:
                self.array(name, array)


class _SampleRunner:
    """Measures the candidate tensors of one sample: probes first, fetching for the rest."""

    def __init__(
        self,
        model: ir.Model,
        candidates: list[tuple[str, ir.DataType]],
        *,
        chunk_size: int,
        threads: int,
        external: Mapping[str, np.ndarray],
        use_probes: bool,
        means: Mapping[str, int] | None = None,
        absmax: Mapping[str, int] | None = None,
        fetch: Collection[str] = (),
    ) -> None:
        self._model = model
        self._means = dict(means or {})
        self._absmax = dict(absmax or {})
        self._whole = set(fetch)  # tensors fetched whole (kept rows)
        self._candidates = candidates
        self._chunk_size = chunk_size
        self._threads = threads
        self._external = dict(external)
        self._use_probes = use_probes and bool(candidates)
        self._probe: ProbeSession | None = None
        self._runner: VariantRunner | None = None

    def close(self) -> None:
        self._probe = None
        if self._runner is not None:
            self._runner.close()
            self._runner = None

    def measure(self, feeds: Mapping[str, np.ndarray], observed: _Observed) -> None:
        pending = self._candidates
        if self._use_probes and self._probe is None:
            self._probe = ProbeSession.create(
                self._model,
                self._candidates,
                self._threads,
                self._external,
                means=self._means,
                absmax=self._absmax,
                fetch=self._whole,
            )
            self._use_probes = self._probe is not None
        if self._probe is not None:
            try:
                reduced = self._probe.run(feeds)
            except MixprecError as e:
                logger.debug("range analysis: probes failed on a sample (%s); fetching", e)
            else:
                for name, mean in self._probe.last_means.items():
                    observed.channel_mean(name, mean)
                for name, absmax in self._probe.last_absmax.items():
                    observed.channels[name].update_absmax(absmax)
                for name, array in self._probe.last_fetched.items():
                    channel = observed.channels[name]
                    if name in self._probe.last_absmax:
                        channel.update_rows(array)
                    else:  # no probe (rank unknown): from the fetched tensor
                        channel.update(array)
                pending = []
                for name, dtype in self._candidates:
                    lo, hi, shape = reduced.get(name, (math.nan, math.nan, []))
                    if math.isnan(lo) or math.isnan(hi):  # NaN inside: measured by fetching
                        pending.append((name, dtype))
                    else:
                        observed.reduced(name, lo, hi, shape)
        if pending:
            self._fetch(pending, feeds, observed)

    def _fetch(
        self,
        pending: list[tuple[str, ir.DataType]],
        feeds: Mapping[str, np.ndarray],
        observed: _Observed,
    ) -> None:
        if self._runner is None:
            # The fallback runs protos: large weights as in-memory placeholders.
            folder = self._model.meta.get(DATA_FOLDER)
            proto, arrays = weightless_proto(self._model, data_folder=folder)
            self._external.update(arrays)
            self._runner = VariantRunner(proto, self._threads, self._external, folder)
        runner = self._runner
        wanted = {name for name, _ in pending}
        originals = runner.original_outputs
        own = {vi.name for vi in originals}
        chunks = _chunks(pending, self._chunk_size, observed.nbytes)
        first = [item for item in chunks.pop(0) if item[0] not in own]
        try:
            outs = runner.run([*originals, *_value_infos(first)], feeds)
        except MixprecError as e:
            if not first:
                raise
            logger.debug("range analysis: first chunk failed (%s); checking the plain model", e)
            outs = runner.run(originals, feeds)  # raises when the model itself cannot run
            chunks.insert(0, first)
        observed.record(outs, wanted)
        for chunk in chunks:
            self._run_chunk([item for item in chunk if item[0] not in own], feeds, observed)

    def _run_chunk(
        self,
        items: list[tuple[str, ir.DataType]],
        feeds: Mapping[str, np.ndarray],
        observed: _Observed,
        depth: int = 0,
    ) -> None:
        if not items or self._runner is None:
            return
        try:
            outs = self._runner.run(_value_infos(items), feeds)
        except MixprecError as e:
            if len(items) == 1 or depth >= _MAX_BISECT_DEPTH:
                shown = ", ".join(repr(n) for n, _ in items[:3]) + (
                    ", ..." if len(items) > 3 else ""
                )
                logger.warning("range analysis skipped %d tensor(s) (%s): %s", len(items), shown, e)
                return
            mid = len(items) // 2
            self._run_chunk(items[:mid], feeds, observed, depth + 1)
            self._run_chunk(items[mid:], feeds, observed, depth + 1)
            return
        observed.record(outs, {name for name, _ in items})


def _chunks(
    pending: list[tuple[str, ir.DataType]], most: int, nbytes: Mapping[str, int]
) -> list[list[tuple[str, ir.DataType]]]:
    """``pending`` in runs of at most ``most`` tensors and about :data:`FETCH_BYTES`."""
    chunks: list[list[tuple[str, ir.DataType]]] = [[]]
    total = 0
    for item in pending:
        size = nbytes.get(item[0], FETCH_BYTES // 32)
        if chunks[-1] and (total + size > FETCH_BYTES or len(chunks[-1]) >= most):
            chunks.append([])
            total = 0
        chunks[-1].append(item)
        total += size
    return chunks


def _value_infos(items: Sequence[tuple[str, ir.DataType]]) -> list[onnx.ValueInfoProto]:
    return [helper.make_tensor_value_info(name, int(dtype), None) for name, dtype in items]


def calibrate(
    model: onnx.ModelProto | ir.Model,
    data: Feeds | Iterable[Feeds],
    *,
    observer: str = "absmax",
    bins: int = DEFAULT_BINS,
    chunk_size: int = 2000,
    threads: int = 2,
    external: Mapping[str, np.ndarray] | None = None,
    shapes_out: dict[str, list[int]] | None = None,
    channel_means: Mapping[str, int] | None = None,
    channel_absmax: Mapping[str, int] | None = None,
    rows: Mapping[str, int] | None = None,
    only: Collection[str] | None = None,
) -> CalibrationResult:
    """Runs the FP32 model on every sample of ``data`` and observes every float tensor.

    Measured: graph inputs (from the feeds), every float node output of the main graph
    (types from the model, else ONNX shape inference, else simple op rules), and
    initializers and Constant tensors of all graphs (from their data, once). Values
    inside subgraphs other than constants cannot be fetched and are not recorded.

    ``data`` is consumed lazily, one sample at a time; the observers keep a fixed
    amount of memory per tensor. NaNs are ignored; a tensor holding an inf gets
    ``absmax == inf``. A tensor ONNX Runtime refuses to expose is skipped with a
    warning: calibration fails only when the model itself cannot run.

    Args:
        model: The FP32 model, a proto or an ``onnx_ir`` model (left as it was).
        data: One feed dict, a list of them, or any iterable (generator) of them.
        observer: ``"absmax"``, ``"minmax"`` (both via in-graph reductions) or
            ``"histogram"`` (tensors fetched, ``bins`` counters of ``|x|`` each).
        bins: Histogram bins.
        chunk_size: Most tensors fetched per ORT session, to bound memory.
        threads: ORT intra-op thread count.
        external: Arrays of initializers that ``model`` holds as in-memory placeholders
            (see :func:`mixprec.io.protos.weightless_proto`).
        shapes_out: When given, filled with the first sample's shape of each tensor.
        channel_means: Tensor -> channel axis: also average each sample's per-channel
            mean of these (``result.channel_means``).
        channel_absmax: Tensor -> channel axis: also their per-channel ``max |x|``.
        rows: Tensor -> count: also keep up to ``count`` rows of each sample (fetched whole).
        only: Measure only these tensors (graph inputs, node outputs, weights), not all.

    Returns:
        The :class:`CalibrationResult` (``.stats``, ``.shapes``, ``.samples``,
        ``.absmax()``).

    Raises:
        MixprecError: Bad arguments, no sample, a sample missing an input, or the model
            itself cannot be loaded or run.

    Example:
        >>> result = calibrate(proto, (load(f) for f in files), observer="minmax")  # doctest: +SKIP
        >>> result.samples, result.stats["conv_out"].max                            # doctest: +SKIP
    """
    # (Over 80 lines only because of the docstring; the steps are the helpers above.)
    if chunk_size < 1:
        raise MixprecError(f"chunk size must be a positive integer, got {chunk_size}")
    make_observer(observer, bins)  # checks the kind and the bins
    samples = calibration_feeds(data)
    if samples is None:
        raise MixprecError("calibration needs data: a dict of input arrays or an iterable")
    ext = dict(external or {})
    # Read for types, constants and inputs; probes are added only while serializing.
    work = model if isinstance(model, ir.Model) else ir.from_proto(model)
    result = CalibrationResult(observer=observer)
    result.stats.update(static_stats(work, ext, observer, bins, only))
    candidates = [c for c in _candidates(work, set(result.stats)) if only is None or c[0] in only]
    observed = _Observed(observer, bins, result.shapes)
    observed.mean_axes = dict(channel_means or {})
    observed.want_channels(channel_absmax, rows)
    runner = _SampleRunner(
        work,
        candidates,
        chunk_size=chunk_size,
        threads=threads,
        external=ext,
        use_probes=not OBSERVERS[observer].needs_data,
        means=channel_means,
        absmax=channel_absmax,
        fetch=set(rows or {}),
    )
    try:
        for sample in samples:
            feeds = feeds_for(work, sample)
            for name in feeds.keys() if only is None else feeds.keys() & only:
                observed.array(name, feeds[name])
            runner.measure(feeds, observed)
            result.samples += 1
    finally:
        runner.close()
    if result.samples == 0:
        raise MixprecError("calibration data holds no sample")
    result.stats.update({name: obs.stats() for name, obs in observed.observers.items()})
    result.channel_means = observed.means()
    result.channel_absmax, result.rows = observed.channel_results()
    if shapes_out is not None:
        shapes_out.update(result.shapes)
    return result


def collect_absmax(
    model: onnx.ModelProto,
    data: Feeds | Iterable[Feeds],
    *,
    chunk_size: int = 2000,
    threads: int = 2,
    shapes_out: dict[str, list[int]] | None = None,
    external: Mapping[str, np.ndarray] | None = None,
) -> dict[str, float]:
    """``max(|x|)`` of every float tensor over all samples: ``calibrate(...).absmax()``.

    Args:
        model: The FP32 model (not modified).
        data: One feed dict or an iterable of them.
        chunk_size: Most tensors fetched per ORT session.
        threads: ORT intra-op thread count.
        shapes_out: When given, filled with the first sample's tensor shapes.
        external: Arrays of in-memory placeholder initializers.

    Returns:
        Absmax by tensor name.
    """
    return calibrate(
        model,
        data,
        chunk_size=chunk_size,
        threads=threads,
        shapes_out=shapes_out,
        external=external,
    ).absmax()


class _Handed(_Observed):
    """Hands each fetched tensor of the current sample to a callback instead of observing."""

    def __init__(self, consume: Callable[[int, str, np.ndarray], None]) -> None:
        super().__init__("absmax", DEFAULT_BINS, {})
        self.consume = consume
        self.index = 0

    def array(self, name: str, array: np.ndarray) -> None:
        self.consume(self.index, name, np.asarray(array))


def stream_tensors(
    model: ir.Model,
    samples: Iterable[Feeds],
    names: Sequence[str],
    consume: Callable[[int, str, np.ndarray], None],
    *,
    threads: int = 2,
    chunk_size: int = 2000,
    external: Mapping[str, np.ndarray] | None = None,
) -> int:
    """Runs the FP32 ``model`` on each sample and calls ``consume(sample_index, name, array)``
    for each float tensor of ``names`` (graph inputs from the feeds; the others fetched
    as :func:`calibrate` fetches them: in chunks of about :data:`FETCH_BYTES`, bisected
    when ONNX Runtime refuses one). Each array is dropped once ``consume`` returns, so
    memory holds one sample's fetched chunk at a time. Names that are not float tensors
    of the main graph are skipped. Returns the number of samples run.
    """
    wanted = set(names)
    inputs = {v.name for v in model.graph.inputs if v.name}
    candidates = [(n, t) for n, t in _candidates(model, inputs) if n in wanted]
    handed = _Handed(consume)
    runner = _SampleRunner(
        model,
        candidates,
        chunk_size=chunk_size,
        threads=threads,
        external=dict(external or {}),
        use_probes=False,
    )
    try:
        for sample in samples:
            feeds = feeds_for(model, sample)
            for name in wanted & inputs:
                if name in feeds and is_float_array(feeds[name]):
                    consume(handed.index, name, np.asarray(feeds[name]))
            if candidates:
                runner.measure(feeds, handed)
            handed.index += 1
    finally:
        runner.close()
    return handed.index
