"""The output kinds (:mod:`mixprec.core.output_kinds`): what each graph output holds, read
as its users read it, with the reason; the one home that the guard, validate and tune
share. Every graph is a small text model; the class-axis reads are checked against
numpy references (and ONNX Runtime for validate)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from helpers import make_model, run_ort
from mixprec.core.metrics import compare_outputs, row_cosines
from mixprec.core.output_kinds import classify_outputs, shape_class_axis


def _kinds(text: str) -> dict[str, tuple[str, str]]:
    kinds = classify_outputs(ir.from_proto(make_model(text)))
    return {name: (kind.spec, kind.reason) for name, kind in kinds.items()}


HEAD = '<ir_version: 8, opset_import: ["" : 17]>'


def test_plain_logits_are_class_scores_on_their_class_axis():
    kinds = _kinds(f"""{HEAD}
    g (float[N, 8] x, float[1, 4, 6, 6] img) => (float[N, 5] logits, float[N, 5] biased,
                                                 float[1, 3, 1, 1] pooled, float[1, 3] flat)
    <float[8, 5] w = {{{",".join(["0.1"] * 40)}}}, float[5] b = {{1, 2, 3, 4, 5}},
     float[3, 4, 1, 1] k = {{{",".join(["0.2"] * 12)}}}>
    {{
        logits = MatMul(x, w)
        mm = MatMul(x, w)
        biased = Add(mm, b)
        c = Conv(img, k)
        pooled = GlobalAveragePool(c)
        p2 = GlobalAveragePool(c)
        flat = Flatten(p2)
    }}""")
    assert kinds["logits"][0] == "top1" and "plain logits: MatMul" in kinds["logits"][1]
    assert "5 classes" in kinds["logits"][1]
    assert kinds["biased"][0] == "top1"  # a bias Add after the MatMul
    assert kinds["pooled"][0] == "top1@1", kinds["pooled"]  # the channels of [1, 3, 1, 1]
    assert "then GlobalAveragePool" in kinds["pooled"][1]
    assert kinds["flat"][0] == "top1", kinds["flat"]  # flattened: the last axis


def test_an_axis_of_size_1_is_never_a_class_axis():
    kinds = _kinds(f"""{HEAD}
    g (float[N, 8] x) => (float[N, 1] score, float[N, 1] prob)
    <float[8, 1] w = {{{",".join(["0.1"] * 8)}}}>
    {{
        score = MatMul(x, w)
        s2 = MatMul(x, w)
        prob = Softmax<axis = -1>(s2)
    }}""")
    assert kinds["score"][0] == "other" and "size 1" in kinds["score"][1]
    assert kinds["prob"][0] == "other" and "size 1" in kinds["prob"][1]


def test_heads_beside_class_scores_and_regressions_are_read_as_regressions():
    """MTCNN's O-Net: box and landmark MatMuls beside a Softmax (read by their channels
    where checked: :mod:`mixprec.core.readings`); a detector's sigmoid map: scores."""
    kinds = _kinds(f"""{HEAD}
    g (float[N, 8] x, float[1, 2, 4, 4] f) => (float[N, 4] dense_5, float[N, 2] cls,
                                               float[1, 2, 4, 4] heat)
    <float[8, 4] wb = {{{",".join(["0.1"] * 32)}}}, float[8, 2] wc = {{{",".join(["0.1"] * 16)}}}>
    {{
        dense_5 = MatMul(x, wb)
        logits = MatMul(x, wc)
        cls = Softmax<axis = -1>(logits)
        heat = Sigmoid(f)
    }}""")
    assert kinds["cls"][0] == "top1" and "class scores: Softmax" in kinds["cls"][1]
    assert kinds["dense_5"][0] == "other"
    assert "beside the class scores 'cls': a regression head" in kinds["dense_5"][1]
    assert kinds["heat"] == ("scores@1", "sigmoid scores: Sigmoid")
    alone = _kinds(f"""{HEAD}
    g (float[N, 8] x) => (float[N, 4] bbox_reg)
    <float[8, 4] w = {{{",".join(["0.1"] * 32)}}}>
    {{ bbox_reg = MatMul(x, w) }}""")
    assert alone["bbox_reg"][0] == "other" and "named like a regression" in alone["bbox_reg"][1]


