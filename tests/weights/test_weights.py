"""Weight-only INT4/INT8 (``mixprec quantize --weights``): block quantization against a
numpy reference written block by block, ONNX Runtime's MatMulNBits and
GatherBlockQuantized against ``x @ dequantize(W)`` and ``dequantize(table)[ids]``, the
lm_head at 8 bits, a tied embedding / lm_head stored once, and the command's one-line
refusals. Every model is built here with onnx.helper (a few KB each)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common
import pytest
from onnx import TensorProto, helper, numpy_helper

import mixprec
from helpers import assert_close, run_ort
from mixprec.api.weight_only import quantize_weights
from mixprec.cli.main import main
from mixprec.core.errors import MixprecError
from mixprec.core.metrics import rel_l2_error
from mixprec.runtime.cpu import parse_cpuinfo
from mixprec.weights.apply import QuantizeWeightsPass
from mixprec.weights.blocks import BlockSpec, pack_codes, quantize_rtn
from mixprec.weights.config import LayerChoice, WeightsConfig, default_accuracy_level
from mixprec.weights.methods import METHODS
from mixprec.weights.select import SelectWeightsPass, weight_decision

RNG = np.random.default_rng(7)


# --- a reference written block by block ------------------------------------------------------


def _reference(weight: np.ndarray, bits: int, block: int, symmetric: bool):
    """Codes [N, n_blocks, block], scales and zero points [N, n_blocks], one block at a
    time in float32 scalars: the rule the module doc states, not its vectorized code."""
    k, n = weight.shape
    n_blocks = -(-k // block)
    levels, mid = 2**bits - 1, 2 ** (bits - 1)
    codes = np.zeros((n, n_blocks, block), np.uint8)
    scales = np.zeros((n, n_blocks), np.float32)
    zeros = np.zeros((n, n_blocks), np.uint8)
    for col in range(n):
        for b in range(n_blocks):
            values = np.zeros(block, np.float32)
            chunk = weight[b * block : (b + 1) * block, col]
            values[: len(chunk)] = chunk
            hi, lo = np.float32(values.max()), np.float32(values.min())
            if symmetric:
                peak = hi if abs(hi) >= abs(lo) else lo
                scale, zero = np.float32(peak / np.float32(-mid)), np.float32(mid)
            else:
                lo, hi = min(lo, np.float32(0)), max(hi, np.float32(0))
                scale = np.float32((hi - lo) / np.float32(levels))
                zero = np.float32(np.clip(np.round(-lo / scale), 0, levels)) if scale else 0
            safe = scale if scale != 0 else np.float32(1)
            codes[col, b] = np.clip(np.round(values / safe) + zero, 0, levels)
            scales[col, b], zeros[col, b] = scale, zero
    return codes, scales, zeros


def _dequantized(codes, scales, zeros, k: int) -> np.ndarray:
    values = (codes.astype(np.float64) - zeros[..., None]) * scales[..., None]
    return values.reshape(codes.shape[0], -1)[:, :k].T


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("k", [64, 80])  # 80: the last block of 32 is half padding
def test_rtn_matches_the_reference_block_by_block(bits: int, symmetric: bool, k: int) -> None:
    weight = RNG.standard_normal((k, 24)).astype(np.float32)
    weight[:32, 3] = 0.0  # an all-zero block: scale 0, codes at the zero point
    q = quantize_rtn(weight, BlockSpec(bits, 32, symmetric))
    codes, scales, zeros = _reference(weight, bits, 32, symmetric)
    np.testing.assert_array_equal(q.codes, codes)
    np.testing.assert_array_equal(q.scales, scales)
    np.testing.assert_array_equal(q.zero_points, zeros)
    np.testing.assert_allclose(q.dequantize(), _dequantized(codes, scales, zeros, k), atol=1e-6)
    # round to nearest: no weight moves by more than half a step (clipped ends aside)
    step = np.abs(scales).repeat(32, axis=1)[:, :k].T
    inside = np.abs(q.dequantize() - weight) <= step / 2 + 1e-6
    assert inside.mean() > 0.99, f"{1 - inside.mean():.3%} of the weights are off the grid"


def test_packing_puts_the_first_code_in_the_low_nibble() -> None:
    codes = np.array([[1, 2, 3, 15, 7]], np.uint8)
    np.testing.assert_array_equal(pack_codes(codes, 4), [[0x21, 0xF3, 0x07]])
    np.testing.assert_array_equal(pack_codes(codes, 8), codes)


# --- small models ----------------------------------------------------------------------------


def _model(nodes, inputs, outputs, weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "g", inputs, outputs, [numpy_helper.from_array(v, k) for k, v in weights.items()]
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def _linear(k: int, n: int) -> tuple[onnx.ModelProto, np.ndarray]:
    w = (RNG.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 3, k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 3, n])
    h = helper.make_tensor_value_info("h", TensorProto.FLOAT, ["B", 3, n])
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"], name="fc"),
        helper.make_node("Relu", ["h"], ["y"]),
    ]
    return _model(nodes, [x], [y, h], {"W": w}), w


def _apply(model: onnx.ModelProto, config: WeightsConfig) -> onnx.ModelProto:
    m = ir.from_proto(model)
    SelectWeightsPass(config)(m)
    result = QuantizeWeightsPass(config, METHODS["rtn"])(m)
    assert result.modified
    common.RemoveUnusedNodesPass()(m)
    return ir.to_proto(m)


def _initializers(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_matmul_nbits_equals_x_times_dequantized_weight(bits: int, symmetric: bool) -> None:
    k, n = 80, 48  # K not a multiple of the block
    model, w = _linear(k, n)
    # its output is a graph output: the lm_head rule applies, asked for at the same bits
    config = WeightsConfig(bits=bits, symmetric=symmetric, accuracy_level=0, lm_head=f"int{bits}")
    out = _apply(model, config)
    assert _ops(out) == ["MatMulNBits", "Relu"]
    node = out.graph.node[0]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs == {"K": k, "N": n, "bits": bits, "block_size": 32, "accuracy_level": 0}
    # the stored bytes are the reference codes, packed low nibble first
    codes, scales, zeros = _reference(w, bits, 32, symmetric)
    stored = _initializers(out)
    np.testing.assert_array_equal(stored[node.input[1]], pack_codes(codes, bits))
    np.testing.assert_array_equal(stored[node.input[2]], scales.reshape(-1))
    assert (len(node.input) == 4) is (not symmetric)  # symmetric: the default zero point
    x = RNG.standard_normal((2, 3, k)).astype(np.float32)
    got = run_ort(out, {"x": x})
    expected = x.astype(np.float64) @ _dequantized(codes, scales, zeros, k)
    assert_close(expected, got["h"], "float32", name="MatMulNBits vs x @ dequant(W)")
    # and how far that is from FP32: what 4 / 8 bits cost this layer
    fp32 = run_ort(model, {"x": x})["h"]
    rel = rel_l2_error(fp32, got["h"])
    assert rel < (0.12 if bits == 4 else 0.01), f"rel L2 {rel:.3g} against FP32"


def test_accuracy_level_4_computes_with_int8_activations() -> None:
    model, w = _linear(128, 64)
    config = WeightsConfig(bits=4, accuracy_level=4, lm_head="int4")
    out = _apply(model, config)
    q = quantize_rtn(w, config.spec("int4"))
    x = RNG.standard_normal((2, 3, 128)).astype(np.float32)
    got = run_ort(out, {"x": x}, optimize=True)["h"]
    expected = x @ q.dequantize()
    rel = rel_l2_error(expected, got)
    assert 0 < rel < 0.02, f"level 4 (int8 activations per block) rel L2 {rel:.3g}"


def _embedding(v: int, h: int) -> tuple[onnx.ModelProto, np.ndarray]:
    table = RNG.standard_normal((v, h)).astype(np.float32)
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", "S"])
    out = helper.make_tensor_value_info("e", TensorProto.FLOAT, ["B", "S", h])
    nodes = [helper.make_node("Gather", ["E", "ids"], ["e"], name="embed")]
    return _model(nodes, [ids], [out], {"E": table}), table


@pytest.mark.parametrize(("embeddings", "width"), [("int8", 64), ("int4", 64), ("int4", 41)])
def test_embedding_gather_becomes_gather_block_quantized(embeddings: str, width: int) -> None:
    model, table = _embedding(30, width)
    config = WeightsConfig(embeddings=embeddings, block_size=16)
    out = _apply(model, config)
    # an odd 4-bit width is gathered as whole blocks, reshaped and sliced back
    expected_ops = ["GatherBlockQuantized"] + (["Reshape", "Slice"] if width % 2 else [])
    assert _ops(out) == expected_ops
    assert "E" not in _initializers(out)  # the float table is gone
    q = quantize_rtn(table.T, config.spec(embeddings))
    ids = RNG.integers(0, 30, (2, 5))
    got = run_ort(out, {"ids": ids})["e"]
    assert_close(q.dequantize().T[ids], got, "float32", name="rows of dequant(table)")
    assert np.abs(got - table[ids]).max() < (0.3 if embeddings == "int4" else 0.03)


def _decoder(tied: bool, vocab: int = 200, hidden: int = 64) -> onnx.ModelProto:
    """ids -> embedding -> residual MLP -> lm_head; tied: ``MatMul(h, Transpose(E))``."""
    ff = 2 * hidden
    weights = {
        "E": RNG.standard_normal((vocab, hidden)).astype(np.float32),
        "W_up": (RNG.standard_normal((hidden, ff)) / np.sqrt(hidden)).astype(np.float32),
        "W_down": (RNG.standard_normal((ff, hidden)) / np.sqrt(ff)).astype(np.float32),
    }
    nodes = [
        helper.make_node("Gather", ["E", "ids"], ["x"], name="embed"),
        helper.make_node("MatMul", ["x", "W_up"], ["u"], name="up"),
        helper.make_node("Relu", ["u"], ["r"]),
        helper.make_node("MatMul", ["r", "W_down"], ["d"], name="down"),
        helper.make_node("Add", ["x", "d"], ["h"]),
    ]
    if tied:
        nodes.append(helper.make_node("Transpose", ["E"], ["E_t"], perm=[1, 0]))
        nodes.append(helper.make_node("MatMul", ["h", "E_t"], ["logits"], name="lm_head"))
    else:
        weights["W_head"] = (RNG.standard_normal((hidden, vocab)) / 8).astype(np.float32)
        nodes.append(helper.make_node("MatMul", ["h", "W_head"], ["logits"], name="lm_head"))
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", "S"])
    logits = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", "S", vocab])
    return _model(nodes, [ids], [logits], weights)


def _bits(model: onnx.ModelProto) -> dict[str, int]:
    return {
        n.name: next(a.i for a in n.attribute if a.name == "bits")
        for n in model.graph.node
        if n.op_type in ("MatMulNBits", "GatherBlockQuantized")
    }


def test_lm_head_gets_8_bits_by_default() -> None:
    model = _decoder(tied=False)
    out = _apply(model, WeightsConfig(bits=4))
    assert _bits(out) == {"embed": 8, "up": 4, "down": 4, "lm_head": 8}
    assert _bits(_apply(model, WeightsConfig(bits=4, lm_head="int4")))["lm_head"] == 4
    kept = _apply(model, WeightsConfig(bits=4, lm_head="float", embeddings="float"))
    assert "lm_head" not in _bits(kept) and "embed" not in _bits(kept)
    assert [n.op_type for n in kept.graph.node if n.name == "lm_head"] == ["MatMul"]


def test_exclusions_and_the_per_layer_map_set_a_layers_bits() -> None:
    model = _decoder(tied=False)
    config = WeightsConfig(bits=4, exclude_nodes=("do.*",), layers={"up": "int8"})
    m = ir.from_proto(model)
    SelectWeightsPass(config)(m)
    decisions = {n.name: weight_decision(n) for n in m.graph if weight_decision(n)}
    assert decisions["down"].precision == "float"
    assert "excluded by --exclude 'do.*'" in decisions["down"].reason
    assert (decisions["up"].precision, decisions["up"].reason) == ("int8", "layers=")


def _forward(weights: dict[str, np.ndarray], ids: np.ndarray, tied: bool) -> np.ndarray:
    """The toy decoder in numpy (float64), from any weights (e.g. dequantized)."""
    x = weights["E"][ids].astype(np.float64)
    h = x + np.maximum(x @ weights["W_up"], 0) @ weights["W_down"]
    return h @ (weights["E"].T if tied else weights["W_head"])


def test_a_tied_table_is_stored_once_and_both_uses_match_its_dequantized_copy() -> None:
    model = _decoder(tied=True)
    config = WeightsConfig(bits=4, accuracy_level=0)
    out = _apply(model, config)
    nodes = {n.name: n for n in out.graph.node}
    gather, head = nodes["embed"], nodes["lm_head"]
    assert gather.op_type == "GatherBlockQuantized" and head.op_type == "MatMulNBits"
    assert gather.input[0] == head.input[1]  # the Gather reads the lm_head's 8-bit codes
    assert "E" not in _initializers(out)
    ids = RNG.integers(0, 200, (2, 6))
    dequantized = {
        name: quantize_rtn(w, config.spec("int8" if name == "E" else "int4")).dequantize()
        for name, w in (("E", _initializers(model)["E"].T), *_mlp(model))
    }
    dequantized["E"] = dequantized["E"].T
    got = run_ort(out, {"ids": ids})["logits"]
    assert_close(_forward(dequantized, ids, tied=True), got, "float32", name="logits")
    # the float table took 51 KB; its one 8-bit copy takes a quarter of that
    before, after = model.ByteSize(), out.ByteSize()
    assert after < 0.4 * before, f"{after} bytes of {before}"


def test_ids_of_unknown_rank_get_their_own_rows_layout_copy() -> None:
    model = _decoder(tied=True)
    model.graph.input[0].type.tensor_type.ClearField("shape")  # ids: rank unknown
    model.graph.output.append(helper.make_tensor_value_info("x", TensorProto.FLOAT, None))
    out = _apply(model, WeightsConfig(bits=4))
    nodes = {n.name: n for n in out.graph.node}
    assert nodes["embed"].input[0] != nodes["lm_head"].input[1]  # no reshape back possible
    assert "Reshape" not in _ops(out)
    table = _initializers(model)["E"]
    ids = RNG.integers(0, 200, (2, 3))
    rows = quantize_rtn(table.T, WeightsConfig().spec("int8")).dequantize().T[ids]
    assert_close(rows, run_ort(out, {"ids": ids})["x"], "float32", name="embedding rows")


def _mlp(model: onnx.ModelProto) -> list[tuple[str, np.ndarray]]:
    weights = _initializers(model)
    return [(k, weights[k]) for k in ("W_up", "W_down")]


def test_a_tie_by_equal_values_and_an_embedding_at_other_bits_get_their_own_codes() -> None:
    tied = _decoder(tied=True)
    # an exporter that folded the Transpose: a second initializer equal to E.T
    untied_copy = onnx.ModelProto()
    untied_copy.CopyFrom(tied)
    table = _initializers(tied)["E"]
    graph = untied_copy.graph
    graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(table.T), "E_t"))
    graph.node.remove(next(n for n in graph.node if n.op_type == "Transpose"))
    out = _apply(untied_copy, WeightsConfig(bits=4))
    nodes = {n.name: n for n in out.graph.node}
    assert nodes["embed"].input[0] == nodes["lm_head"].input[1]
    assert not {"E", "E_t"} & set(_initializers(out))
    # int4 embeddings beside an int8 lm_head: two copies, each its own layout
    apart = _apply(tied, WeightsConfig(bits=4, embeddings="int4"))
    nodes = {n.name: n for n in apart.graph.node}
    assert nodes["embed"].input[0] != nodes["lm_head"].input[1]
    assert _bits(apart) == {"embed": 4, "up": 4, "down": 4, "lm_head": 8}


def test_default_accuracy_level_follows_the_cpu() -> None:
    vnni = parse_cpuinfo("flags\t: sse avx2 avx512f avx512_vnni\n")
    old = parse_cpuinfo("flags\t: sse sse2\n")
    assert default_accuracy_level(4, vnni)[0] == 4
    assert default_accuracy_level(8, vnni)[0] == 4
    assert default_accuracy_level(8, old)[0] == 4  # 8 bits has no fast float path at all
    if default_accuracy_level(4, old)[0] == 0:  # x86 without int8 kernels
        assert "no int8 kernels" in default_accuracy_level(4, old)[1]
    assert WeightsConfig(accuracy_level=0).level(4) == (0, "0 (as asked)")


def test_kernel_capabilities_are_asked_of_the_engine() -> None:
    """Issue 44: no config reads the CPU's flags; the engine that runs the kernels says
    whether u8 x s8 saturates (7-bit INT8 weights) and which accuracy level runs
    MatMulNBits fastest, from the CPU's features."""
    import platform

    from mixprec.int8.config import QuantizeConfig
    from mixprec.runtime.cpu import cpu_features, saturates_u8s8
    from mixprec.runtime.engines import engine_for

    avx2 = parse_cpuinfo("flags\t: sse avx2 fma\n")
    vnni = parse_cpuinfo("flags\t: sse avx2 avx512f avx512_vnni\n")
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    assert saturates_u8s8(avx2) is x86 and not saturates_u8s8(vnni)
    ort = engine_for("ort")
    assert ort.saturates_int8() == saturates_u8s8(cpu_features())
    assert QuantizeConfig().reduce_range == ort.saturates_int8()
    assert ort.nbits_accuracy_level(4, vnni) == default_accuracy_level(4, vnni)
    assert "INT8 VNNI" in ort.nbits_accuracy_level(4, vnni)[1]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"block_size": 48}, "block_size must be a power of two: 16, 32, 64, 128, 256"),
        ({"bits": 3}, "bits must be 4 or 8"),
        ({"lm_head": "int2"}, "lm_head must be one of int4, int8, float"),
        (
            {"method": "gptq-typo"},
            "weight method must be one of auto, awq, awq-gptq, gptq, rtn, search",
        ),
    ],
)
def test_bad_options_are_one_line(options: dict, message: str) -> None:
    with pytest.raises(MixprecError, match=message):
        WeightsConfig(**options)


