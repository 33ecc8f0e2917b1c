"""RTN against GPTQ and mixed 4/8 bits on SmolLM2-135M (weight-only int4), measured with
llm_eval.py: held-out perplexity, KL and next-token agreement against FP32, parameter size,
and decode speed of the chosen rows. The layer statistics are collected once and shared by
every GPTQ row (the same calibration windows). Run from bench/ with the dev venv:

    ../.venv/bin/python weights_methods.py OUT_DIR [--model smollm2|gemma3] [config ...]

config: method:block:sym|asym:ratio (ratio "auto" = the default choice), e.g. gptq:32:asym:auto.
gemma3's windows (held-out and calibration) start with its <bos>, as bench/weights/suite.py's.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import onnx

from bench.harness.common import derived_dir
from bench.weights import llm_eval
from mixprec.pipeline.weight_only import quantize_weights_once
from mixprec.weights.config import WeightsConfig
from mixprec.weights.methods import METHODS
from mixprec.weights.stats import WeightsData

DEFAULT = ["rtn:32:asym:1", "gptq:32:asym:1", "gptq:32:asym:auto", "rtn:128:asym:1",
           "gptq:128:asym:1", "gptq:128:sym:1", "rtn:128:sym:1"]


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    name = "smollm2"
    if len(argv) > 2 and argv[1] == "--model":
        name, argv = argv[2], [argv[0], *argv[3:]]
    folder = derived_dir() / name
    tok = llm_eval.load_tokenizer(folder)
    bos = tok.token_to_id("<bos>") if name == "gemma3" else None
    fp32 = llm_eval.Decoder.open(folder / "model.onnx")
    stream = llm_eval.token_stream(tok, llm_eval.HELDOUT_FILES, special=bos is None)
    texts = llm_eval.windows(stream, 8, bos=bos)
    ref = llm_eval.Reference(fp32, texts, out)
    rows = {"fp32": ref.quality()}
    print(json.dumps(rows["fp32"]), flush=True)
    source = onnx.load(str(folder / "model.onnx"))
    data = WeightsData(llm_eval.calibration_samples(tok, fp32, count=8, bos=bos))
    for spec in argv[1:] or DEFAULT:
        method, block, sym, ratio = spec.split(":")
        config = WeightsConfig(bits=4, block_size=int(block), symmetric=sym == "sym",
                               method=method, ratio=None if ratio == "auto" else float(ratio))
        begin = time.perf_counter()
        model, report = quantize_weights_once(source, config, METHODS[method], None, data)
        spent = time.perf_counter() - begin
        path = out / f"{spec.replace(':', '_')}.onnx"
        import onnx_ir as ir
        ir.save(model, path, external_data=path.name + ".data")
        row = ref.compare(llm_eval.Decoder.open(path))
        row.update(seconds=spent, size=llm_eval.file_size(path),
                   fp32_size=llm_eval.file_size(folder / "model.onnx"),
                   int8_layers=len((report.quantization or {}).get("mixed", {})
                                   .get("int8", {})),
                   notes=[n for n in report.notes
                          if "mixed" in n or "statistics" in n or "AWQ" in n])
        row["size_x"] = row["size"] / row["fp32_size"]
        row["ppl_change"] = row["perplexity"] / rows["fp32"]["perplexity"] - 1
        rows[spec] = row
        print(spec, json.dumps(row), flush=True)
        (out / "results.json").write_text(json.dumps(rows, indent=1))
        if spec.endswith("auto"):
            (out / "scores.json").write_text(json.dumps(report.quantization.get("mixed", {}),
                                                        indent=1))
    ref.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
