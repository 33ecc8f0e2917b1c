"""The language-model guard of weight-only quantization, and its repair by sensitivity.

A language model here takes ``input_ids`` and has an output ``logits`` whose last axis is
the vocabulary. On the check windows (held out of the calibration text by the guard's
seeded draw, or ``eval_data``), the guard runs the FP32 and the quantized model and
compares the next-token distributions at every position but the last:

* mean KL(P_fp32 || P_quantized) in nats per token;
* top-1 next-token agreement (the share of positions where both pick the same token);
* perplexity of each (exp of the mean negative log-likelihood of the window's own next
  token), and its relative rise; only where the windows are real tokens (text or given
  samples), not a generated input;
* greedy continuations: how many windows' greedy continuation (16 tokens after the first
  32) stays FP32's, read from one run of the candidate (:mod:`mixprec.guard.greedy`);
  reported on the last line, not a budget (three or four windows are too few to hold a
  share of them to).

A miss is repaired: the quantized linear layers, most sensitive first
(:func:`rank_for_repair`), go to 8 bits in steps (1/8, 1/4, 1/2, all of those the size
budget has room for), then to float in the steps that fit (the lm_head and embeddings
keep their precision), each step quantized again (``context.requantize``) and checked,
until the budgets are met or the steps run out. The first step that passes is then
narrowed: the span between it and the failing step before it is halved
:data:`BISECT_ROUNDS` times, and the passing candidate with the fewest promoted layers
is kept (``repaired_with`` in the guard's record). A miss after all steps leaves
``passed`` False (the CLI writes nothing and exits 1, as the INT8 guard). The repair
ranks layers on calibration windows and is graded on the check windows (held out of the
calibration text, or ``eval_data``), never the same ones; with no calibration data the
ranking reads no windows (the weights' own error).

Budgets (:data:`DEFAULT_MAX_KL`, :data:`DEFAULT_MAX_DROP`, :data:`DEFAULT_MAX_PPL_RISE`
for 8-bit weights, :data:`INT4_BUDGET` for 4-bit) were chosen on SmolLM2-135M
(docs/guides/weights.md): int8 everywhere is well inside the first; 4-bit AWQ within the
default size budget inside the second; int4 RTN without repair outside both. The repair
never leaves the run's size budget (:mod:`mixprec.weights.sensitivity`): a miss at that
size is reported as a miss.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from mixprec.guard.greedy import TOKENS as GREEDY_TOKENS
from mixprec.guard.greedy import Continuations
from mixprec.guard.samples import MAX_HELD_OUT, WINDOWS_HELD_OUT_SHARE, split_for_guard
from mixprec.inputs.feeds import Feeds, feeds_for
from mixprec.inputs.signature import declared_dims, graph_inputs
from mixprec.pipeline.streamed import Source
from mixprec.pipeline.weights import GuardContext, WeightsGuard, WeightsReport, let_go
from mixprec.weights.config import LayerChoice, WeightsConfig
from mixprec.weights.sensitivity import LayerScore, SizeBudget, rank_layers

__all__ = [
    "DEFAULT_MAX_DROP",
    "DEFAULT_MAX_KL",
    "DEFAULT_MAX_PPL_RISE",
    "INT4_BUDGET",
    "LOGITS",
    "LmBudget",
    "cache_note",
    "is_language_model",
    "language_model_guard",
    "lm_guard",
    "next_token_stats",
    "rank_for_repair",
]

#: The output whose last axis is the vocabulary.
LOGITS = "logits"
#: Default budgets of 8-bit weights (module doc): mean KL per token in nats ...
DEFAULT_MAX_KL = 0.03
#: ... the accepted drop of top-1 next-token agreement below 1 ...
DEFAULT_MAX_DROP = 0.2
#: ... and the accepted relative rise of perplexity.
DEFAULT_MAX_PPL_RISE = 0.03
#: The same for 4-bit weights (KL, drop, perplexity rise): what a 4-bit model of a small
#: LM reaches by method within the default size budget, on SmolLM2-135M with AWQ: KL
#: 0.16, agreement 0.79, perplexity +8% with every linear layer at 4 bits
#: (docs/guides/weights.md); round to nearest (KL 0.37, +31%) misses them.
INT4_BUDGET = (0.25, 0.3, 0.10)
#: How a promoted layer's reason starts.
REPAIRED = "guard repair"
#: The repair's steps: these shares of the ranked int4 layers go to 8 bits, then float.
REPAIR_SHARES = (0.125, 0.25, 0.5, 1.0)
#: After the first passing step, this many halvings of the span between it and the
#: failing step before it look for fewer promoted layers (each a quantization and a
#: check: on SmolLM2-135M about 10 s).
BISECT_ROUNDS = 3


@dataclasses.dataclass(frozen=True)
class LmBudget:
    """What the quantized model must keep: mean KL <= ``max_kl``, agreement >=
    ``1 - max_drop``, perplexity <= FP32's x (1 + ``max_ppl_rise``)."""

    max_kl: float = DEFAULT_MAX_KL
    max_drop: float = DEFAULT_MAX_DROP
    max_ppl_rise: float = DEFAULT_MAX_PPL_RISE

    @classmethod
    def of(cls, config: WeightsConfig) -> LmBudget:
        """The config's budgets, the defaults of its bits where it sets none."""
        kl, drop, rise = (
            INT4_BUDGET
            if config.bits == 4
            else (DEFAULT_MAX_KL, DEFAULT_MAX_DROP, DEFAULT_MAX_PPL_RISE)
        )
        return cls(
            kl if config.guard_kl is None else config.guard_kl,
            drop if config.guard_drop is None else config.guard_drop,
            rise if config.guard_perplexity is None else config.guard_perplexity,
        )


