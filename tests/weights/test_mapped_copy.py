"""A large model given as one ``.onnx`` file (no external data) runs from a memory-mapped
copy (issue 45: SmolLM2-135M as one 652 MB file peaked at 3.78 GB held as a protobuf
beside its parsed form): the same codes as the in-memory run, the input unchanged and
still protected, and the temporary copy gone afterwards."""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers import run_ort
from mixprec.api.weight_only import quantize_weights
from mixprec.core.errors import MixprecError
from mixprec.pipeline import streamed

RNG = np.random.default_rng(451)


def _plain_model(path: Path) -> None:
    w1 = (RNG.standard_normal((64, 96)) * 0.1).astype(np.float32)
    w2 = (RNG.standard_normal((96, 32)) * 0.1).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
            helper.make_node("Relu", ["h"], ["r"], name="relu"),
            helper.make_node("MatMul", ["r", "w2"], ["y"], name="mm2"),
        ],
        "plain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 32])],
        initializer=[numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.save(model, str(path))


def test_a_large_plain_model_runs_from_a_mapped_copy_with_the_same_codes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "plain.onnx"
    _plain_model(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    samples = [{"x": RNG.standard_normal((1, 4, 64)).astype(np.float32)} for _ in range(6)]
    before = set(Path(tempfile.gettempdir()).glob("mixprec-mapped-*"))
    whole = quantize_weights(str(path), samples, weights="int4", weight_method="awq")
    monkeypatch.setattr(streamed, "MAP_ABOVE", 1000)  # these weights are 37 KB
    mapped = quantize_weights(str(path), samples, weights="int4", weight_method="awq")
    assert any("run from a memory-mapped copy" in n for n in mapped.report.notes)
    assert not any("memory-mapped copy" in n for n in whole.report.notes)
    assert set(Path(tempfile.gettempdir()).glob("mixprec-mapped-*")) == before  # removed
    x = {"x": RNG.standard_normal((1, 4, 64)).astype(np.float32)}
    outs = []
    for name, result in (("whole", whole), ("mapped", mapped)):
        out = tmp_path / f"{name}.onnx"
        result.save(out)  # the copy's files are gone: its maps still hold the weights
        outs.append(run_ort(str(out), x)["y"])
    np.testing.assert_array_equal(outs[0], outs[1])
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest
    with pytest.raises(MixprecError, match="input"):
        mapped.save(path)  # the copy remembers the file it was read from