def test_api_refuses_int8_options_with_weights() -> None:
    model, _ = _linear(64, 32)
    with pytest.raises(MixprecError, match="with weights=, method=, mode= do not apply"):
        mixprec.quantize(model, weights="int4", method="mse", mode="static")


def test_the_guard_hook_can_requantize_with_a_layer_map() -> None:
    """A guard (the language-model guard's seam) sees the checks' samples and can quantize
    again with other per-layer bits: here it moves 'up' to 8 bits and says so."""
    seen = {}

    def guard(model, report, context):
        seen["samples"], seen["where"] = len(context.samples), context.where
        layers = {"up": LayerChoice("int8", "8 bits: the most sensitive layer")}
        model, report = context.requantize(dataclasses.replace(context.config, layers=layers))
        report.guard = {"passed": True, "summary": "repaired"}
        return model, report

    samples = [{"ids": RNG.integers(0, 200, (1, 8))} for _ in range(3)]
    result = quantize_weights(_decoder(tied=False), samples, "int4", weights_guard=guard)
    assert seen == {"samples": 3, "where": "calibration samples"}
    assert _bits(result.model_proto)["up"] == 8
    assert result.report.guard["summary"] == "repaired"
    row = next(n for n in result.report.nodes if n.name == "up")
    assert (row.precision, row.reason) == ("int8", "8 bits: the most sensitive layer")
    unchecked = quantize_weights(_decoder(tied=False), samples, "int4", guard=False)
    assert unchecked.report.guard is None
    assert any("output check off" in note for note in unchecked.report.notes)


