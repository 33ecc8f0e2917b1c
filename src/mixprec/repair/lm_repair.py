"""The language-model guard's repair by sensitivity (:mod:`mixprec.repair.language_guard`'s
module doc): the quantized linear layers, most sensitive first (the run's own ranking,
:func:`recorded_ranking`, else :func:`rank_for_repair`), go to 8 bits in steps
(:data:`REPAIR_SHARES`), then to float in the steps that fit the size budget, each step
quantized again and checked (a step that changes nothing, or repeats one, is not), the
first passing step narrowed by :data:`BISECT_ROUNDS` halvings."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Protocol

import onnx_ir as ir

from mixprec.inputs.feeds import Feeds
from mixprec.pipeline.streamed import Source
from mixprec.pipeline.weight_only import GuardContext, WeightsReport, let_go
from mixprec.tune.moves import Move, climb, halvings
from mixprec.weights.config import LayerChoice, WeightsConfig
from mixprec.weights.mixed_bits import LayerScore, SizeBudget, rank_layers, recorded_scores

__all__ = [
    "BISECT_ROUNDS",
    "REPAIRED",
    "REPAIR_SHARES",
    "Candidate",
    "Checker",
    "Repair",
    "quantized_linear",
    "rank_for_repair",
    "recorded_ranking",
]

#: How a promoted layer's reason starts.
REPAIRED = "guard repair"
#: The repair's steps: these shares of the ranked int4 layers go to 8 bits, then float.
REPAIR_SHARES = (0.125, 0.25, 0.5, 1.0)
#: After the first passing step, this many halvings of the span between it and the
#: failing step before it look for fewer promoted layers (each a quantization and a
#: check: on SmolLM2-135M about 10 s).
BISECT_ROUNDS = 3


class Checker(Protocol):
    """What the repair reads of the guard: a candidate's measures and their misses."""

    def measure(self, model: ir.Model) -> dict[str, Any]: ...

    def misses(self, stats: dict[str, Any], budget: Any) -> list[str]: ...


def quantized_linear(report: WeightsReport) -> dict[str, str]:
    """The weight-quantized MatMuls (not the lm_head) and their precision."""
    return {
        n.name: n.precision
        for n in report.nodes
        if n.op_type == "MatMul" and n.precision in ("int4", "int8") and n.op_class == "linear"
    }


def rank_for_repair(
    source: Source,
    config: WeightsConfig,
    samples: Sequence[Feeds] | None,
    names: Sequence[str],
    *,
    streamed: bool = False,
) -> tuple[list[LayerScore], str]:
    """The repair's seam: ``names`` (quantized linear MatMuls of ``source``), most
    sensitive first, each with its score and its cost in bytes, and what the score is:
    the output error 8 bits saves per weight on ``samples``, calibration windows apart
    from the check windows (:func:`mixprec.weights.mixed_bits.rank_layers`; ``streamed``:
    the layer inputs tapped from the model run in pieces); ``samples`` None (no
    calibration data): the weight error 8 bits saves per weight."""
    wanted = set(names)
    scores = rank_layers(source, config, samples, streamed=streamed)
    ranked = [s for s in scores if s.name in wanted]
    let_go(source)  # the ranking's graph copy and its X^T X sums
    if samples is None:
        return ranked, "weight error 8 bits saves per weight (no layer inputs read)"
    return ranked, "output error 8 bits saves per weight on calibration windows"


def recorded_ranking(
    model: ir.Model | None, report: WeightsReport, config: WeightsConfig, names: Sequence[str]
) -> tuple[list[LayerScore], str] | None:
    """The run's own ranking of ``names``, where its mixed choice recorded one for every
    one of them (``report``'s ``mixed`` section; ``model``, the run's quantized model,
    gives each layer's K and N): no second pass over the data and no second set of
    ``X^T X`` sums. None where there is none (8-bit weights, no mixed choice)."""
    mixed = (report.quantization or {}).get("mixed")
    scores = mixed.get("scores") if isinstance(mixed, dict) else None
    if model is None or not isinstance(scores, dict) or not set(names) <= set(scores):
        return None
    shapes = {
        node.name or "": (node.attributes.get_int("K", 0), node.attributes.get_int("N", 0))
        for node in model.graph
        if node.op_type == "MatMulNBits" and node.name in scores
    }
    if not set(names) <= set(shapes):
        return None
    ranked = recorded_scores({n: float(scores[n]) for n in names}, shapes, config)
    basis = str(mixed.get("basis")) if isinstance(mixed, dict) else ""
    per_weight = "output error" if basis.startswith("output") else "weight error"
    return ranked, f"the run's ranking: {per_weight} 8 bits saves per weight"


