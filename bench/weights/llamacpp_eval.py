"""A GGUF model in llama.cpp (llama-cpp-python) behind llm_eval's decoder interface, so
that llm_eval.Reference.compare and llm_eval.speed_loop measure it on the same token ids as
the ONNX models: ``logits(ids)`` of one window from an empty cache (``logits_all=True``, one
``eval`` of the window, the scores of every position), and greedy decoding with the cache
(``start(prompt)`` evaluates the prompt, ``feed(token)`` one step and returns its seconds).

Threads: :data:`llm_eval.THREADS` (2) for both decode and batch. llama.cpp's CPU backend runs
on OpenMP threads, which spin after each step by default and would steal the cores of the
ORT model timed next in the lockstep loop: OMP_WAIT_POLICY is set to PASSIVE before
llama_cpp is first imported (unless the environment sets it).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.weights import llm_eval

CONTEXT = 512  # the longest sequence run: a 256-token window, or 64 + 64 decode tokens


@dataclass
class LlamaCppDecoder:
    """One llama.cpp context of a GGUF file (batch 1)."""

    llm: Any
    path: Path

    @classmethod
    def open(cls, path: Path) -> LlamaCppDecoder:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        from llama_cpp import Llama

        llm = Llama(model_path=str(path), n_ctx=CONTEXT, n_batch=CONTEXT, n_ubatch=CONTEXT,
                    n_threads=llm_eval.THREADS, n_threads_batch=llm_eval.THREADS,
                    logits_all=True, verbose=False)
        return cls(llm, path)

    def logits(self, ids: np.ndarray) -> np.ndarray:
        """Logits [len, vocab] of one sequence from an empty cache."""
        self.llm.reset()
        self.llm.eval([int(t) for t in ids])
        return np.array(self.llm.scores[: len(ids)], np.float32)

    def start(self, prompt: np.ndarray) -> LlamaCppStream:
        self.llm.reset()
        self.llm.eval([int(t) for t in prompt])
        return LlamaCppStream(self)

    def greedy(self, prompt: np.ndarray, steps: int, stop: int | None = None) -> list[int]:
        stream = self.start(prompt)
        tokens = [stream.pick()]
        while len(tokens) < steps and tokens[-1] != stop:
            stream.feed(tokens[-1])
            tokens.append(stream.pick())
        return tokens

    def close(self) -> None:
        self.llm.close()


@dataclass
class LlamaCppStream:
    """A greedy decoding in progress (llama.cpp keeps the cache in its context: one stream
    per decoder at a time, as speed_loop runs them)."""

    decoder: LlamaCppDecoder

    def pick(self) -> int:
        llm = self.decoder.llm
        return int(np.argmax(llm.scores[llm.n_tokens - 1]))

    def feed(self, token: int) -> float:
        begin = time.perf_counter()
        self.decoder.llm.eval([token])
        return time.perf_counter() - begin