# --- the command ---------------------------------------------------------------------------


def _write(tmp_path: Path, model: onnx.ModelProto) -> tuple[Path, Path]:
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    ids = RNG.integers(0, 200, (6, 1, 8))
    np.savez(tmp_path / "calib.npz", ids=ids)
    return path, tmp_path / "calib.npz"


def test_cli_writes_a_smaller_model_onnx_runtime_runs(tmp_path: Path, capsys) -> None:
    model = _decoder(tied=False, vocab=512, hidden=128)
    model.ir_version = 14  # what onnx 1.23 writes by default; ONNX Runtime 1.31 refuses it
    path, calib = _write(tmp_path, model)
    out = tmp_path / "model.int4.onnx"
    rc = main(["quantize", str(path), "-o", str(out), "--weights", "int4",
               "--calibration-data", str(calib)])  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0, text
    want = "MatMul 2 int4, 1 int8; outputs vs FP32 on 1 held-out calibration sample: 'logits'"
    assert want in text, text
    written = onnx.load(str(out))
    assert written.ir_version == 10
    assert {"MatMulNBits", "GatherBlockQuantized"} <= set(_ops(written))
    ratio = out.stat().st_size / path.stat().st_size
    assert ratio < 0.3, f"int4 (int8 lm_head and embeddings) is {ratio:.2f}x the FP32 file"
    ids = RNG.integers(0, 512, (1, 8))
    fp32, got = run_ort(model, {"ids": ids})["logits"], run_ort(written, {"ids": ids})["logits"]
    agree = np.mean(fp32.argmax(-1) == got.argmax(-1))
    assert agree >= 0.75, f"top-1 agreement with FP32 {agree:.2f}"


