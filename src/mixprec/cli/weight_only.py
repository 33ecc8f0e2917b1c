"""``mixprec quantize --weights int4|int8``: the weight-only options and their command
(see :func:`mixprec.api.weight_only.quantize_weights`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mixprec.api.weight_only import quantize_weights
from mixprec.cli.options import calibration_data, progress, runtime_of
from mixprec.cli.writing import validate_and_write
from mixprec.core.errors import MixprecError
from mixprec.inputs.text import DEFAULT_WINDOW, is_text_path
from mixprec.repair.language_guard import (
    DEFAULT_MAX_DROP,
    DEFAULT_MAX_KL,
    DEFAULT_MAX_PPL_RISE,
    INT4_BUDGET,
)
from mixprec.weights.blocks import BLOCK_SIZES
from mixprec.weights.config import ACCURACY_LEVELS, PRECISIONS
from mixprec.weights.methods import AUTO, METHODS

__all__ = ["add_weight_args", "check_weight_args", "cmd_weights"]

#: The weight-only options (dest, flag): given without --weights they are refused.
_WEIGHT_FLAGS = (
    ("block_size", "--block-size"),
    ("symmetric", "--symmetric/--asymmetric"),
    ("weight_method", "--weight-method"),
    ("accuracy_level", "--accuracy-level"),
    ("lm_head", "--lm-head"),
    ("embeddings", "--embeddings"),
    ("ratio", "--ratio"),
    ("max_size", "--max-size"),
    ("bits_per_weight", "--bits"),
    ("stream", "--stream/--no-stream"),
    ("guard_kl", "--max-kl"),
    ("guard_perplexity", "--max-perplexity-rise"),
    ("tokenizer", "--tokenizer"),
    ("text_window", "--text-window"),
)
#: The INT8 options (dest, default, flag): given with --weights they are refused (an
#: option missing from this parser, e.g. one another command has, reads as not given).
_INT8_FLAGS: tuple[tuple[str, object, str], ...] = (
    ("method", "mse", "--method"),
    ("activation_type", "auto", "--activation-type"),
    ("per_tensor", False, "--per-tensor"),
    ("mode", "auto", "--mode"),
    ("dynamic", False, "--dynamic"),
    ("bias_correction", False, "--bias-correction"),
    ("rounding", "nearest", "--rounding"),
    ("fallback", "fp32", "--fallback"),
    ("speed", "auto", "--speed"),
    ("latency_shape", [], "--latency-shape"),
    ("no_fold_batchnorm", False, "--no-fold-batchnorm"),
    ("equalize", None, "--equalize/--no-equalize"),
    ("smooth", None, "--smooth/--no-smooth"),
    ("min_cosine", None, "--min-cosine"),
    ("output_kind", None, "--output-kind"),
    ("metric", None, "--metric"),
    ("metric_budget", None, "--metric-budget"),
)


def add_weight_args(p: argparse.ArgumentParser) -> None:
    """``--weights`` and the options that only apply with it."""
    g = p.add_argument_group(
        "weight-only",
        "--weights int4|int8: MatMul weights to 4 or 8 bits in blocks (ONNX Runtime's "
        "MatMulNBits), embedding tables to GatherBlockQuantized; activations stay float",
    )
    g.add_argument(
        "--weights",
        choices=("int4", "int8"),
        default=None,
        help="weight-only quantization instead of INT8 (the lm_head and embeddings get 8 "
        "bits by default); the INT8 activation options do not apply",
    )
    sizes = ", ".join(str(b) for b in BLOCK_SIZES)
    g.add_argument(
        "--block-size",
        type=int,
        default=None,
        metavar="N",
        help=f"weights per scale along the input dimension: {sizes} (default 32)",
    )
    sym = g.add_mutually_exclusive_group()
    sym.add_argument(
        "--symmetric",
        dest="symmetric",
        action="store_const",
        const=True,
        default=None,
        help="fixed zero point per block",
    )
    sym.add_argument(
        "--asymmetric",
        dest="symmetric",
        action="store_const",
        const=False,
        help="a zero point fitted to each block's range (default: less error, same speed)",
    )
    g.add_argument(
        "--weight-method",
        choices=(AUTO, *sorted(METHODS)),
        default=None,
        help="search: each block's scale searched (data-free); awq: activation-aware "
        "scaling folded into the op before each layer, then the search weighted by the "
        "inputs (calibration data); gptq / awq-gptq: GPTQ's error feedback; rtn: round "
        "to nearest; auto (default): awq with calibration data, search without",
    )
    g.add_argument(
        "--accuracy-level",
        type=int,
        choices=ACCURACY_LEVELS,
        default=None,
        help="MatMulNBits compute: 0 float, 4 int8 (default: 4 where this CPU has int8 "
        "kernels, AVX2/VNNI/ARM64; always 4 for 8-bit weights)",
    )
    g.add_argument(
        "--ratio",
        type=float,
        default=None,
        metavar="R",
        help="with int4: the share of linear-layer weights kept at 4 bits (0-1), the rest "
        "at 8 bits by measured sensitivity (default: the layers whose sensitivity stands "
        "out, within a budget of 0.9; 1: all at 4 bits)",
    )
    budget = g.add_mutually_exclusive_group()
    budget.add_argument(
        "--max-size",
        type=float,
        default=None,
        metavar="R",
        help="with int4: a size budget, the parameters at most R x the float size "
        "(embeddings included); the 4/8-bit mix fills it by sensitivity and the guard's "
        "repair stays within it (default: 90%% of the linear weights at 4 bits)",
    )
    budget.add_argument(
        "--bits",
        dest="bits_per_weight",
        type=float,
        default=None,
        metavar="B",
        help="with int4: the size budget as mean bits per float32 weight (--max-size B/32)",
    )
    g.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="quantize in bounded memory: weights read from the data file one at a time, "
        "the checks run in pieces (default: when the external data is over 2 GiB)",
    )
    for flag, what in (("--lm-head", "the output projection"), ("--embeddings", "embeddings")):
        g.add_argument(flag, choices=PRECISIONS, default=None, help=f"{what} (default int8)")
    _add_language_model_args(g)


def _add_language_model_args(g: argparse._ArgumentGroup) -> None:
    """Text data and the language-model guard's budgets."""
    g.add_argument(
        "--tokenizer",
        metavar="PATH",
        default=None,
        help="tokenizer.json for .txt calibration/eval data (default: the one beside the "
        "model); the text is cut into windows of --text-window tokens, each fed with an "
        "empty KV cache",
    )
    g.add_argument(
        "--text-window",
        type=int,
        default=None,
        metavar="N",
        help=f"tokens per window of text data (default {DEFAULT_WINDOW})",
    )
    g.add_argument(
        "--max-kl",
        dest="guard_kl",
        type=float,
        default=None,
        metavar="NATS",
        help="language models (input_ids in, logits out): the guard's bound on the mean "
        f"next-token KL(FP32 || quantized) per token (default {DEFAULT_MAX_KL} for int8, "
        f"{INT4_BUDGET[0]} for int4); their --max-drop bounds top-1 next-token agreement "
        f"(default {DEFAULT_MAX_DROP}, int4 {INT4_BUDGET[1]})",
    )
    g.add_argument(
        "--max-perplexity-rise",
        dest="guard_perplexity",
        type=float,
        default=None,
        metavar="X",
        help="language models: the accepted relative perplexity rise on the check text "
        f"(default {DEFAULT_MAX_PPL_RISE}: +{DEFAULT_MAX_PPL_RISE * 100:.0f}%%; int4 "
        f"{INT4_BUDGET[2]}: +{INT4_BUDGET[2] * 100:.0f}%%)",
    )


