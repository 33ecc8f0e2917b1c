"""Markdown for the weight-only part of the bench (weights.py)."""

from __future__ import annotations

from typing import Any

from bench.harness.report import num
from bench.weights import llm_eval

Row = dict[str, Any]

LLM_COLUMNS = ("| tool | status | perplexity | vs FP32 | KL | next-token agreement "
               "| greedy same | decode tok/s | × FP32 | prefill 256 ms | × FP32 | size MB | × FP32 "
               "| bits/weight | quant s | peak RSS MB |")
ENCODER_COLUMNS = ("| tool | status | min cosine | mean cosine | latency × FP32 | size MB "
                   "| × FP32 | quant s | peak RSS MB |")


def _signed_pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:+.1f}%"


def _mb(value: float | None) -> str:
    return "–" if value is None else f"{value / 2**20:.0f}"


def _llm_row(r: Row) -> str:
    status = r["status"] if not r.get("evaluation_error") else "eval error"
    return (f"| {r['tool']} | {status} | {num(r.get('perplexity'), '.2f')} "
            f"| {_signed_pct(r.get('perplexity_change'))} | {num(r.get('kl'), '.4f')} "
            f"| {num(r.get('top1_agreement'), '.3f')} | {_greedy(r)} "
            f"| {num(r.get('decode_tok_s'), '.1f')} "
            f"| {num(r.get('decode_speedup'), '.2f')} | {num(r.get('prefill_ms'), '.0f')} "
            f"| {num(r.get('prefill_ratio'), '.2f')} | {_mb(r.get('size_bytes'))} "
            f"| {num(r.get('size_ratio'), '.2f')} | {_bits(r)} | {_quant_s(r)} "
            f"| {num(r.get('peak_rss_mb'), '.0f')} |")


def _greedy(r: Row) -> str:
    """Windows whose greedy continuation is FP32's, and the mean share before a change."""
    same, prefix = r.get("greedy_same"), r.get("greedy_prefix")
    if same is None or prefix is None:
        return "–"
    return f"{same:.2f} ({prefix:.2f})"


def _bits(r: Row) -> str:
    """Bits per FP32 weight: the file's size against the FP32 file's 32 bits per weight
    (a GGUF file's tokenizer and an ONNX file's graph included)."""
    ratio = r.get("size_ratio")
    return "–" if ratio is None else f"{32 * ratio:.2f}"


def _quant_s(r: Row) -> str:
    return "–" if r["tool"] == "fp32" else num(r.get("wall_s"), ".1f")


def _encoder_row(r: Row) -> str:
    status = r["status"] if not r.get("evaluation_error") else "eval error"
    latency = (r.get("latency") or {}).get("ratio")
    return (f"| {r['tool']} | {status} | {num(r.get('min_cosine'), '.5f')} "
            f"| {num(r.get('mean_cosine'), '.5f')} | {num(latency, '.2f')} "
            f"| {_mb(r.get('size_bytes'))} | {num(r.get('size_ratio'), '.2f')} "
            f"| {num(r.get('wall_s'), '.1f')} | {num(r.get('peak_rss_mb'), '.0f')} |")


def _problems(rows: list[Row]) -> list[str]:
    lines = []
    for r in rows:
        for key in ("error", "evaluation_error"):
            if r.get(key):
                text = str(r[key]).replace("\n", " ")[:300]
                lines.append(f"- {r['tool']}: {r['status']}: {text}")
    return lines