def _refused(tmp_path: Path, capsys, model: onnx.ModelProto, *extra: str) -> str:
    path, calib = _write(tmp_path, model)
    out = tmp_path / "out.onnx"
    args = ["quantize", str(path), "-o", str(out), "--calibration-data", str(calib), "--quiet"]
    rc = main([*args, *extra])  # --quiet: no progress lines on a loaded machine (past 1 s)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert not out.exists()
    return err[0]


def test_cli_refuses_a_model_without_weights(tmp_path: Path, capsys) -> None:
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", "S"])
    y = helper.make_tensor_value_info("y", TensorProto.INT64, ["B", "S"])
    model = _model([helper.make_node("Neg", ["ids"], ["y"])], [ids], [y], {})
    line = _refused(tmp_path, capsys, model, "--weights", "int4")
    assert "no MatMul with a constant 2-D float32 weight" in line


def test_cli_refuses_a_bad_block_size_and_int8_options(tmp_path: Path, capsys) -> None:
    model = _decoder(tied=False)
    line = _refused(tmp_path, capsys, model, "--weights", "int4", "--block-size", "48")
    assert "block_size must be a power of two: 16, 32, 64, 128, 256, not 48" in line
    line = _refused(tmp_path, capsys, model, "--weights", "int8", "--mode", "static")
    assert "--mode applies to INT8 only, not with --weights" in line
    line = _refused(tmp_path, capsys, model, "--weights", "int4", "--smooth", "--no-equalize")
    assert "--equalize/--no-equalize, --smooth/--no-smooth apply to INT8 only" in line
    line = _refused(tmp_path, capsys, model, "--block-size", "64")
    assert "--block-size needs --weights int4|int8" in line


