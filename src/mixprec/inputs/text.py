"""Text as samples for a language model: ``.txt`` files (or a folder of them) tokenized with
a ``tokenizer.json`` (the ``tokenizers`` package, the ``[llm]`` extra) and cut into
windows of tokens, each one feed dict of a decoder's first step.

* :func:`is_text_path` tells a text path from the ``.npz`` forms;
* :func:`find_tokenizer` finds the tokenizer (given, else ``tokenizer.json`` beside the
  model);
* :class:`TextSamples` is the samples of a text path for one model, re-iterable (the
  tokens are kept, a few bytes each; the feeds are made as they are read): per window
  ``input_ids`` ``[1, N]``, ``attention_mask`` of ones, ``position_ids`` ``0..N-1`` where
  the model takes them, ``token_type_ids`` of zeros (encoders), and an empty cache for
  every ``past_key_values.*`` input (past length 0; its dtype and head dims from the
  model's declared input types).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from mixprec.core.errors import MixprecError
from mixprec.inputs.signature import ModelArg, as_ir, declared_dims, dtype_of, graph_inputs

__all__ = [
    "DEFAULT_WINDOW",
    "TEXT_SUFFIXES",
    "TOKENIZER_FILE",
    "TextData",
    "TextSamples",
    "find_tokenizer",
    "is_text_path",
    "load_tokenizer",
    "read_text",
]

#: Files read as text (a folder: every such file in it, in name order).
TEXT_SUFFIXES = (".txt",)
#: Tokens per window: long enough for the next-token statistics to see context, short
#: enough that a 135M decoder runs one in about 0.1 s on 2 cores.
DEFAULT_WINDOW = 256
#: The name of a tokenizer file looked for beside the model.
TOKENIZER_FILE = "tokenizer.json"
_PAST_PREFIXES = ("past_key_values.", "past.")
_INSTALL = "pip install 'mixprec[llm]' (the tokenizers package)"


def is_text_path(path: object) -> bool:
    """Whether ``path`` names text: a ``.txt`` file, or a folder holding ``.txt`` files and
    no ``.npz`` file."""
    if not isinstance(path, str | os.PathLike):
        return False
    p = Path(path)
    if p.suffix.lower() in TEXT_SUFFIXES:
        return True
    if not p.is_dir():
        return False
    names = [f.suffix.lower() for f in p.iterdir() if f.is_file()]
    return any(s in TEXT_SUFFIXES for s in names) and ".npz" not in names


def _text_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(
            f for f in path.iterdir() if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES
        )
        if not files:
            raise MixprecError(f"text folder {str(path)!r} holds no .txt file")
        return files
    if not path.is_file():
        raise MixprecError(f"text file {str(path)!r} does not exist")
    return [path]


def read_text(path: str | os.PathLike[str]) -> str:
    """The text of a ``.txt`` file or of a folder's ``.txt`` files (name order, joined by
    a blank line): UTF-8, or Latin-1 where a file is not valid UTF-8."""
    texts = []
    for f in _text_files(Path(path)):
        try:
            raw = f.read_bytes()
        except OSError as exc:
            raise MixprecError(f"cannot read text file {str(f)!r}: {exc.strerror or exc}") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = raw.decode("latin-1")
        texts.append(text.replace("\r\n", "\n").strip())
    return "\n\n".join(t for t in texts if t)


def find_tokenizer(
    model_path: str | os.PathLike[str] | None, tokenizer: str | os.PathLike[str] | None
) -> Path:
    """The tokenizer file: ``tokenizer`` as given (a file, or a folder holding
    ``tokenizer.json``), else ``tokenizer.json`` beside the model file."""
    if tokenizer is not None:
        p = Path(tokenizer)
        p = p / TOKENIZER_FILE if p.is_dir() else p
        if not p.is_file():
            raise MixprecError(f"tokenizer {str(p)!r} does not exist")
        return p
    if model_path is not None:
        beside = Path(model_path).parent / TOKENIZER_FILE
        if beside.is_file():
            return beside
        where = f"no {TOKENIZER_FILE} beside {str(model_path)!r}"
    else:
        where = "the model was given in memory"
    raise MixprecError(f"text data needs a tokenizer: {where}; give --tokenizer PATH (tokenizer=)")


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json``; one line when the package is
    missing or the file is not a tokenizer."""
    try:
        module = importlib.import_module("tokenizers")
    except ImportError:
        raise MixprecError(f"text data needs the tokenizers package: {_INSTALL}") from None
    try:
        return module.Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises its own Exception subclass
        line = str(exc).strip().splitlines()
        raise MixprecError(
            f"cannot read tokenizer {str(path)!r}: {line[0] if line else type(exc).__name__}"
        ) from None