def _steps(count: int, int4: bool) -> list[tuple[int, str]]:
    """(how many of the ranked layers, to what) per repair step: 8 bits first where some
    are int4, then float."""
    if not count:
        return []
    counts = sorted({max(1, math.ceil(count * s)) for s in REPAIR_SHARES})
    return ([(k, "int8") for k in counts] if int4 else []) + [(k, "float") for k in counts]


def _moves(ranked: list[LayerScore], to: str) -> list[Move]:
    """The ranked layers to ``to`` ("int8" or "float"), each costing the bytes it adds
    over 4 bits."""
    return [Move(s.name, to, s.score, s.extra8 if to == "int8" else s.extra_float) for s in ranked]


def _layers(
    moves: list[Move], now: dict[str, str], k: int, what: str, missed: str
) -> dict[str, LayerChoice]:
    """The first ``k`` moves made (to int8: of the layers at int4 now); with moves to
    float, the rest of the int4 layers at 8 bits (the 8-bit steps before it all missed)."""
    layers = {}
    for rank, move in enumerate(moves, 1):
        precision = move.to if rank <= k else "int8"
        if precision == now.get(move.name) or (rank > k and move.to == "int8"):
            continue
        why = (
            f"{REPAIRED}: sensitivity rank {rank} of {len(moves)} ({what} {move.score:.3g});"
            f" {missed}"
        )
        layers[move.name] = LayerChoice(precision, why)
    return layers


def _cost(ranked: list[LayerScore], now: dict[str, str], layers: dict[str, LayerChoice]) -> int:
    """The bytes a step's layer choices add to the model as it is now."""
    extra = {s.name: {"int4": 0, "int8": s.extra8, "float": s.extra_float} for s in ranked}
    return sum(
        extra[name][choice.precision] - extra[name].get(now.get(name, "int4"), 0)
        for name, choice in layers.items()
        if name in extra
    )


Candidate = tuple[ir.Model | None, WeightsReport, dict[str, Any], list[str]]


