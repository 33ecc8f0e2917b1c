"""Run ONE peer weight-only quantizer on ONE model; meant to run in its own subprocess
(see weights.py, which measures its wall time and peak RSS).

    python -m bench.weights.weights_one TOOL IN.onnx OUT.onnx RESULT.json

Tools (ONNX Runtime 1.31.1 and NNCF 3.4.0 of the bench environment):
  ort-int4-b32-sym       onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer
                         (bits=4, block_size=32, is_symmetric=True): its default algorithm,
                         RTN into MatMulNBits (MatMul weights only)
  ort-int4-b32-sym-acc4  the same with accuracy_level=4 (int8 compute)
  ort-int4-b128-asym     bits=4, block_size=128, is_symmetric=False
  ort-int8-b128-acc4     bits=8, block_size=128, is_symmetric=False, accuracy_level=4: ORT
                         1.31 selects 8 bits with `bits=8` on the same default config
                         (DefaultWeightOnlyQuantConfig), UINT8 weights with zero points
  ort-kquant-q4km-b32-acc4  the same quantizer with KQuantWeightOnlyQuantConfig (ORT's
                         k-quant search of scale and zero point per block), block 32,
                         accuracy_level=4, and llama.cpp's Q4_K_M layer rule as
                         onnxruntime-genai's `k_quant_mixed` applies it: 8 bits for lm_head, and
                         for v_proj and down_proj on the layers llama.cpp's use_more_bits picks
                         (the first n/8, the last n/8 and every third layer between), 4 bits
                         elsewhere (customized_weight_config per MatMul node)
  llamacpp-q4km          llama-cpp-python's llama_model_quantize (llama.cpp's llama-quantize as a
                         library call) from the model's own GGUF file (IN is that file, OUT a
                         .gguf) to Q4_K_M, allow_requantize: the file's weights are dequantized
                         and quantized again, i.e. the weights the FP32 ONNX model holds
  llamacpp-q4_0 / -q5km  the same to Q4_0 (4 bits, blocks of 32, one scale) and Q5_K_M
  llamacpp-iq4xs         the same to IQ4_XS (4-bit non-linear codebook, super-blocks of 256,
                         6-bit sub-block scales) without an importance matrix: llama-cpp-python
                         ships no llama-imatrix, and llama.cpp needs none for IQ4_XS. Rows
                         not a multiple of 256 (Qwen2.5's 896) fall back to IQ4_NL (blocks of 32)
  nncf-int4-sym-g128     nncf.compress_weights(model, mode=INT4_SYM, group_size=128), ONNX
                         backend, data-free, its defaults otherwise (ratio 1; embeddings and
                         the last MatMul at its INT8_ASYM backup precision), with
                         group_size_fallback_mode=ADJUST: its default (ERROR) refuses a weight
                         whose input dim 128 does not divide (SmolLM2's 576); ADJUST gives
                         those the largest power of two below 128 that divides (64). Below
                         opset 21
                         it writes MatMulNBits without declaring the com.microsoft domain,
                         which onnx.checker refuses: the declaration is added here (counted
                         in the timed span, as a user would have to). A model with external
                         data is loaded without it and its folder given as NNCF's
                         EXTERNAL_DATA_DIR backend parameter (NNCF's way above 2 GB)
  nncf-int4-sym-g128-onebias  the same, then the bias Adds NNCF leaves after MatMulNBits
                         nodes that already carry that bias removed: NNCF 3.4.0 adds
                         Qwen2's q/k/v biases twice (_drop_double_bias); not a user's result,
                         NNCF's rounding without that defect

The output is written as one file when it fits in 2 GB, else with external data. The
timed span (`convert_s`) covers loading IN, quantizing and writing OUT; imports apart.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.precision.convert_one import Unavailable, measure_and_write

#: tool -> (bits, block size, symmetric, accuracy level)
ORT_TOOLS: dict[str, tuple[int, int, bool, int | None]] = {
    "ort-int4-b32-sym": (4, 32, True, None),
    "ort-int4-b32-sym-acc4": (4, 32, True, 4),
    "ort-int4-b128-asym": (4, 128, False, None),
    "ort-int8-b128-acc4": (8, 128, False, 4),
}
KQUANT_TOOL = "ort-kquant-q4km-b32-acc4"
LLAMACPP_TOOL = "llamacpp-q4km"
#: llama.cpp tool -> (file type name, its number in enum llama_ftype)
LLAMACPP_TOOLS = {LLAMACPP_TOOL: ("Q4_K_M", 15), "llamacpp-q4_0": ("Q4_0", 2),
                  "llamacpp-q5km": ("Q5_K_M", 17), "llamacpp-iq4xs": ("IQ4_XS", 30)}
NNCF_TOOL = "nncf-int4-sym-g128"
#: NNCF's output with its second bias Add removed (see _drop_double_bias)
NNCF_FIXED = "nncf-int4-sym-g128-onebias"
TOOLS = (*ORT_TOOLS, KQUANT_TOOL, NNCF_TOOL, NNCF_FIXED, *LLAMACPP_TOOLS)


def is_llamacpp(tool: str) -> bool:
    """Whether ``tool`` is a llama.cpp quantization (a GGUF file, decoders only)."""
    return tool in LLAMACPP_TOOLS
TWO_GB = 2**31 - 1


def save(model: Any, out: str) -> None:
    import onnx

    large = model.ByteSize() > TWO_GB
    onnx.save(model, out, save_as_external_data=large, location=f"{out.rsplit('/', 1)[-1]}.data")


def _ort(args: argparse.Namespace) -> Callable[[], dict[str, Any]]:
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    except ImportError as exc:
        raise Unavailable(f"MatMulNBitsQuantizer not importable: {exc}") from exc
    bits, block, symmetric, level = ORT_TOOLS[args.tool]

    def run() -> dict[str, Any]:
        import onnx

        quantizer = MatMulNBitsQuantizer(onnx.load(args.model), bits=bits, block_size=block,
                                         is_symmetric=symmetric, accuracy_level=level)
        quantizer.process()
        save(quantizer.model.model, args.out)
        return {"options": {"bits": bits, "block_size": block, "is_symmetric": symmetric,
                            "accuracy_level": level}}

    return run


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits (src/llama-quant.cpp), integer division as in C."""
    return (layer < layers // 8 or layer >= 7 * layers // 8
            or (layer - layers // 8) % 3 == 2)


def q4km_eight_bit_nodes(model: Any) -> dict[str, dict[str, int]]:
    """The MatMul nodes the Q4_K_M rule puts at 8 bits: lm_head, and v_proj / down_proj of
    the layers use_more_bits picks (layer numbers from the exporter's node names)."""
    import re

    matmuls = [n.name for n in model.graph.node if n.op_type == "MatMul"]
    layer_of = {name: int(m.group(1)) for name in matmuls
                if (m := re.search(r"layers\.(\d+)/", name))}
    layers = max(layer_of.values()) + 1 if layer_of else 0
    picked = [name for name in matmuls if "lm_head" in name]
    picked += [name for name, i in layer_of.items()
               if ("v_proj" in name or "down_proj" in name) and use_more_bits(i, layers)]
    return {name: {"bits": 8} for name in picked}


def _kquant(args: argparse.Namespace) -> Callable[[], dict[str, Any]]:
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import (
            KQuantWeightOnlyQuantConfig,
            MatMulNBitsQuantizer,
        )
    except ImportError as exc:
        raise Unavailable(f"KQuantWeightOnlyQuantConfig not importable: {exc}") from exc

    def run() -> dict[str, Any]:
        import onnx

        model = onnx.load(args.model)
        eight = q4km_eight_bit_nodes(model)
        config = KQuantWeightOnlyQuantConfig(customized_weight_config=eight)
        quantizer = MatMulNBitsQuantizer(model, bits=4, block_size=32, is_symmetric=False,
                                         accuracy_level=4, algo_config=config)
        quantizer.process()
        save(quantizer.model.model, args.out)
        return {"options": {"algorithm": "k_quant", "bits": 4, "block_size": 32,
                            "accuracy_level": 4, "eight_bit_nodes": sorted(eight)}}

    return run


def _llamacpp(args: argparse.Namespace) -> Callable[[], dict[str, Any]]:
    try:
        import llama_cpp
    except Exception as exc:
        raise Unavailable(f"llama_cpp not importable: {exc}") from exc

    name, ftype = LLAMACPP_TOOLS[args.tool]

    def run() -> dict[str, Any]:
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = ftype
        params.nthread = 2
        params.allow_requantize = True
        code = llama_cpp.llama_model_quantize(args.model.encode(), args.out.encode(),
                                              params)
        if code != 0:
            raise RuntimeError(f"llama_model_quantize returned {code}")
        return {"version": llama_cpp.__version__,
                "options": {"ftype": name, "allow_requantize": True, "nthread": 2}}

    return run


def _nncf(args: argparse.Namespace) -> Callable[[], dict[str, Any]]:
    try:
        import nncf
        import onnx
    except Exception as exc:
        raise Unavailable(f"nncf not importable: {exc}") from exc

    def run() -> dict[str, Any]:
        from nncf.onnx.quantization.backend_parameters import BackendParameters
        from nncf.quantization.advanced_parameters import (
            AdvancedCompressionParameters,
            GroupSizeFallbackMode,
        )
        from onnx.external_data_helper import load_external_data_for_model, uses_external_data

        # NNCF's way for a model over 2 GB: loaded without its external data, the data's
        # folder given as EXTERNAL_DATA_DIR (loaded whole, its shape inference cannot
        # serialize the proto: "EncodeError: Failed to serialize proto")
        model = onnx.load(args.model, load_external_data=False)
        folder = str(Path(args.model).resolve().parent)
        external = any(uses_external_data(t) for t in model.graph.initializer)
        backend = {BackendParameters.EXTERNAL_DATA_DIR: folder} if external else {}
        adjust = AdvancedCompressionParameters(
            group_size_fallback_mode=GroupSizeFallbackMode.ADJUST, backend_params=backend)
        compressed = nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT4_SYM,
                                           group_size=128, advanced_parameters=adjust)
        notes: dict[str, str] = {}
        if external:  # what it left uncompressed still points at the input's data file
            load_external_data_for_model(compressed, folder)
            notes["external_data"] = f"loaded without external data, EXTERNAL_DATA_DIR={folder}"
        if args.tool == NNCF_FIXED:
            notes["double_bias_adds_removed"] = str(_drop_double_bias(compressed))
        domains = {o.domain for o in compressed.opset_import}
        uses_ms = any(n.domain == "com.microsoft" for n in compressed.graph.node)
        if uses_ms and "com.microsoft" not in domains:
            compressed.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
            notes["opset_added"] = "com.microsoft 1 (NNCF wrote MatMulNBits without it)"
        save(compressed, args.out)
        options = {"mode": "INT4_SYM", "group_size": 128, "group_size_fallback_mode": "adjust",
                   "external_data_dir": bool(external)}
        return {"version": nncf.__version__, "options": options, **notes}

    return run


def _drop_double_bias(model: Any) -> int:
    """NNCF 3.4.0's ONNX backend folds a MatMul's bias into MatMulNBits' bias input but
    keeps the ``Add(bias, y)`` after it (Qwen2's q/k/v, the bias as the Add's first
    input), so the bias is added twice. Remove those Adds (their output renamed to the
    MatMulNBits'); returns how many."""
    consumers: dict[str, list[Any]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    dropped = []
    rename: dict[str, str] = {}
    for node in model.graph.node:
        if node.op_type != "MatMulNBits" or len(node.input) < 6 or not node.input[5]:
            continue
        after = consumers.get(node.output[0], [])
        if len(after) == 1 and after[0].op_type == "Add" and node.input[5] in after[0].input:
            dropped.append(after[0])
            rename[after[0].output[0]] = node.output[0]
    if not dropped:
        raise RuntimeError("no bias Add after a MatMulNBits that carries it: nothing to fix")
    if any(out.name in rename for out in model.graph.output):
        raise RuntimeError("a graph output is a double-bias Add")
    for add in dropped:
        model.graph.node.remove(add)
    for node in model.graph.node:
        node.input[:] = [rename.get(name, name) for name in node.input]
    return len(dropped)


def build(args: argparse.Namespace) -> Callable[[], dict[str, Any]]:
    if args.tool in ORT_TOOLS:
        return _ort(args)
    if args.tool in (NNCF_TOOL, NNCF_FIXED):
        return _nncf(args)
    if args.tool == KQUANT_TOOL:
        return _kquant(args)
    if is_llamacpp(args.tool):
        return _llamacpp(args)
    raise Unavailable(f"unknown tool {args.tool}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run one weight-only quantizer on one model.")
    parser.add_argument("tool", choices=TOOLS)
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("result")
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"tool": args.tool, "model": args.model, "out": args.out}
    return measure_and_write(lambda: build(args), args.out, args.result, result, "quantizer")


if __name__ == "__main__":
    sys.exit(main())