def is_language_model(model: ir.Model) -> bool:
    """It takes ``input_ids`` and outputs ``logits`` of rank 3 (or undeclared rank)."""
    if not any(v.name == "input_ids" for v in graph_inputs(model)):
        return False
    for output in model.graph.outputs:
        if output.name == LOGITS:
            dims = declared_dims(output)
            return dims is None or len(dims) == 3
    return False


def cache_note(model: ir.Model) -> str | None:
    """The note for a language model without a KV cache (no input named ``past...``),
    else None."""
    if not is_language_model(model):
        return None
    if any("past" in (v.name or "") for v in graph_inputs(model)):
        return None
    return (
        "a decoder without a KV cache (no past_key_values inputs): quantized and guarded "
        "as any; generating runs the whole sequence again for each token"
    )


def _log_softmax(logits: np.ndarray, in_place: bool = False) -> np.ndarray:
    """Log-probabilities along the last axis (float32); ``in_place``: written over
    ``logits`` where they are float32 and writable."""
    x = logits.astype(np.float32, copy=False)
    if not (in_place and x.flags.writeable):
        shifted = x - x.max(axis=-1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    x -= x.max(axis=-1, keepdims=True)
    for row in x.reshape(-1, x.shape[-1]):  # one row's exp at a time, not the window's
        row -= np.log(np.exp(row).sum())
    return x


def next_token_stats(
    reference: np.ndarray, logits: np.ndarray, ids: np.ndarray
) -> dict[str, float]:
    """Sums over the positions but the last of one window (``[batch, seq, vocab]``
    log-probabilities ``reference`` of FP32, raw ``logits`` of the model, ``ids``
    ``[batch, seq]``): ``kl``, ``agree``, ``nll_fp32``, ``nll``, ``tokens``. Read
    :data:`_POSITIONS` positions at a time: a window of 256 tokens over a 262k vocabulary is
    268 MB of logits, and each whole-window temporary would be as large."""
    total = dict.fromkeys(("kl", "agree", "nll_fp32", "nll", "tokens"), 0.0)
    last = logits.shape[1] - 1
    for start in range(0, last, _POSITIONS):
        span = slice(start, min(start + _POSITIONS, last))
        logq = _log_softmax(logits[:, span])
        logp = reference[:, span]
        target = ids[:, 1:][:, span, None].astype(np.int64)
        total["kl"] += float((np.exp(logp) * (logp - logq)).sum(dtype=np.float64))
        total["agree"] += float((logp.argmax(-1) == logq.argmax(-1)).sum())
        total["nll_fp32"] -= float(np.take_along_axis(logp, target, -1).sum(dtype=np.float64))
        total["nll"] -= float(np.take_along_axis(logq, target, -1).sum(dtype=np.float64))
        total["tokens"] += float(target.size)
    return total


#: Positions of a window :func:`next_token_stats` reads at once.
_POSITIONS = 32


def _perplexity(nll: float, tokens: float) -> float:
    """``exp(nll / tokens)``; inf where that overflows (a broken model's huge logits)."""
    try:
        return math.exp(nll / tokens)
    except OverflowError:
        return math.inf


class _Checker:
    """The FP32 reference on the check windows, kept once; measures a candidate."""

    def __init__(self, context: GuardContext) -> None:
        self.config = context.config
        self.runs = context.runs
        self.feeds = [feeds_for(context.source, s) for s in context.samples]
        with self.runs.fp32_runner() as run:  # one FP32 session for the steps and windows
            self.greedy = Continuations.of(
                self.feeds, lambda feeds: [np.asarray(o[LOGITS]) for o in run(feeds)]
            )
            fp32 = [np.asarray(out[LOGITS]) for out in run(self.feeds)]
        # in place: a window of 256 tokens over a 262k vocabulary is 268 MB
        self.reference = [_log_softmax(x, in_place=True) for x in fp32]
        del fp32
        self.real_tokens = "generated" not in context.where
        self.where = context.where

    def measure(self, model: ir.Model) -> dict[str, Any]:
        outputs = self.runs.quantized(model, [*self.feeds, *self.greedy.feeds])
        got = [np.asarray(out[LOGITS]) for out in outputs[: len(self.feeds)]]
        greedy = self.greedy.stats([np.asarray(o[LOGITS]) for o in outputs[len(self.feeds) :]])
        total: dict[str, float] = {}
        for ref, logits, f in zip(self.reference, got, self.feeds, strict=True):
            for k, v in next_token_stats(ref, logits, f["input_ids"]).items():
                total[k] = total.get(k, 0.0) + v
        n = max(total.get("tokens", 0.0), 1.0)
        ppl32, ppl = _perplexity(total["nll_fp32"], n), _perplexity(total["nll"], n)
        finite = all(np.isfinite(x).all() for x in got)
        return {
            "kl": total["kl"] / n if finite else math.inf,
            "agreement": total["agree"] / n,
            "perplexity_fp32": ppl32,
            "perplexity": ppl if finite else math.inf,
            "perplexity_rise": (ppl / ppl32 - 1.0) if finite else math.inf,
            "tokens": int(n),
            "windows": len(self.feeds),
            **greedy,
        }

    def misses(self, stats: dict[str, Any], budget: LmBudget) -> list[str]:
        """Why ``stats`` misses ``budget`` (empty: it passes)."""
        why = []
        if not stats["kl"] <= budget.max_kl:
            why.append(f"KL {stats['kl']:.3g} > {budget.max_kl:g} (--max-kl)")
        if stats["agreement"] < 1.0 - budget.max_drop:
            why.append(
                f"agreement {stats['agreement']:.3f} < {1.0 - budget.max_drop:g} (--max-drop)"
            )
        if self.real_tokens and not math.isfinite(stats["perplexity"]):
            why.append(f"perplexity {stats['perplexity']:g}, not finite (--max-perplexity-rise)")
        elif self.real_tokens and not stats["perplexity_rise"] <= budget.max_ppl_rise:
            why.append(
                f"perplexity +{stats['perplexity_rise']:.1%} > +{budget.max_ppl_rise:.0%} "
                "(--max-perplexity-rise)"
            )
        return why


def _quantized_linear(report: WeightsReport) -> dict[str, str]:
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
    from the check windows (:func:`mixprec.weights.sensitivity.rank_layers`; ``streamed``:
    the layer inputs tapped from the model run in pieces); ``samples`` None (no
    calibration data): the weight error 8 bits saves per weight."""
    wanted = set(names)
    scores = rank_layers(source, config, samples, streamed=streamed)
    ranked = [s for s in scores if s.name in wanted]
    let_go(source)  # the ranking's graph copy and its X^T X sums
    if samples is None:
        return ranked, "weight error 8 bits saves per weight (no layer inputs read)"
    return ranked, "output error 8 bits saves per weight on calibration windows"


def _steps(count: int, int4: bool) -> list[tuple[int, str]]:
    """(how many of the ranked layers, to what) per repair step: 8 bits first where some
    are int4, then float."""
    if not count:
        return []
    counts = sorted({max(1, math.ceil(count * s)) for s in REPAIR_SHARES})
    return ([(k, "int8") for k in counts] if int4 else []) + [(k, "float") for k in counts]


def _layers(
    ranked: list[LayerScore],
    now: dict[str, str],
    step: tuple[int, str],
    what: str,
    missed: str,
) -> dict[str, LayerChoice]:
    """The first ``k`` ranked layers at ``to`` (int8: those at int4 now); with ``to``
    float, the rest of the int4 ones at 8 bits (the 8-bit steps before it all missed)."""
    k, to = step
    layers = {}
    for rank, layer in enumerate(ranked, 1):
        precision = to if rank <= k else "int8"
        if precision == now.get(layer.name) or (rank > k and to == "int8"):
            continue
        why = (
            f"{REPAIRED}: sensitivity rank {rank} of {len(ranked)} ({what} {layer.score:.3g});"
            f" {missed}"
        )
        layers[layer.name] = LayerChoice(precision, why)
    return layers


def _cost(ranked: list[LayerScore], now: dict[str, str], layers: dict[str, LayerChoice]) -> int:
    """The bytes a step's layer choices add to the model as it is now."""
    extra = {s.name: {"int4": 0, "int8": s.extra8, "float": s.extra_float} for s in ranked}
    return sum(
        extra[name][choice.precision] - extra[name].get(now.get(name, "int4"), 0)
        for name, choice in layers.items()
        if name in extra
    )


def lm_guard(
    model: ir.Model, report: WeightsReport, context: GuardContext, *, where: str | None = None
) -> tuple[ir.Model, WeightsReport]:
    """The :data:`~mixprec.pipeline.weights.WeightsGuard` of a language model (module
    doc): measure, repair on a miss, and set ``report.guard``; ``where`` names the check
    windows (default: ``context.where``)."""
    if where is not None:
        context = dataclasses.replace(context, where=where)
    checker = _Checker(context)
    budget = LmBudget.of(context.config)
    first = checker.measure(model)
    misses = checker.misses(first, budget)
    repair = _Repair(checker, budget, context, (model, report, first, misses))
    del model  # the repair holds it while it is the best; a streamed one then lets it go
    if misses:
        repair.run(_quantized_linear(report))
    model, report, stats, final_misses = repair.final()
    passed = not final_misses
    report.guard = {
        "passed": passed,
        "kind": "language model",
        "eval": context.where,
        "budget": dataclasses.asdict(budget),
        "first": first,
        **stats,
        "repair": repair.steps,
        "size_limit": repair.limit,
        "repaired_with": repair.chosen,
        "promoted": {
            n.name: [n.precision, n.reason]
            for n in report.nodes
            if n.reason.startswith("guard repair")
        },
        "enforced": True,
        "summary": _summary(report, first, stats, repair, final_misses, checker),
    }
    return model, report


_Candidate = tuple[ir.Model | None, WeightsReport, dict[str, Any], list[str]]


class _Repair:
    """The repair's search (module doc): the ranked layers promoted in growing steps
    until one passes, then bisected between that step and the failing one before it
    (:data:`BISECT_ROUNDS`), so no more layers than needed leave 4 bits. ``best`` is the
    passing candidate with the fewest promoted layers, ``chosen`` its step; while none
    passes, the last one measured (the first measure before any step). A streamed run
    keeps only the best's config while it quantizes another candidate (two quantized
    models of a large model need not fit), and quantizes it again at the end if needed."""

    def __init__(
        self, checker: _Checker, budget: LmBudget, context: GuardContext, first: _Candidate
    ) -> None:
        self.checker, self.budget, self.context = checker, budget, context
        self.best = first
        self.best_config = context.config
        self.steps: list[dict[str, Any]] = []
        self.chosen: dict[str, Any] | None = None
        #: what the size budget kept the repair from trying (None: nothing)
        self.limit: str | None = None

    def run(self, now: dict[str, str]) -> None:
        context = self.context
        # ranked on calibration windows, graded on the check windows: a ranking fitted to
        # the windows that judge it would make a narrow pass there look surer than it is
        ranked, what = rank_for_repair(
            context.source,
            context.config,
            context.rank_samples,
            list(now),
            streamed=context.runs.streamed,
        )
        missed = "; ".join(self.best[3])
        lo = 0
        last_to = ""
        ranked, steps = self._affordable(ranked, now)
        for k, to in steps:
            lo = lo if to == last_to else 0
            last_to = to
            if self._try(ranked, now, (k, to), what, missed):
                self._bisect(ranked, now, (lo, k, to), what, missed)
                return
            lo = k

    def _affordable(
        self, ranked: list[LayerScore], now: dict[str, str]
    ) -> tuple[list[LayerScore], list[tuple[int, str]]]:
        """The ranked layers and steps within the run's size budget
        (:mod:`mixprec.weights.sensitivity`): the layers, in rank order, that fit at 8
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
            if _cost(fit, now, _layers(fit, now, (k, to), "", "")) <= room
        ]
        int4 = [name for name, p in now.items() if p == "int4"]
        if promoted < len(int4):
            self.limit = (
                f"the size budget ({size.goal_bytes / 1e6:.2f} MB, "
                f"{size.goal_bytes / size.float_bytes:.3f}x FP32: {size.rule}) has room for "
                f"{promoted} of {len(int4)} int4 layers at 8 bits (--max-size to allow more)"
            )
        return fit, steps

    def _bisect(
        self,
        ranked: list[LayerScore],
        now: dict[str, str],
        span: tuple[int, int, str],
        what: str,
        missed: str,
    ) -> None:
        lo, hi, to = span
        for _ in range(BISECT_ROUNDS):
            mid = (lo + hi) // 2
            if mid <= lo or mid >= hi:
                return
            if self._try(ranked, now, (mid, to), what, missed):
                hi = mid
            else:
                lo = mid

    def _try(
        self,
        ranked: list[LayerScore],
        now: dict[str, str],
        step: tuple[int, str],
        what: str,
        missed: str,
    ) -> bool:
        """Quantize and measure one step; it becomes ``best`` when it passes (or while
        nothing has)."""
        layers = _layers(ranked, now, step, what, missed)
        config = self.context.config
        config = dataclasses.replace(config, layers={**config.layers, **layers})
        if self.context.runs.streamed:
            self.best = (None, *self.best[1:])
        model, report = self.context.requantize(config)
        stats = self.checker.measure(model)
        misses = self.checker.misses(stats, self.budget)
        self.steps.append({"layers": step[0], "to": step[1], **stats, "passed": not misses})
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


def _measured(stats: dict[str, Any], real_tokens: bool) -> str:
    text = f"KL {stats['kl']:.3g}, agreement {stats['agreement']:.3f}"
    if real_tokens:
        text += (
            f", perplexity {stats['perplexity']:.3g} vs FP32 {stats['perplexity_fp32']:.3g}"
            f" ({stats['perplexity_rise']:+.1%})"
        )
    windows = stats.get("greedy_windows", 0)
    if windows:
        held = round(stats["greedy_same"] * windows)
        text += (
            f", greedy continuations {held}/{windows} as FP32's ({GREEDY_TOKENS} tokens; "
            f"{stats['greedy_prefix']:.0%} of tokens before a change; reported, not a budget)"
        )
    return text


def _summary(
    report: WeightsReport,
    first: dict[str, Any],
    stats: dict[str, Any],
    repair: _Repair,
    misses: list[str],
    checker: _Checker,
) -> str:
    """The command's last line: the bits, what was measured, the repair, the size."""
    counts: dict[str, int] = {}
    for row in report.nodes:
        if row.op_type == "MatMul":
            counts[row.precision] = counts.get(row.precision, 0) + 1
    done = ", ".join(f"{k} {'float' if p == 'fp32' else p}" for p, k in sorted(counts.items()))
    where = f"{stats['windows']} {checker.where} ({stats['tokens']} tokens)"
    text = f"weight-only MatMul {done}; next tokens vs FP32 on {where}: "
    text += _measured(stats, checker.real_tokens)
    if repair.chosen is not None:
        chosen = repair.chosen
        text += (
            f"; repaired by sensitivity in {len(repair.steps)} step(s) from "
            f"{_measured(first, checker.real_tokens)}"
            f": the {chosen['layers']} most sensitive int4 layers to {chosen['to']}"
        )
    before, after = report.param_bytes_before, report.param_bytes_after
    if before:
        text += f"; {after / 1e6:.1f} MB ({after / before:.2f}x FP32)"
    if misses:
        text += f"; language-model guard FAILED ({'; '.join(misses)})"
        if repair.limit:
            text += f"; {repair.limit}"
    return text


def language_model_guard(
    work: ir.Model, calibration_data: Any, eval_data: Any
) -> tuple[Any, Any, WeightsGuard]:
    """A language model's data and guard: ``eval_data`` when given, else a seeded random
    fifth of the calibration windows held out of the calibration (fewer than five: all
    of them do both)."""
    if eval_data is not None or calibration_data is None:
        where = "eval windows" if eval_data is not None else None
        return calibration_data, eval_data, functools.partial(lm_guard, where=where)
    split = split_for_guard(calibration_data, None, work, WINDOWS_HELD_OUT_SHARE, MAX_HELD_OUT)
    where = "calibration windows (too few to hold any out)" if split.in_sample else None
    where = where or "held-out calibration windows"
    return split.calibration, split.held, functools.partial(lm_guard, where=where)