def _llm_section(llm: Row) -> list[str]:
    lines = [f"### {llm['title']} (decoder with a KV cache)", "", llm["caveat"], "",
             f"Quality on {llm['heldout_windows']} held-out windows of {llm['window_tokens']} "
             "tokens (gensim 4.4.0's lee.cor and two Wikipedia paragraphs, each window from an "
             "empty cache" + (", each starting with <bos> and 255 text tokens"
                              if llm.get("bos_per_window") else "") +
             "): perplexity, KL(FP32 || model) of the next-token distributions (mean, "
             "nats) and top-1 next-token agreement with FP32. Greedy same: the share of "
             f"windows whose {llm_eval.GREEDY_TOKENS} greedy tokens after its first "
             f"{llm_eval.GREEDY_PROMPT} are FP32's (in brackets: the mean share of tokens "
             "before the first that differs). Bits/weight: 32 x the size ratio. Calibration "
             f"(mixprec only; the peers are data-free): {llm['calibration_samples']} samples "
             "of 256 tokens of lee_background.cor with an empty cache. Decode: batch 1 with the "
             "cache, "
             f"{llm_eval.NEW_TOKENS} greedy tokens after a {llm_eval.PROMPT_TOKENS}-token prompt, "
             "all models stepping in lockstep (each step runs once per model before the next), "
             "tok/s = 1 / the median step time; prefill: one 256-token window, median of "
             f"{llm_eval.PREFILL_RUNS} rounds; both timed in one loop over all models after the "
             "quality runs, ratios to FP32 in the same loop. Size includes external data (a "
             "GGUF file: its size, tokenizer included); quant s and peak RSS are the quantizing "
             "process's wall time and VmHWM.", "",
             LLM_COLUMNS, "|" + "---|" * LLM_COLUMNS.count(" | ") + "---|"]
    lines += [_llm_row(r) for r in llm["rows"]]
    prompt = llm.get("sample_prompt", llm_eval.SAMPLE_PROMPT)
    lines += ["", f"Greedy samples ({llm_eval.SAMPLE_TOKENS} tokens at most) after {prompt!r}:",
              ""]
    lines += [f"- {r['tool']}: {r['sample']!r}" for r in llm["rows"] if r.get("sample")]
    notes = [f"- {r['tool']}: {r['note']}" for r in llm["rows"] if r.get("note")]
    if notes:
        lines += ["", "Notes:", "", *notes]
    problems = _problems(llm["rows"])
    if problems:
        lines += ["", "Problems:", "", *problems]
    return [*lines, ""]


def _encoder_section(enc: Row) -> list[str]:
    lines = ["### MiniLM (encoder)", "",
             f"`sentence_embedding` cosine to FP32 on {enc['eval_sentences']} held-out sentences; "
             "latency: batch of those sentences, interleaved with FP32 (as the INT8 rows); "
             f"mixprec calibrates on {enc['calibration_samples']} other sentences.", "",
             ENCODER_COLUMNS, "|" + "---|" * 9]
    lines += [_encoder_row(r) for r in enc["rows"]]
    problems = _problems(enc["rows"])
    if problems:
        lines += ["", "Problems:", "", *problems]
    return [*lines, ""]


def render(part: Row) -> str:
    flags = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in part["cpu_flags"].items())
    models = part.get("models", ["smollm2", "minilm"])
    lines = ["## Weight-only INT4/INT8", "",
             f"CPU flags: {flags}. ORT CPU, {llm_eval.THREADS} intra-op threads, spinning off; "
             f"llama.cpp {llm_eval.THREADS} threads.", ""]
    for name in models:
        if name in part:
            lines += (_encoder_section(part[name]) if name == "minilm"
                      else _llm_section(part[name]))
    if part.get("mixprec_unavailable"):
        lines += [f"mixprec rows: {part['mixprec_unavailable']}.", ""]
    lines.append("Part time: " + ", ".join(f"{name} {part[f'{name}_s']:.0f} s" for name in models
                                            if f"{name}_s" in part) + ".")
    load = part.get("load_average")
    if load:  # timings mean little on a loaded machine: say how loaded it was
        lines += [f"Load average (1, 5, 15 min) at the start: "
                  f"{', '.join(f'{v:.1f}' for v in load['start'])}; at the end: "
                  f"{', '.join(f'{v:.1f}' for v in load['end'])} "
                  f"({part['cpu_count']} logical CPUs)."]
    lines.append("")
    return "\n".join(lines)