def _past_shape(value: ir.Value) -> tuple[int, ...]:
    """An empty cache entry's shape: batch 1, the one symbolic axis (past length) 0."""
    dims = declared_dims(value)
    name = value.name or ""
    if dims is None or len(dims) < 2:
        raise MixprecError(f"text data: cache input {name!r} has no declared shape to fill")
    shape = [1 if not isinstance(dims[0], int) else dims[0]]
    open_axes = [k for k, d in enumerate(dims[1:], 1) if not isinstance(d, int)]
    if len(open_axes) != 1:
        raise MixprecError(
            f"text data: cache input {name!r} {list(dims)} needs exactly one symbolic axis "
            "(the past length) besides the batch; give npz samples instead"
        )
    shape += [0 if k in open_axes else int(d) for k, d in enumerate(dims[1:], 1)]  # type: ignore[arg-type]
    return tuple(shape)


def _inputs_of(model: ModelArg | str | os.PathLike[str]) -> ir.Model:
    """The model whose inputs are read (a path: its graph only, no weights)."""
    if isinstance(model, str | os.PathLike):
        try:
            return as_ir(onnx.load(os.fspath(model), load_external_data=False))
        except Exception as exc:  # a missing file, or not ONNX
            raise MixprecError(f"cannot read model {os.fspath(model)!r}: {exc}") from None
    return as_ir(model)


