"""``mixprec tune --metric MODULE:FUNCTION --metric-budget S`` (API: ``metric=``,
``metric_budget=``): the tuner judges by the user's own score, loaded and called as the
INT8 guard's ``--metric`` is (labels included). Accuracy is measured in ONNX Runtime
against the labels, which are the FP32 model's own answers."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import mixprec
from helpers import run_ort
from mixprec.checks.user_metric import call_user_metric
from mixprec.cli.main import main
from mixprec.core.output_kinds import OutputKind
from mixprec.tune.metrics import top1


def _classifier() -> onnx.ModelProto:
    """x[16,16] -> MatMul -> Relu -> MatMul -> logits[16,4]; input feature 0 is raw (~1000)
    and sets fc1's INT8 input scale, so all-INT8 flips answers and fc1 must stay float."""
    rng = np.random.default_rng(5)
    w1 = rng.standard_normal((16, 32)).astype(np.float32) * 0.3
    w1[0] *= 1e-4
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h1"], name="fc1"),
            helper.make_node("Relu", ["h1"], ["r1"], name="relu1"),
            helper.make_node("MatMul", ["r1", "w2"], ["logits"], name="fc2"),
        ],
        "wide",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [16, 4])],
        [
            numpy_helper.from_array(w1, "w1"),
            numpy_helper.from_array(rng.standard_normal((32, 4)).astype(np.float32), "w2"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _labelled(model: onnx.ModelProto, n: int = 8) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    samples = []
    for _ in range(n):
        x = rng.standard_normal((16, 16)).astype(np.float32)
        x[:, 0] = rng.uniform(0, 1000, 16)
        samples.append({"x": x, "label": run_ort(model, {"x": x})["logits"].argmax(-1)})
    return samples


def accuracy(fp32, outputs, labels):
    """Top-1 accuracy against the samples' labels (the user's metric)."""
    hits = [o["logits"].argmax(-1) == lab["label"] for o, lab in zip(outputs, labels, strict=True)]
    return float(np.mean(np.concatenate(hits)))


def test_tune_meets_the_users_own_score_with_the_samples_labels():
    model = _classifier()
    data = _labelled(model)
    options = {"mode": "static", "smooth": None}
    result = mixprec.tune(model, "int8", data, metric=accuracy, metric_budget=0.99, **options)
    assert result.passed and result.budget.text == "accuracy >= 0.99", result.message
    assert "fc1" in [s.name for s in result.kept_float], result.message
    got = accuracy(None, [run_ort(result.model_proto, s) for s in data], data)
    assert got >= 0.99 and result.achieved == pytest.approx(got)
    # the all-INT8 model really misses it (measured the same way)
    all_int8 = mixprec.quantize(model, data, speed="off", guard=False, **options)
    assert accuracy(None, [run_ort(all_int8.model_proto, s) for s in data], data) < 0.99


def test_tune_cli_takes_module_function_and_refuses_mixed_budgets(tmp_path, capsys):
    model = _classifier()
    data = _labelled(model)
    src = tmp_path / "m.onnx"
    onnx.save(model, src)
    np.savez(
        tmp_path / "in.npz",
        x=np.stack([s["x"] for s in data]),
        label=np.stack([s["label"] for s in data]),
    )
    (tmp_path / "acc.py").write_text(
        "import numpy as np\n"
        "def acc(fp32, outputs, labels):\n"
        "    hits = [o['logits'].argmax(-1) == l['label'] for o, l in zip(outputs, labels)]\n"
        "    return float(np.mean(np.concatenate(hits)))\n"
    )
    out = tmp_path / "t.onnx"
    base = [
        "tune",
        str(src),
        "-o",
        str(out),
        "--dtype",
        "int8",
        "--inputs",
        str(tmp_path / "in.npz"),
    ]
    code = main([*base, "--metric", f"{tmp_path / 'acc.py'}:acc", "--metric-budget", "0.99"])
    assert code == 0 and out.exists(), capsys.readouterr()
    assert "acc >= 0.99" in capsys.readouterr().out
    code = main([*base, "--metric", "nosuchmodule_xyz:f", "--metric-budget", "0.5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--metric 'nosuchmodule_xyz:f'" in err[0], err
    code = main([*base, "--metric", "top1", "--metric-budget", "0.5"])
    assert code == 2 and "built-in top1 takes --budget" in capsys.readouterr().err
    code = main([*base, "--metric", f"{tmp_path / 'acc.py'}:acc"])
    assert code == 2 and "needs --metric-budget" in capsys.readouterr().err


def test_tune_top1_reads_the_class_axis_of_the_output_kinds():
    """tune's built-in top1 takes the model's output kinds (one home with the guard): a
    segmentation Softmax(axis=1) is read across the channels; an embedding is no class
    score."""
    ref = np.zeros((1, 5, 4, 4), np.float32)
    ref[0, 2] = 1.0
    moved = ref.copy()
    moved[0, :, 0, :] = 0.0
    moved[0, 3, 0, :] = 1.0  # one row of 4 pixels (of 16) changes class
    seg = {"p": OutputKind("top1", 1, "class scores: Softmax")}
    assert top1([{"p": ref}], [{"p": moved}], seg) == pytest.approx(12 / 16)
    with pytest.raises(mixprec.MixprecError, match="needs an output of class scores"):
        top1([{"p": ref}], [{"p": moved}])  # by shape (one rule): rank 4 holds no classes
    flat = {"p": ref[0, :, :, 0].T.copy()}  # [4, 5]: by shape, classes on the last axis
    assert top1([flat], [{"p": moved[0, :, :, 0].T.copy()}]) == pytest.approx(3 / 4)
    emb = {"p": OutputKind("cosine", -1, "an embedding")}
    with pytest.raises(mixprec.MixprecError, match="needs an output of class scores"):
        top1([{"p": ref}], [{"p": moved}], emb)


def test_a_third_parameter_with_a_default_is_the_metrics_own_option_not_the_labels():
    """The guide's detection F1 takes ``threshold=0.3`` third: it must not receive the
    labels (None without labels: ``ref > None`` raised and every check missed)."""
    ref, got = [{"p": np.array([0.1, 0.4, 0.9])}], [{"p": np.array([0.2, 0.35, 0.2])}]

    def f1(fp32_outputs, int8_outputs, threshold=0.3):
        want, have = fp32_outputs[0]["p"] > threshold, int8_outputs[0]["p"] > threshold
        return 2 * float(np.sum(want & have)) / float(np.sum(want) + np.sum(have))

    assert call_user_metric(f1, ref, got, [{}]) == pytest.approx(2 / 3)
    seen = []

    def with_labels(fp32_outputs, int8_outputs, labels=None):
        seen.append(labels)
        return 1.0

    def plain_labels(fp32_outputs, int8_outputs, labels):
        seen.append(labels)
        return 1.0

    labels = [{"y": np.array([1])}]
    call_user_metric(with_labels, ref, got, labels)
    call_user_metric(plain_labels, ref, got, labels)
    call_user_metric(lambda *args: seen.append(args[2]) or 1.0, ref, got, labels)
    assert seen == [labels, labels, labels]
