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
  32) stays FP32's, read from one run of the candidate (:mod:`mixprec.checks.greedy`);
  reported on the last line, not a budget (three or four windows are too few to hold a
  share of them to).

A miss is repaired (:mod:`mixprec.repair.lm_repair`): the quantized linear layers, most
sensitive first, go to 8 bits in steps (1/8, 1/4, 1/2, all of those the size
budget has room for), then to float in the steps that fit (the lm_head and embeddings
keep their precision), each step quantized again (``context.requantize``) and checked,
until the budgets are met or the steps run out. The first step that passes is then
narrowed: the span between it and the failing step before it is halved
:data:`BISECT_ROUNDS` times, and the passing candidate with the fewest promoted layers
is kept (``repaired_with`` in the guard's record). A miss after all steps leaves
``passed`` False (the CLI writes nothing and exits 1, as the INT8 guard). The repair
ranks layers as the run's mixed choice scored them, on the calibration windows (else
it scores them on those again), and is graded on the check windows (held out of the
calibration text, or ``eval_data``), never the same ones; with no calibration data the
ranking reads no windows (the weights' own error).

Budgets (:data:`DEFAULT_MAX_KL`, :data:`DEFAULT_MAX_DROP`, :data:`DEFAULT_MAX_PPL_RISE`
for 8-bit weights, :data:`INT4_BUDGET` for 4-bit) were chosen on SmolLM2-135M
(docs/guides/weights.md): int8 everywhere is well inside the first; 4-bit AWQ within the
default size budget inside the second; int4 RTN without repair outside both. The repair
never leaves the run's size budget (:mod:`mixprec.weights.mixed_bits`): a miss at that
size is reported as a miss.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np
import onnx_ir as ir

from mixprec.checks.greedy import TOKENS as GREEDY_TOKENS
from mixprec.checks.greedy import Continuations
from mixprec.checks.guard_samples import MAX_HELD_OUT, WINDOWS_HELD_OUT_SHARE, split_for_guard
from mixprec.checks.outputs import OutputCheck
from mixprec.inputs.feeds import feeds_for
from mixprec.inputs.signature import declared_dims, graph_inputs
from mixprec.pipeline.weight_only import GuardContext, WeightsGuard, WeightsReport
from mixprec.repair.lm_repair import REPAIRED, Repair, quantized_linear
from mixprec.weights.config import WeightsConfig

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

    def checks(self, stats: dict[str, Any], budget: LmBudget) -> list[OutputCheck]:
        """``stats`` held to ``budget`` in the guard's one schema (:class:`OutputCheck`):
        KL and next-token agreement over the check windows' tokens, and the perplexity
        rise where the windows are real text."""
        tokens, kl, agree = stats["tokens"], stats["kl"], stats["agreement"]
        why = "a language model's logits: next-token distributions against FP32's"
        found = [
            OutputCheck(LOGITS, "kl", kl, budget.max_kl, kl <= budget.max_kl, reason=why,
                        rows=tokens),
            OutputCheck(LOGITS, "next-token", agree, 1.0 - budget.max_drop,
                        agree >= 1.0 - budget.max_drop, reason=why, rows=tokens),
        ]  # fmt: skip
        if self.real_tokens:
            rise = stats["perplexity_rise"]
            ppl = stats["perplexity"]
            note = "" if math.isfinite(ppl) else f"perplexity {ppl:g}, not finite"
            found.append(
                OutputCheck(LOGITS, "perplexity-rise", rise, budget.max_ppl_rise,
                            not note and rise <= budget.max_ppl_rise, note, reason=why,
                            rows=tokens)
            )  # fmt: skip
        return found

    def misses(self, stats: dict[str, Any], budget: LmBudget) -> list[str]:
        """Why ``stats`` misses ``budget``, one phrase per failed check with the option
        that sets its budget (empty: it passes)."""
        return [_miss(c) for c in self.checks(stats, budget) if not c.passed]


def lm_guard(
    model: ir.Model, report: WeightsReport, context: GuardContext, *, where: str | None = None
) -> tuple[ir.Model, WeightsReport]:
    """The :data:`~mixprec.pipeline.weight_only.WeightsGuard` of a language model (module
    doc): measure, repair on a miss, and set ``report.guard``; ``where`` names the check
    windows (default: ``context.where``)."""
    if where is not None:
        context = dataclasses.replace(context, where=where)
    checker = _Checker(context)
    budget = LmBudget.of(context.config)
    first = checker.measure(model)
    misses = checker.misses(first, budget)
    repair = Repair(checker, budget, context, (model, report, first, misses))
    del model  # the repair holds it while it is the best; a streamed one then lets it go
    if misses:
        repair.run(quantized_linear(report))
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
        "checks": [c.to_dict() for c in checker.checks(stats, budget)],
        "promoted": {
            n.name: [n.precision, n.reason] for n in report.nodes if n.reason.startswith(REPAIRED)
        },
        "enforced": True,
        "summary": _summary(report, first, stats, repair, final_misses, checker),
    }
    return model, report


#: The option that sets each next-token check's budget.
_OPTIONS = {
    "kl": "--max-kl",
    "next-token": "--max-drop",
    "perplexity-rise": "--max-perplexity-rise",
}


def _miss(check: OutputCheck) -> str:
    """``KL 0.0509 > 0.03 (--max-kl)``: a failed next-token check, as the last line says it."""
    option = _OPTIONS[check.kind]
    if check.kind == "kl":
        return f"KL {check.value:.3g} > {check.limit:g} ({option})"
    if check.kind == "next-token":
        return f"agreement {check.value:.3f} < {check.limit:g} ({option})"
    if check.note:
        return f"{check.note} ({option})"
    return f"perplexity +{check.value:.1%} > +{check.limit:.0%} ({option})"


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
    repair: Repair,
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