class Repair:
    """The repair of weight-only layers to 8 bits, then to float
    (:class:`mixprec.tune.moves.Moves`: a move's cost is the bytes it adds; module doc):
    the ranked layers promoted in growing steps until one passes, then bisected between
    that step and the failing one before it (:data:`BISECT_ROUNDS`), so no more layers
    than needed leave 4 bits. ``best`` is the passing candidate with the fewest promoted
    layers, ``chosen`` its step; while none passes, the last one measured (the first
    measure before any step). A streamed run keeps only the best's config while it
    quantizes another candidate (two quantized models of a large model need not fit),
    and quantizes it again at the end if needed."""

    def __init__(
        self, checker: Checker, budget: object, context: GuardContext, first: Candidate
    ) -> None:
        self.checker, self.budget, self.context = checker, budget, context
        self.best = first
        self.best_config = context.config
        self.steps: list[dict[str, Any]] = []
        #: each step's layer choices measured, and whether they passed
        self.tried: dict[frozenset[tuple[str, str]], bool] = {}
        self.chosen: dict[str, Any] | None = None
        #: what the size budget kept the repair from trying (None: nothing)
        self.limit: str | None = None
        #: the moves of the phase under way (to 8 bits, then to float), most sensitive first
        self.moves: list[Move] = []
        self.now: dict[str, str] = {}
        self.why = ("", "")  # what ranks the layers, what the first check missed

    def run(self, now: dict[str, str]) -> None:
        context = self.context
        # ranked on calibration windows, graded on the check windows: a ranking fitted to
        # the windows that judge it would make a narrow pass there look surer than it is
        found = recorded_ranking(self.best[0], self.best[1], context.config, list(now))
        ranked, what = found or rank_for_repair(
            context.source,
            context.config,
            context.rank_samples,
            list(now),
            streamed=context.runs.streamed,
        )
        self.now, self.why = now, (what, "; ".join(self.best[3]))
        ranked, steps = self._affordable(ranked, now)
        for to in ("int8", "float"):
            counts = [k for k, t in steps if t == to]
            if not counts:
                continue
            self.moves = _moves(ranked, to)
            if climb(self, counts, halvings(BISECT_ROUNDS)) is not None:
                return

    def _affordable(
        self, ranked: list[LayerScore], now: dict[str, str]
    ) -> tuple[list[LayerScore], list[tuple[int, str]]]:
        """The ranked layers and steps within the run's size budget
        (:mod:`mixprec.weights.mixed_bits`): the layers, in rank order, that fit at 8
        bits together (one that does not is passed over, as the mixed choice does),
        shares of them to 8 bits, then the float steps of them that fit. Without a
        budget (8-bit weights), every layer and step; ``limit`` says what it cut."""
        mixed = (self.best[1].quantization or {}).get("mixed")
        size = SizeBudget.of(mixed)
        if size is None or not isinstance(mixed, dict):
            return ranked, _steps(len(ranked), "int4" in now.values())
        room = size.goal_bytes - int(mixed.get("estimated_bytes", size.base_bytes))
        fit: list[LayerScore] = []
        spent, promoted = 0, 0
        left = size.most_layers
        if left is not None:  # the default budget's count of layers at 8 bits
            left -= sum(1 for p in now.values() if p != "int4")
        for layer in ranked:
            at4 = now.get(layer.name) == "int4"
            extra = layer.extra8 if at4 else 0
            if at4 and left is not None and promoted >= left:
                continue
            if spent + extra <= room:
                fit.append(layer)
                spent += extra
                promoted += at4
        steps = [
            (k, to)
            for k, to in _steps(len(fit), any(now.get(s.name) == "int4" for s in fit))
            if _cost(fit, now, _layers(_moves(fit, to), now, k, "", "")) <= room
        ]
        int4 = [name for name, p in now.items() if p == "int4"]
        if promoted < len(int4):
            self.limit = (
                f"the size budget ({size.goal_bytes / 1e6:.2f} MB, "
                f"{size.goal_bytes / size.float_bytes:.3f}x FP32: {size.rule}) has room for "
                f"{promoted} of {len(int4)} int4 layers at 8 bits (--max-size to allow more)"
            )
        return fit, steps

    def grade(self, k: int) -> bool:
        """Quantize and measure the first ``k`` moves made; the candidate becomes
        ``best`` when it passes (or while nothing has)."""
        layers = _layers(self.moves, self.now, k, *self.why)
        key = frozenset((name, c.precision) for name, c in layers.items())
        if not layers or key in self.tried:  # the model as it was, or a step made already
            return bool(layers) and self.tried[key]
        config = self.context.config
        config = dataclasses.replace(config, layers={**config.layers, **layers})
        if self.context.runs.streamed:
            self.best = (None, *self.best[1:])
        model, report = self.context.requantize(config)
        stats = self.checker.measure(model)
        misses = self.checker.misses(stats, self.budget)
        self.steps.append({"layers": k, "to": self.moves[0].to, **stats, "passed": not misses})
        self.tried[key] = not misses
        if not misses or self.best[3]:
            self.best = (model, report, stats, misses)
            self.best_config = config
            self.chosen = self.steps[-1]
        return not misses

    def final(self) -> tuple[ir.Model, WeightsReport, dict[str, Any], list[str]]:
        """The best candidate, quantized again from its config if it was let go."""
        model, report, stats, misses = self.best
        if model is None:
            model, report = self.context.requantize(self.best_config)
        return model, report, stats, misses