def test_cli_never_writes_a_model_onnx_runtime_cannot_load(tmp_path: Path, capsys) -> None:
    model = _decoder(tied=False)
    # an op of a domain ONNX Runtime does not know: the quantized model cannot load
    model.graph.node.append(helper.make_node("Mystery", ["logits"], ["z"], domain="my.ops"))
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, ["B", "S", 200])
    model.graph.output.append(z)
    model.opset_import.append(helper.make_opsetid("my.ops", 1))
    line = _refused(tmp_path, capsys, model, "--weights", "int4")
    assert "ONNX Runtime cannot run the weight-only model (not written)" in line


# --- a decoder with a KV cache (tests/llm_models.py, when present) ------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_a_kv_cache_decoder_keeps_its_signature_and_decodes_like_fp32(tied: bool) -> None:
    llm = pytest.importorskip("llm_models")
    cfg = llm.DecoderConfig(tied=tied)
    model = llm.tiny_decoder(cfg)
    samples = [llm.decoder_feeds(cfg, seed=s) for s in range(3)]
    result = mixprec.quantize(model, samples, weights="int8", block_size=16)
    out = result.model_proto
    assert [i.name for i in out.graph.input] == [i.name for i in model.graph.input]
    assert [o.name for o in out.graph.output] == [o.name for o in model.graph.output]
    weighted = 7 * cfg.layers + 1  # q, k, v, o, gate, up, down per layer; the lm_head
    assert _ops(out).count("MatMulNBits") == weighted
    assert result.report.guard["passed"], result.report.guard["summary"]
    if tied:  # the embedding reads the lm_head's codes
        gather = next(n for n in out.graph.node if n.op_type == "GatherBlockQuantized")
        head = next(n for n in out.graph.node if n.name == "lm_head")
        assert gather.input[0] == head.input[1]
    feeds = llm.decoder_feeds(cfg, seed=9)
    fp32, got = run_ort(model, feeds), run_ort(out, feeds)
    for name in ("logits", *cfg.present_names()):
        rel = rel_l2_error(fp32[name], got[name])
        assert rel < 0.02, f"{name}: rel L2 {rel:.3g} at 8 bits"
    # greedy decoding through the cache, from an empty past: a random-weight decoder has
    # near-tied logits, so only the first tokens are held to agree
    prompt = np.arange(1, 9)
    tokens = [llm.greedy_decode(lambda f, m=m: run_ort(m, f), cfg, prompt, 4) for m in (model, out)]
    assert tokens[0] == tokens[1]


