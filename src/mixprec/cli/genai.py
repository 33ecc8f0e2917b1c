"""``mixprec quantize --weights int4 --genai``: write what onnxruntime-genai needs beside the
output model (``genai_config.json`` and the tokenizer files; see :mod:`mixprec.io.genai`).

The config is made from the input model and the tokenizer before any quantizing, so what
cannot be inferred fails at once; the files are written after the model, only when it was
written."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mixprec.core.errors import MixprecError
from mixprec.inputs.text import TOKENIZER_FILE, find_tokenizer
from mixprec.io.genai import genai_config, write_genai_files

__all__ = ["GenaiPlan", "add_genai_args", "plan_genai", "write_genai"]

#: The options that only apply with --genai (dest, flag).
_GENAI_FLAGS = (("context_length", "--context-length"), ("eos_token_id", "--eos-token-id"))


class GenaiPlan:
    """The config to write and the tokenizer folder to copy from."""

    def __init__(self, config: dict[str, Any], tokenizer_dir: Path) -> None:
        self.config = config
        self.tokenizer_dir = tokenizer_dir


def add_genai_args(p: argparse.ArgumentParser) -> None:
    """``--genai`` and its overrides."""
    g = p.add_argument_group(
        "onnxruntime-genai",
        "--genai: write genai_config.json and the tokenizer files beside the output, so "
        "that onnxruntime-genai (og.Model(folder)) runs it",
    )
    g.add_argument(
        "--genai",
        action="store_true",
        help="with --weights: write genai_config.json (inferred from the model's inputs, "
        "outputs and KV cache shapes, and the tokenizer folder's special tokens) and copy "
        "the tokenizer files (tokenizer.json, tokenizer_config.json, ...) beside the output "
        "(the tokenizer: --tokenizer, else the one beside the model)",
    )
    g.add_argument(
        "--context-length",
        type=int,
        default=None,
        metavar="N",
        help="with --genai: the model's context length (default: config.json's "
        "max_position_embeddings or tokenizer_config.json's model_max_length)",
    )
    g.add_argument(
        "--eos-token-id",
        type=int,
        action="append",
        default=None,
        metavar="ID",
        help="with --genai: the end-of-sequence token id, repeatable (default: from the "
        "tokenizer folder's generation_config.json, config.json or tokenizer_config.json)",
    )


def plan_genai(args: argparse.Namespace, out: Path) -> GenaiPlan | None:
    """The genai config for ``out``, made before any work; ``None`` without ``--genai``."""
    if not getattr(args, "genai", False):
        given = [flag for dest, flag in _GENAI_FLAGS if getattr(args, dest, None) is not None]
        if given:
            raise MixprecError(f"{', '.join(given)} only apply with --genai")
        return None
    if args.weights is None:
        raise MixprecError("--genai needs --weights int4|int8")
    if args.context_length is not None and args.context_length <= 0:
        raise MixprecError(f"--context-length must be positive, got {args.context_length}")
    named = getattr(args, "tokenizer", None)
    if named is None and not (Path(args.model).parent / TOKENIZER_FILE).is_file():
        raise MixprecError(
            f"--genai needs the tokenizer: no {TOKENIZER_FILE} beside {args.model}; give "
            "--tokenizer PATH"
        )
    tokenizer = find_tokenizer(args.model, named).parent
    eos = args.eos_token_id
    config = genai_config(
        args.model,
        tokenizer,
        filename=out.name,
        context_length=args.context_length,
        eos_token_id=eos[0] if eos and len(eos) == 1 else eos,
    )
    return GenaiPlan(config, tokenizer)


def write_genai(plan: GenaiPlan, out: Path, *, quiet: bool) -> None:
    """Write the genai files beside the written ``out``."""
    written = write_genai_files(plan.config, out, plan.tokenizer_dir)
    if not quiet:
        names = ", ".join(p.name for p in written)
        print(f"wrote {names} beside {out} for onnxruntime-genai")