def check_weight_args(args: argparse.Namespace) -> None:
    """Weight options only with ``--weights``; INT8 activation options never with it."""
    if args.weights is None:
        given = [flag for dest, flag in _WEIGHT_FLAGS if getattr(args, dest) is not None]
        if given:
            verb = "needs" if len(given) == 1 else "need"
            raise MixprecError(f"{', '.join(given)} {verb} --weights int4|int8")
        return
    given = [f for dest, default, f in _INT8_FLAGS if getattr(args, dest, default) != default]
    if given:
        verb = "applies" if len(given) == 1 else "apply"
        raise MixprecError(
            f"{', '.join(given)} {verb} to INT8 only, not with --weights (weight-only "
            "quantization leaves activations float)"
        )


def cmd_weights(args: argparse.Namespace, out: Path, feeds: Any) -> int:
    """``mixprec quantize --weights``: quantize, check, write."""
    options: dict[str, Any] = {
        dest: getattr(args, dest) for dest, _ in _WEIGHT_FLAGS if getattr(args, dest) is not None
    }
    if "bits_per_weight" in options:
        bits = options.pop("bits_per_weight")
        if not 0 < bits <= 32:
            raise MixprecError(f"--bits (mean bits per weight) must lie in (0, 32], not {bits:g}")
        options["max_size"] = bits / 32
    text = is_text_path(getattr(args, "calibration_data", None))
    result = quantize_weights(
        args.model,
        args.calibration_data if text else calibration_data(args, feeds),
        args.weights,
        eval_data=args.eval_data,
        progress=progress(args.quiet or args.json),
        exclude_nodes=tuple(args.exclude),
        shapes=dict(args.shape),
        log_dir=args.log_dir,
        guard=not args.no_guard,
        guard_drop=_budget(args.max_drop, "--max-drop"),
        guard_rel_l2=_budget(args.max_rel_l2, "--max-rel-l2"),
        runtime=runtime_of(args),
        **options,
    )
    return validate_and_write(args, result, feeds, out)


def _budget(value: float | None, flag: str) -> float | None:
    if value is not None and not 0.0 < value < 1.0:
        raise MixprecError(f"{flag} must lie in (0, 1), got {value:g}")
    return value
