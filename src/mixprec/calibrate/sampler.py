"""One calibration sample's tensors measured: in-graph probes first, fetching for the rest.

:class:`SampleRunner` runs the FP32 model on one sample at a time and hands what it
measures to :class:`Observed`, the observers of one calibration run by tensor name:

* every float tensor is measured by ``ReduceMin``/``ReduceMax`` probes placed right
  after its producer (:class:`~mixprec.calibrate.probes.ProbeSession`: one ONNX Runtime
  session, built once, run once per sample; no full-size intermediate leaves it); for a
  histogram, the probes also give a :class:`~mixprec.calibrate.probes.Subsample` of each
  tensor's values and its exact largest ``|x|`` (a tensor no larger than half the
  sample is taken whole, and counted as fetched);
* tensors holding NaN, and models the probes cannot run in, fetch the tensors as extra
  graph outputs, in chunks of at most ``chunk_size`` tensors and about
  :data:`FETCH_BYTES` (sizes learnt from the first sample), bisecting a chunk that ONNX
  Runtime refuses.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper

from mixprec.calibrate.observers import (
    OBSERVERS,
    ChannelObserver,
    HistogramObserver,
    Observer,
    is_float_array,
    make_observer,
)
from mixprec.calibrate.probe_nodes import sample_indices
from mixprec.calibrate.probes import ProbeSession, Subsample, VariantRunner
from mixprec.core.batching import runs_within
from mixprec.core.errors import MixprecError
from mixprec.io.external import DATA_FOLDER
from mixprec.io.protos import weightless_proto

__all__ = ["FETCH_BYTES", "Observed", "SampleRunner"]

logger = logging.getLogger(__name__)

# Bisection depth when a fetched chunk fails in ONNX Runtime.
_MAX_BISECT_DEPTH = 12
#: Bytes of fetched tensors per ONNX Runtime run (each fetched tensor stays alive until
#: the run returns); tensors of unknown size count as FETCH_BYTES / 32.
FETCH_BYTES = 128 << 20


class Observed:
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

    @property
    def needs_data(self) -> bool:
        """Whether the observers need more than each tensor's min and max."""
        return OBSERVERS[self.kind].needs_data

    def reduced(self, name: str, lo: float, hi: float, shape: list[int]) -> None:
        self.shapes.setdefault(name, shape)
        self._observer(name).update_range(lo, hi)

    def sampled(
        self,
        name: str,
        ranges: tuple[float, float, list[int]],
        sample: np.ndarray,
        top: np.ndarray,
        positions: np.ndarray,
    ) -> None:
        """One sample's tensor known by its (min, max, shape), a sample of its values at
        ``positions`` and its largest ``|x|``: counted whole when the sample holds every
        value, else as :meth:`HistogramObserver.update_sample` estimates."""
        lo, hi, shape = ranges
        self.shapes.setdefault(name, shape)
        observer = self._observer(name)
        if not isinstance(observer, HistogramObserver):
            observer.update_range(lo, hi)
            return
        count = math.prod(shape)
        whole = _whole(sample, sample_indices(positions, count), count)
        if whole is not None:
            observer.update(whole)
        else:
            observer.update_sample(lo, hi, count, sample, top)

    def record(self, outs: dict[str, np.ndarray], wanted: set[str]) -> None:
        """Observes the wanted arrays of ``outs`` and drops each one right away."""
        for name in list(outs):
            array = outs.pop(name)
            self.nbytes[name] = int(array.nbytes)
            if name in wanted:
                self.array(name, array)


def _whole(sample: np.ndarray, indices: np.ndarray, count: int) -> np.ndarray | None:
    """The flattened tensor of ``count`` values when ``sample`` (taken at ``indices``)
    holds every one of them, else None."""
    # indices rise with the sorted positions: all are taken when none is skipped
    if count > len(sample) or indices[0] != 0 or indices[-1] != count - 1:
        return None
    if count > 1 and np.diff(indices).max() > 1:
        return None
    whole = np.empty(count, np.float32)
    whole[indices] = sample
    return whole


class SampleRunner:
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
        subsample: Subsample | None = None,
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
        self._subsample = subsample
        self._probe: ProbeSession | None = None
        self._runner: VariantRunner | None = None

    def close(self) -> None:
        self._probe = None
        if self._runner is not None:
            self._runner.close()
            self._runner = None

    def measure(self, feeds: Mapping[str, np.ndarray], observed: Observed) -> None:
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
                subsample=self._subsample,
            )
            self._use_probes = self._probe is not None
        if self._probe is not None:
            try:
                reduced = self._probe.run(feeds)
            except MixprecError as e:
                logger.debug("range analysis: probes failed on a sample (%s); fetching", e)
            else:
                pending = self._probed(self._probe, reduced, observed)
        if pending:
            self._fetch(pending, feeds, observed)

    def _probed(
        self,
        probe: ProbeSession,
        reduced: Mapping[str, tuple[float, float, list[int]]],
        observed: Observed,
    ) -> list[tuple[str, ir.DataType]]:
        """Observes what the probe run gave; returns the candidates left to fetch."""
        for name, mean in probe.last_means.items():
            observed.channel_mean(name, mean)
        for name, absmax in probe.last_absmax.items():
            observed.channels[name].update_absmax(absmax)
        for name, array in probe.last_fetched.items():
            channel = observed.channels[name]
            if name in probe.last_absmax:
                channel.update_rows(array)
            else:  # no probe (rank unknown): from the fetched tensor
                channel.update(array)
        pending = []
        for name, dtype in self._candidates:
            lo, hi, shape = reduced.get(name, (math.nan, math.nan, []))
            sample = probe.last_samples.get(name)
            if math.isnan(lo) or math.isnan(hi):  # NaN inside: measured by fetching
                pending.append((name, dtype))
            elif sample is not None:
                observed.sampled(name, (lo, hi, shape), *sample, probe.last_positions)
            elif observed.needs_data:
                pending.append((name, dtype))
            else:
                observed.reduced(name, lo, hi, shape)
        return pending

    def _fetch(
        self,
        pending: list[tuple[str, ir.DataType]],
        feeds: Mapping[str, np.ndarray],
        observed: Observed,
    ) -> None:
        if self._runner is None:
            # The fallback runs protos: large weights as in-memory placeholders.
            folder = self._model.meta.get(DATA_FOLDER)
            proto, arrays = weightless_proto(self._model, data_folder=folder)
            self._external.update(arrays)
            self._runner = VariantRunner(proto, self._threads, self._external, folder)
            if self._probe is None:
                # The model as it is must load (a probe session, which loaded, says it
                # does): a variant that makes a tensor an output drops that tensor's
                # declared shape, so one may load where the model does not (a declared
                # dim 0 that ORT's Reshape inference refuses), and every other variant
                # then fails, tensor by tensor. Raises when ONNX Runtime refuses it.
                self._runner.run(self._runner.original_outputs, feeds)
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
        observed: Observed,
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

    def size(item: tuple[str, ir.DataType]) -> int:
        return nbytes.get(item[0], FETCH_BYTES // 32)

    return runs_within(pending, size, FETCH_BYTES, most) or [[]]


def _value_infos(items: Sequence[tuple[str, ir.DataType]]) -> list[onnx.ValueInfoProto]:
    return [helper.make_tensor_value_info(name, int(dtype), None) for name, dtype in items]