class _Template:
    """How one window becomes a feed dict for ``model``."""

    def __init__(self, model: ir.Model, what: str) -> None:
        inputs = {v.name or "": v for v in graph_inputs(model)}
        if "input_ids" not in inputs:
            names = ", ".join(sorted(inputs)) or "none"
            raise MixprecError(
                f"{what}: text data feeds input_ids, and the model has no such input "
                f"(its inputs: {names})"
            )
        self.ids_dtype = np.dtype(dtype_of(inputs["input_ids"]).numpy())
        self.inputs = inputs
        self.empty: dict[str, np.ndarray] = {}
        for name, value in inputs.items():
            if name.startswith(_PAST_PREFIXES):
                dtype = np.dtype(dtype_of(value).numpy())
                self.empty[name] = np.zeros(_past_shape(value), dtype)
            elif name not in ("input_ids", "attention_mask", "position_ids", "token_type_ids"):
                raise MixprecError(
                    f"{what}: text data feeds input_ids, attention_mask, position_ids, "
                    f"token_type_ids and past_key_values.*; model input {name!r} is none of "
                    "them (give npz samples instead)"
                )

    def feeds(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        n = len(ids)
        out = {"input_ids": ids.astype(self.ids_dtype)[None]}
        for name, fill in (("attention_mask", 1), ("token_type_ids", 0)):
            if name in self.inputs:
                dtype = np.dtype(dtype_of(self.inputs[name]).numpy())
                out[name] = np.full((1, n), fill, dtype)
        if "position_ids" in self.inputs:
            dtype = np.dtype(dtype_of(self.inputs["position_ids"]).numpy())
            out["position_ids"] = np.arange(n, dtype=dtype)[None]
        out.update(self.empty)
        return out


class TextSamples:
    """The windows of a text path as feed dicts for ``model``, read again each time they
    are iterated (the tokens are kept; the feeds are made one at a time).

    Args:
        path: a ``.txt`` file or a folder of them.
        model: the model whose inputs the windows feed (it takes ``input_ids``).
        tokenizer: a ``tokenizer.json`` path (:func:`find_tokenizer` finds one).
        window: tokens per window; the text gives ``len(tokens) // window``
            non-overlapping windows (a shorter text: one window of all its tokens).

    Example:
        >>> data = TextSamples("news.txt", "lm.onnx", "tokenizer.json")  # doctest: +SKIP
        >>> len(data), next(iter(data))["input_ids"].shape              # doctest: +SKIP
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        model: ModelArg | str | os.PathLike[str],
        tokenizer: str | os.PathLike[str],
        *,
        window: int = DEFAULT_WINDOW,
    ) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 2:
            raise MixprecError(f"the text window must be an integer >= 2 tokens, not {window!r}")
        self.path = Path(path)
        what = f"text {self.path.name!r}"
        self._template = _Template(_inputs_of(model), what)
        text = read_text(self.path)
        loaded = load_tokenizer(tokenizer)
        #: the token the tokenizer puts first (a BOS, as Gemma's does), which every
        #: window then starts with, as the model saw text in training; None: none
        self.bos = _leading_special(loaded)
        encoded = loaded.encode(text, add_special_tokens=self.bos is None)
        self.tokens = np.asarray(encoded.ids, dtype=np.int64)
        if len(self.tokens) < 2:
            raise MixprecError(f"{what} holds {len(self.tokens)} token(s): too little text")
        self.window = min(window, len(self.tokens) + (self.bos is not None))
        self.tokenizer = Path(tokenizer)

    @property
    def _step(self) -> int:
        """Text tokens per window (one fewer when each starts with the BOS)."""
        return self.window - (self.bos is not None)

    def __len__(self) -> int:
        return len(self.tokens) // self._step

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        head = np.array([] if self.bos is None else [self.bos], np.int64)
        for k in range(len(self)):
            text = self.tokens[k * self._step : (k + 1) * self._step]
            yield self._template.feeds(np.concatenate([head, text]))

    def describe(self) -> str:
        """One line: how many windows of how many tokens, from where."""
        bos = "" if self.bos is None else f", each after the tokenizer's first token {self.bos}"
        return (
            f"{len(self)} windows of {self.window} tokens from {self.path.name} "
            f"({len(self.tokens)} tokens, tokenizer {self.tokenizer.name}{bos})"
        )


def _leading_special(tokenizer: Any) -> int | None:
    """The id the tokenizer's post-processing puts before any text (a BOS), or None."""
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    full = tokenizer.encode("a", add_special_tokens=True).ids
    if len(full) > len(plain) and full[1 : 1 + len(plain)] == plain:
        return int(full[0])
    return None


class TextData:
    """The data a call was given, with text paths read as :class:`TextSamples` for one
    model (``model``: its path, where the tokenizer is looked for beside it)."""

    def __init__(
        self,
        model: Any,
        tokenizer: str | os.PathLike[str] | None,
        window: int,
        work: ir.Model,
    ) -> None:
        self.model_path = model if isinstance(model, str | os.PathLike) else None
        self.tokenizer = tokenizer
        self.window = window
        self.work = work
        self.read_texts: list[TextSamples] = []

    def read(self, data: Any) -> Any:
        if not is_text_path(data):
            return data
        found = find_tokenizer(self.model_path, self.tokenizer)
        text = TextSamples(data, self.work, found, window=self.window)
        self.read_texts.append(text)
        return text

    def notes(self) -> list[str]:
        """The report's notes on each text read."""
        return [f"text data: {t.describe()}" for t in self.read_texts]
