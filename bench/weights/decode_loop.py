"""Decode and prefill speed of ONNX decoders and GGUF files in one lockstep loop
(llm_eval.speed_loop: batch 1, the KV cache, 64 greedy tokens after a 64-token held-out
prompt, each step run once per model before the next; prefill of one 256-token window,
median of 3 rounds), the first model the reference of the ratios. A GGUF file runs in
llama.cpp (llamacpp_eval), whichever llama_cpp the interpreter imports: run with
PYTHONPATH set to compare another build (e.g. one compiled with GGML_NATIVE=ON).

In lockstep both runtimes wait passively (ORT without spinning, llama.cpp's OpenMP with
OMP_WAIT_POLICY=PASSIVE), so that neither steals the cores of the other; that slows
llama.cpp's steps more than ORT's. To time each with its own defaults, run one model per
call with `BENCH_ORT_SPIN=1 OMP_WAIT_POLICY=ACTIVE`.

    python -m bench.weights.decode_loop TOKENIZER_DIR NAME=PATH [NAME=PATH ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bench.weights import llm_eval


def open_model(path: Path) -> Any:
    if path.suffix == ".gguf":
        from bench.weights import llamacpp_eval
        return llamacpp_eval.LlamaCppDecoder.open(path)
    return llm_eval.Decoder.open(path)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    tokenizer = llm_eval.load_tokenizer(Path(argv[0]))
    stream = llm_eval.token_stream(tokenizer, llm_eval.HELDOUT_FILES)
    heldout = llm_eval.windows(stream)
    models = {}
    for item in argv[1:]:
        name, _, path = item.partition("=")
        models[name] = open_model(Path(path))
    found = llm_eval.speed_loop(models, heldout[0][: llm_eval.PROMPT_TOKENS], heldout[-1])
    try:
        import llama_cpp

        system = llama_cpp.llama_print_system_info().decode()
    except Exception as exc:  # no llama.cpp: ONNX models only
        system = f"llama_cpp not importable: {exc}"
    print(json.dumps({"llama_cpp_system_info": system, "results": found}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