@pytest.fixture
def methods_restored():
    """METHODS as it was after the test (every reader holds the one dict)."""
    before = dict(METHODS)
    yield
    METHODS.clear()
    METHODS.update(before)


def test_a_registered_method_is_what_auto_and_its_name_run(methods_restored) -> None:
    """``register_method`` is the seam a new method plugs into (weights/methods.py): the
    preferred one is what "auto" runs, and a name reaches it too."""
    from mixprec.weights.methods import WeightMethod, register_method, resolve_method

    seen: list[tuple[int, int]] = []

    def counted(weight: np.ndarray, spec: BlockSpec, inputs: object | None):
        seen.append(weight.shape)
        return quantize_rtn(weight, spec)

    register_method(WeightMethod("counted", counted, False, "RTN, counted"), preferred=True)
    method, why = resolve_method("auto", has_data=False)
    assert method.name == "counted" and why.startswith("weight method auto -> counted"), why
    model, w = _linear(64, 32)
    auto = mixprec.quantize(model, weights="int4", block_size=32)
    assert seen == [w.shape], seen
    named = mixprec.quantize(model, weights="int4", block_size=32, weight_method="counted")
    rtn = mixprec.quantize(model, weights="int4", block_size=32, weight_method="rtn")
    assert len(seen) == 2
    packed = [_initializers(ir.to_proto(m.model)) for m in (auto, named, rtn)]
    assert packed[0].keys() == packed[2].keys() and all(
        np.array_equal(packed[0][k], packed[2][k]) and np.array_equal(packed[1][k], packed[2][k])
        for k in packed[2]
    )


