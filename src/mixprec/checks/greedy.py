"""Greedy continuations beside FP32's, for the language-model guard: what a user of a
chat model sees, where next-token agreement counts positions one at a time.

From the first :data:`PROMPT` tokens of each check window, FP32 decodes :data:`TOKENS`
tokens greedily, once (each step one run of every window's prompt and the tokens so far,
from an empty cache). A quantized model then needs one run, on each prompt followed by
FP32's continuation: its greedy continuation is FP32's exactly when its top token at every
position of that continuation is FP32's next token, and it leaves FP32's path at the first
position where it is not. So the guard reads, per window, whether the whole continuation
holds and how far it holds, from one run of each candidate.

A window too short for the prompt and one token, a batch of more than one row, or an input
with a sequence axis other than the ids, the mask and positions, gets no continuation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from mixprec.inputs.feeds import Feeds

__all__ = ["PROMPT", "TOKENS", "Continuations"]

#: Tokens of each window the continuation starts from.
PROMPT = 32
#: Greedy tokens decoded after them.
TOKENS = 16
_IDS = "input_ids"
Feed = dict[str, np.ndarray]


def _extended(window: Feeds, ids: np.ndarray) -> Feed | None:
    """``window``'s feeds for the token row ``ids`` ([1, n]): the mask all ones, positions
    counted, an empty cache kept; None where another input follows the sequence."""
    length = int(window[_IDS].shape[1])
    feeds: Feed = {}
    for name, array in window.items():
        if name == _IDS:
            feeds[name] = ids
        elif array.ndim == 2 and array.shape[1] == length:
            if "mask" in name:
                feeds[name] = np.ones_like(array, shape=ids.shape)
            elif "position" in name:
                feeds[name] = np.arange(ids.shape[1], dtype=array.dtype)[None]
            else:
                return None
        else:
            feeds[name] = array
    return feeds


@dataclasses.dataclass
class Continuations:
    """FP32's greedy continuation of each usable window, and the feeds a candidate runs
    on (prompt + continuation)."""

    tokens: list[np.ndarray]
    feeds: list[Feed]

    @classmethod
    def of(
        cls,
        windows: Sequence[Feeds],
        run_fp32: Callable[[list[Feed]], list[np.ndarray]],
    ) -> Continuations:
        """Decodes FP32's continuations (module doc); ``run_fp32`` gives the logits
        ``[1, n, vocab]`` of each feed dict."""
        usable = [w for w in windows if _IDS in w and w[_IDS].ndim == 2]
        usable = [w for w in usable if w[_IDS].shape[0] == 1 and w[_IDS].shape[1] > PROMPT]
        rows = [np.asarray(w[_IDS][:, :PROMPT], np.int64) for w in usable]
        if not rows or any(_extended(w, r) is None for w, r in zip(usable, rows, strict=True)):
            return cls([], [])
        for _ in range(TOKENS):
            feeds = [_extended(w, r) for w, r in zip(usable, rows, strict=True)]
            logits = run_fp32([f for f in feeds if f is not None])
            rows = [
                np.concatenate([r, [[int(np.argmax(x[0, -1]))]]], axis=1)
                for r, x in zip(rows, logits, strict=True)
            ]
        tokens = [r[0, PROMPT:] for r in rows]
        whole = [_extended(w, r[:, :-1]) for w, r in zip(usable, rows, strict=True)]
        return cls(tokens, [f for f in whole if f is not None])

    def stats(self, logits: Sequence[np.ndarray]) -> dict[str, float | int]:
        """A candidate's logits on :attr:`feeds` read against FP32's continuations:
        ``greedy_same`` (the share of windows whose whole continuation holds),
        ``greedy_prefix`` (the mean share of tokens before the first that differs) and
        ``greedy_windows``."""
        same = prefix = 0.0
        for want, got in zip(self.tokens, logits, strict=True):
            picked = np.argmax(got[0, PROMPT - 1 : PROMPT - 1 + len(want)], axis=-1)
            wrong = np.flatnonzero(picked != want)
            first = int(wrong[0]) if wrong.size else len(want)
            same += float(first == len(want))
            prefix += first / len(want)
        count = len(self.tokens)
        return {
            "greedy_same": same / count if count else 1.0,
            "greedy_prefix": prefix / count if count else 1.0,
            "greedy_windows": count,
        }
