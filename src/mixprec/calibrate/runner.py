"""Range calibration: run the FP32 model on a stream of samples and observe every tensor.

:func:`calibrate` takes one feed dict, a list, or any iterable (a generator) of feed
dicts and consumes it one sample at a time: memory does not grow with the number of
samples. Per sample:

* graph inputs are observed from the feeds;
* every float tensor of the main graph is measured in ONNX Runtime
  (:class:`~mixprec.calibrate.sampler.SampleRunner`: in-graph probes, fetching where
  they cannot serve).

Initializers and Constant tensors (subgraphs included) are observed once from their
data, with per-output-channel min/max for weights (:mod:`mixprec.calibrate.static`); no
ORT run is needed for them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_ir as ir

from mixprec.calibrate.observers import (
    DEFAULT_BINS,
    OBSERVERS,
    TensorStats,
    is_float_array,
    make_observer,
)
from mixprec.calibrate.probes import Subsample
from mixprec.calibrate.sampler import Observed, SampleRunner
from mixprec.calibrate.static import static_stats
from mixprec.core.errors import MixprecError
from mixprec.core.graphs import is_constant_node
from mixprec.core.ops import FLOAT_TYPES
from mixprec.inputs.feeds import Feeds, calibration_feeds, feeds_for
from mixprec.passes.emulate import element_types

#: Values each tensor gives a histogram per sample (``calibrate(subsample=...)``).
SUBSAMPLE = Subsample().size

__all__ = ["CalibrationResult", "calibrate", "collect_absmax", "stream_tensors"]

logger = logging.getLogger(__name__)


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
    subsample: int = SUBSAMPLE,
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
            ``"histogram"`` (``bins`` counters of ``|x|`` each, from in-graph samples
            unless ``subsample`` is 0).
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
        subsample: Histogram: values per tensor and sample, at random positions, beside
            its exact min, max and largest ``|x|`` (one ORT run per sample); 0 fetches
            every tensor whole (exact counts, several runs and copies per sample).

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
    # (Over 80 lines only because of the docstring; the steps are helpers.)
    if chunk_size < 1 or subsample < 0:
        raise MixprecError(f"bad chunk size {chunk_size} or subsample {subsample}")
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
    needs_data = OBSERVERS[observer].needs_data
    sampled = Subsample(subsample) if needs_data and subsample else None
    observed = Observed(observer, bins, result.shapes)
    observed.mean_axes = dict(channel_means or {})
    observed.want_channels(channel_absmax, rows)
    runner = SampleRunner(
        work,
        candidates,
        chunk_size=chunk_size,
        threads=threads,
        external=ext,
        use_probes=sampled is not None or not needs_data,
        subsample=sampled,
        means=channel_means,
        absmax=channel_absmax,
        fetch=set(rows or {}),
    )
    result.samples = _observe_samples(work, samples, runner, observed, only)
    if result.samples == 0:
        raise MixprecError("calibration data holds no sample")
    result.stats.update({name: obs.stats() for name, obs in observed.observers.items()})
    result.channel_means = observed.means()
    result.channel_absmax, result.rows = observed.channel_results()
    if shapes_out is not None:
        shapes_out.update(result.shapes)
    return result


def _observe_samples(
    model: ir.Model,
    samples: Iterable[Feeds],
    runner: SampleRunner,
    observed: Observed,
    only: Collection[str] | None,
) -> int:
    """Measures every sample (graph inputs from the feeds); returns how many ran."""
    count = 0
    try:
        for sample in samples:
            feeds = feeds_for(model, sample)
            for name in feeds.keys() if only is None else feeds.keys() & only:
                observed.array(name, feeds[name])
            runner.measure(feeds, observed)
            count += 1
    finally:
        runner.close()
    return count


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


class _Handed(Observed):
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
    as :func:`calibrate` fetches them: in chunks of about
    :data:`~mixprec.calibrate.sampler.FETCH_BYTES`, bisected
    when ONNX Runtime refuses one). Each array is dropped once ``consume`` returns, so
    memory holds one sample's fetched chunk at a time. Names that are not float tensors
    of the main graph are skipped. Returns the number of samples run.
    """
    wanted = set(names)
    inputs = {v.name for v in model.graph.inputs if v.name}
    candidates = [(n, t) for n, t in _candidates(model, inputs) if n in wanted]
    handed = _Handed(consume)
    runner = SampleRunner(
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