def test_the_weight_only_guard_reads_outputs_as_rows() -> None:
    """Issue 43/44: the weight-only check reads each output as the INT8 guard does (one
    OutputCheck schema: class scores by argmax rows, embedding rows at the cosine bound
    and their neighbours; rel L2 a second figure), reports a reading below the INT8
    defaults unless a budget is given, and fails where a budget is given and missed."""
    rng = np.random.default_rng(44)  # its own draws: the values below do not move
    base, _ = _linear(64, 48)

    def with_weights(w: np.ndarray) -> onnx.ModelProto:
        g = base.graph
        return _model(list(g.node), list(g.input), list(g.output), {"W": w.astype(np.float32)})

    model = with_weights(rng.standard_normal((64, 48)) / 8.0)
    data = [{"x": rng.standard_normal((2, 3, 64)).astype(np.float32)} for _ in range(4)]
    result = mixprec.quantize(model, data, weights="int8", block_size=32, weight_method="rtn")
    guard = result.report.guard
    kinds = {(c["output"], c["kind"]) for c in guard["checks"]}
    assert {("h", "top1"), ("y", "row-cosine"), ("y", "neighbours")} == kinds, kinds
    assert all("rel_l2" in c and "reason" in c for c in guard["checks"])
    assert all(c["rows"] == 4 * 2 * 3 and c["passed"] for c in guard["checks"]), guard
    assert "'y' rows at the cosine bound 1, nearest neighbours kept 1" in guard["summary"]
    assert guard["passed"] and "reported only" not in guard["summary"]

    # one outlier per block of 32 that the inputs never read: RTN's 4-bit step is then
    # wider than every weight the output depends on, and they all round to zero
    weights = rng.standard_normal((64, 48)) * 0.05
    weights[::32] = 1000.0
    lossy = with_weights(weights)
    for feeds in data:
        feeds["x"][..., ::32] = 0.0
    options = {"weights": "int4", "block_size": 32, "weight_method": "rtn", "ratio": 1.0}
    reported = mixprec.quantize(lossy, data, **options).report.guard
    cosine = next(c for c in reported["checks"] if c["kind"] == "row-cosine")
    assert cosine["value"] < 0.5 and not cosine["passed"], cosine
    assert reported["passed"] and "reported only" in reported["summary"], reported["summary"]
    held = mixprec.quantize(lossy, data, max_drop=0.1, **options).report.guard
    assert not held["passed"] and "output check FAILED" in held["summary"], held["summary"]


