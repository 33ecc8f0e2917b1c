"""What onnxruntime-genai needs beside a decoder: ``genai_config.json`` and the tokenizer files.

onnxruntime-genai (``og.Model(folder)``) reads ``genai_config.json`` from the model's folder:
the model type, the ONNX file, its input and output names (the KV cache as name patterns such
as ``past_key_values.%d.key`` / ``present.%d.key``), the KV heads and head size, the layer
count, the context length, the special token ids and the search defaults; ``og.Tokenizer``
reads ``tokenizer.json`` and ``tokenizer_config.json`` from the same folder.

* :func:`decoder_layout` reads what the ONNX graph tells (names, layers, KV heads, head size,
  hidden size, vocabulary) without loading the weights;
* :func:`tokenizer_facts` reads the special tokens and the context length from the
  tokenizer's folder (``tokenizer_config.json``, ``config.json``, ``generation_config.json``,
  ``tokenizer.json``);
* :func:`genai_config` puts them together; :func:`write_genai_files` writes the config beside
  the model and copies the tokenizer files, each file atomically.

What cannot be inferred is one :class:`~mixprec.core.errors.MixprecError` line naming the
option that gives it (``context_length=``, ``eos_token_id=``).

Example::

    config = genai_config("model.onnx", "tokenizer/", filename="model.int4.onnx")
    write_genai_files(config, "out/model.int4.onnx", "tokenizer/")
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from mixprec.core.errors import MixprecError
from mixprec.io.models import copy_model_file, write_text

__all__ = [
    "GENAI_CONFIG",
    "TOKENIZER_FILES",
    "DecoderLayout",
    "TokenizerFacts",
    "decoder_layout",
    "genai_config",
    "tokenizer_facts",
    "write_genai_files",
]

#: The file onnxruntime-genai reads from the model's folder.
GENAI_CONFIG = "genai_config.json"
#: Files copied from the tokenizer's folder when present (``tokenizer.json`` is required).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)
#: onnxruntime-genai's decoder-only model types (0.18); another ``model_type`` in a
#: ``config.json`` is written as the generic ``decoder``.
_GENAI_TYPES = frozenset(
    [
        "chatglm",
        "decoder",
        "ernie4_5",
        "gemma",
        "gemma2",
        "gemma3_text",
        "gpt2",
        "granite",
        "internlm2",
        "llama",
        "mistral",
        "nemotron",
        "olmo",
        "phi",
        "phi3",
        "qwen2",
        "qwen3",
        "smollm3",
    ]
)
_FIXED_INPUTS = ("input_ids", "attention_mask", "position_ids")
#: A context length above this in ``tokenizer_config.json`` means "no limit" (HF's 1e30).
_NO_LIMIT = 1 << 24


@dataclass(frozen=True)
class DecoderLayout:
    """What a decoder's ONNX graph says about itself, as genai's ``decoder`` section."""

    inputs: dict[str, str]
    outputs: dict[str, str]
    layers: int
    kv_heads: int
    head_size: int
    hidden_size: int | None
    vocab_size: int


@dataclass(frozen=True)
class TokenizerFacts:
    """Special token ids, the context length and the model type where the tokenizer's
    folder names them (``None`` where it does not)."""

    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    pad_token_id: int | None
    context_length: int | None
    model_type: str | None


def _kv_patterns(names: list[str], kind: str) -> dict[str, list[str]]:
    """``{"past_key_values.%d.key": [names...]}`` for names with a layer index."""
    groups: dict[str, list[str]] = {}
    for name in names:
        pattern = re.sub(r"(?<=[._])\d+(?=[._]|$)", "%d", name, count=1)
        if pattern != name and pattern.endswith(kind):
            groups.setdefault(pattern, []).append(name)
    return groups


def _one_pattern(names: list[str], kind: str, where: str) -> tuple[str, list[str]]:
    groups = _kv_patterns(names, kind)
    if len(groups) != 1:
        found = ", ".join(sorted(groups)) or "none"
        raise MixprecError(
            f"onnxruntime-genai needs one KV cache {where} pattern ending in '{kind}' "
            f"(like past_key_values.%d.key); found {found}"
        )
    pattern, members = next(iter(groups.items()))
    expected = {pattern % i for i in range(len(members))}
    if set(members) != expected:
        raise MixprecError(f"KV cache {where}s {pattern} are not numbered 0..{len(members) - 1}")
    return pattern, members


def _static_dims(value: onnx.ValueInfoProto) -> list[int | None]:
    dims = value.type.tensor_type.shape.dim
    return [d.dim_value if d.HasField("dim_value") else None for d in dims]


def _hidden_size(graph: onnx.GraphProto) -> int | None:
    """Columns of the embedding table that ``input_ids`` indexes (a Gather's data)."""
    tables = {t.name: list(t.dims) for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Gather" and len(node.input) > 1 and node.input[1] == "input_ids":
            dims = tables.get(node.input[0])
            if dims is not None and len(dims) == 2:
                return int(dims[1])
    return None


def decoder_layout(model: onnx.ModelProto) -> DecoderLayout:
    """The genai ``decoder`` facts of a decoder with a KV cache (names, layers, KV heads,
    head size from the declared ``[batch, kv_heads, past, head_size]`` of the past inputs,
    the hidden size from the embedding table, the vocabulary from ``logits``)."""
    graph = model.graph
    inits = {t.name for t in graph.initializer}
    ins = {v.name: v for v in graph.input if v.name not in inits}
    outs = {v.name: v for v in graph.output}
    if "input_ids" not in ins or "logits" not in outs:
        raise MixprecError(
            "onnxruntime-genai needs a decoder with an input 'input_ids' and an output "
            f"'logits'; this model has inputs {sorted(ins)} and outputs {sorted(outs)}"
        )
    past = [n for n in ins if n not in _FIXED_INPUTS]
    present = [n for n in outs if n != "logits"]
    if not past:
        raise MixprecError(
            "onnxruntime-genai needs a decoder with a KV cache (past_key_values.%d.key "
            "inputs); this model has none"
        )
    key_in, keys = _one_pattern(past, "key", "input")
    value_in, _ = _one_pattern(past, "value", "input")
    key_out, _ = _one_pattern(present, "key", "output")
    value_out, _ = _one_pattern(present, "value", "output")
    dims = _static_dims(ins[keys[0]])
    if len(dims) != 4 or dims[1] is None or dims[3] is None:
        shown = ["?" if d is None else d for d in dims]
        raise MixprecError(
            f"input {keys[0]!r} has shape {shown}: onnxruntime-genai needs a declared "
            "[batch, kv_heads, past, head_size] with fixed kv_heads and head_size"
        )
    vocab = _static_dims(outs["logits"])[-1:] or [None]
    if vocab[0] is None:
        raise MixprecError("output 'logits' has no fixed last dimension (the vocabulary size)")
    inputs = {n: n for n in _FIXED_INPUTS if n in ins}
    inputs |= {"past_key_names": key_in, "past_value_names": value_in}
    outputs = {"logits": "logits", "present_key_names": key_out, "present_value_names": value_out}
    return DecoderLayout(
        inputs, outputs, len(keys), int(dims[1]), int(dims[3]), _hidden_size(graph), int(vocab[0])
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise MixprecError(f"cannot read {path}: {exc}") from None
    return data if isinstance(data, dict) else {}


def _token_ids(tokenizer: dict[str, Any]) -> dict[str, int]:
    """Token text -> id from a ``tokenizer.json`` (its added tokens and its model's vocab)."""
    vocab = tokenizer.get("model", {}).get("vocab", {})
    ids = dict(vocab) if isinstance(vocab, dict) else {}
    for added in tokenizer.get("added_tokens", []):
        ids[added["content"]] = int(added["id"])
    return ids


def _token_id(value: Any, ids: dict[str, int]) -> int | None:
    if isinstance(value, dict):
        value = value.get("content")
    return ids.get(value) if isinstance(value, str) else None


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def tokenizer_facts(tokenizer_dir: str | os.PathLike[str]) -> TokenizerFacts:
    """The special token ids, context length and model type that the files of a Hugging
    Face tokenizer folder name (``generation_config.json`` first, then ``config.json``,
    then the tokens ``tokenizer_config.json`` names, looked up in ``tokenizer.json``)."""
    folder = Path(tokenizer_dir)
    tokenizer = _read_json(folder / "tokenizer.json")
    settings = _read_json(folder / "tokenizer_config.json")
    config = _read_json(folder / "config.json")
    generation = _read_json(folder / "generation_config.json")
    ids = _token_ids(tokenizer)
    found = {
        key: _first(
            generation.get(f"{key}_token_id"),
            config.get(f"{key}_token_id"),
            _token_id(settings.get(f"{key}_token"), ids),
        )
        for key in ("bos", "eos", "pad")
    }
    limit = settings.get("model_max_length")
    context = _first(
        config.get("max_position_embeddings"),
        limit if isinstance(limit, int) and 0 < limit < _NO_LIMIT else None,
    )
    model_type = config.get("model_type")
    return TokenizerFacts(
        found["bos"],
        found["eos"],
        found["pad"],
        int(context) if context is not None else None,
        model_type if isinstance(model_type, str) else None,
    )


def _proto_header(model: str | os.PathLike[str] | onnx.ModelProto) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        return model
    try:
        return onnx.load(os.fspath(model), load_external_data=False)
    except Exception as exc:  # OSError, or protobuf's DecodeError (its type varies)
        raise MixprecError(f"cannot read {model}: {exc}") from None


def genai_config(
    model: str | os.PathLike[str] | onnx.ModelProto,
    tokenizer_dir: str | os.PathLike[str],
    *,
    filename: str,
    context_length: int | None = None,
    eos_token_id: int | list[int] | None = None,
) -> dict[str, Any]:
    """The ``genai_config.json`` of a decoder (its graph read without its weights) whose
    ONNX file will be ``filename`` beside the config; the given ``context_length`` and
    ``eos_token_id`` override what the tokenizer folder names."""
    layout = decoder_layout(_proto_header(model))
    facts = tokenizer_facts(tokenizer_dir)
    eos = _first(eos_token_id, facts.eos_token_id)
    if eos is None:
        raise MixprecError(
            f"no end-of-sequence token in {tokenizer_dir} (generation_config.json, config.json "
            "or tokenizer_config.json's eos_token): give --eos-token-id ID"
        )
    context = _first(context_length, facts.context_length)
    if context is None:
        raise MixprecError(
            f"no context length in {tokenizer_dir} (config.json's max_position_embeddings or "
            "tokenizer_config.json's model_max_length): give --context-length N"
        )
    first_eos = eos[0] if isinstance(eos, list) else eos
    decoder: dict[str, Any] = {
        "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
        "filename": filename,
        "head_size": layout.head_size,
        "num_hidden_layers": layout.layers,
        "num_key_value_heads": layout.kv_heads,
        "inputs": layout.inputs,
        "outputs": layout.outputs,
    }
    if layout.hidden_size is not None:
        decoder["hidden_size"] = layout.hidden_size
        if layout.hidden_size % layout.head_size == 0:
            decoder["num_attention_heads"] = layout.hidden_size // layout.head_size
    model_type = facts.model_type if facts.model_type in _GENAI_TYPES else "decoder"
    return {
        "model": {
            "type": model_type,
            "bos_token_id": _first(facts.bos_token_id, first_eos),
            "eos_token_id": eos,
            "pad_token_id": _first(facts.pad_token_id, first_eos),
            "vocab_size": layout.vocab_size,
            "context_length": int(context),
            "decoder": decoder,
        },
        "search": {
            "do_sample": False,
            "max_length": int(context),
            "min_length": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            # this graph's present grows by Concat: past and present cannot share a buffer
            "past_present_share_buffer": False,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 50,
            "top_p": 1.0,
        },
    }


def write_genai_files(
    config: dict[str, Any],
    model_path: str | os.PathLike[str],
    tokenizer_dir: str | os.PathLike[str],
) -> list[Path]:
    """Write ``genai_config.json`` beside ``model_path`` and copy the tokenizer files there
    (those of :data:`TOKENIZER_FILES` present; a file already there is replaced); the paths
    written."""
    folder = Path(model_path).resolve().parent
    source = Path(tokenizer_dir).resolve()
    if not (source / "tokenizer.json").is_file():
        raise MixprecError(f"no tokenizer.json in {source}")
    written = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file() and source != folder:
            copy_model_file(source / name, folder / name)
            written.append(folder / name)
    target = folder / GENAI_CONFIG
    write_text(target, json.dumps(config, indent=2) + "\n")
    written.append(target)
    return written