def test_embeddings_are_read_as_embeddings():
    kinds = _kinds(
        f"""{HEAD}
    g (float[N, S, 6] h, float[N, 6] v) => (float[N, 6] mean_pooled, float[N, 6] unit,
        float[N, 6] normed, float[N, 6] sentence_embedding, float[N, S, 6] last_hidden_state,
        int64[N] ids)
    <int64[1] axes = {{1}}, int64[1] last = {{-1}}>
    {{
        mean_pooled = ReduceMean<keepdims = 0>(h, axes)
        unit = LpNormalization<axis = -1, p = 2>(v)
        n = ReduceL2<keepdims = 1>(v, last)
        normed = Div(v, n)
        sentence_embedding = Relu(v)
        last_hidden_state = Relu(h)
        ids = ArgMax<axis = -1, keepdims = 0>(v)
    }}""".replace('["" : 17]', '["" : 18]')
    )
    assert kinds["mean_pooled"][0] == "embedding" and "sequence axis" in kinds["mean_pooled"][1]
    assert kinds["unit"][0] == "embedding" and "LpNormalization" in kinds["unit"][1]
    assert kinds["normed"][0] == "embedding" and "divided by its norm" in kinds["normed"][1]
    assert kinds["sentence_embedding"][0] == "embedding"
    # one vector per token: not pooled (read by its values where checked)
    assert kinds["last_hidden_state"][0] == "other"
    assert kinds["ids"][0] == "match"


def test_row_cosines_and_compare_outputs_read_the_kinds():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((4, 16))
    b = a.copy()
    b[2] = -a[2]
    b[3] = 0.0
    cos = row_cosines(a, b)
    assert np.allclose(cos, [1.0, 1.0, -1.0, 0.0]), cos
    assert row_cosines(np.zeros((1, 3)), np.zeros((1, 3)))[0] == 1.0
    assert row_cosines(a[:1], np.full((1, 16), np.nan))[0] == -1.0
    # validate reports top-1 on class scores only, on their class axis (a segmentation
    # Softmax over the channels), checked against the arg-max in numpy
    model = make_model(f"""{HEAD}
    g (float[1, 5, 4, 4] x, float[1, 8] v) => (float[1, 5, 4, 4] seg, float[1, 8] emb_out)
    {{
        seg = Softmax<axis = 1>(x)
        emb_out = LpNormalization<axis = -1, p = 2>(v)
    }}""")
    kinds = classify_outputs(ir.from_proto(model))
    feeds = {"x": rng.standard_normal((1, 5, 4, 4)).astype(np.float32)}
    feeds["v"] = rng.standard_normal((1, 8)).astype(np.float32)
    ref = run_ort(model, feeds)
    out = {k: v + 0.3 * rng.standard_normal(v.shape).astype(np.float32) for k, v in ref.items()}
    by_name = {c.name: c for c in compare_outputs(ref, out, rtol=1.0, kinds=kinds)}
    want = float(np.mean(ref["seg"].argmax(1) == out["seg"].argmax(1)))
    assert by_name["seg"].top1_agreement == want
    assert by_name["emb_out"].top1_agreement is None  # an embedding has no classes
    # without the graph: the shape rule (rank 2-3, 2..100000 on the last axis)
    shaped = {c.name: c for c in compare_outputs(ref, out, rtol=1.0)}
    assert shaped["seg"].top1_agreement is None and shaped["emb_out"].top1_agreement is not None
    assert shape_class_axis((1, 8)) == -1 and shape_class_axis((1, 1)) is None