def test_the_check_samples_are_held_out_of_the_calibration() -> None:
    """The weight-only check draws its samples from the guard's one split (a seeded fifth
    of the calibration samples, at most 4), so a data-aware method is never checked on
    the samples it fitted; with too few samples every one does both, and says so."""
    from mixprec.checks.guard_samples import WINDOWS_HELD_OUT_SHARE, held_out_indices

    model, _ = _linear(64, 48)
    data = [{"x": RNG.standard_normal((2, 3, 64)).astype(np.float32)} for _ in range(10)]
    options = {"weights": "int4", "block_size": 32, "ratio": 1.0}
    guard = mixprec.quantize(model, data, **options).report.guard
    held = held_out_indices(10, share=WINDOWS_HELD_OUT_SHARE, cap=4)
    assert len(held) == 2 and guard["samples"] == 2, guard
    assert guard["eval"] == "held-out calibration samples", guard["eval"]
    assert "on 2 held-out calibration samples" in guard["summary"], guard["summary"]
    few = mixprec.quantize(model, data[:3], **options).report.guard
    assert few["samples"] == 3 and few["eval"] == "calibration samples", few
    given = mixprec.quantize(model, data, eval_data=data[:1], **options).report.guard
    assert given["samples"] == 1 and given["eval"] == "eval samples", given
