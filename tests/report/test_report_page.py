"""The report page (``mixprec report``, ``--report``) and its exports, without a browser."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mixprec.api.convert import annotate
from mixprec.cli.writing import model_explorer_data
from mixprec.report.graph_layout import layout_graph
from mixprec.report.html import render_page

ROOT = Path(__file__).resolve().parents[2]


class _Page(HTMLParser):
    """Collects the drawn nodes (``<g class="n p-...">``), their tooltips, the graphs."""

    def __init__(self) -> None:
        super().__init__()
        self.nodes: dict[str, dict[str, str]] = {}
        self.graphs: list[str] = []
        self._current: str | None = None
        self._in_title = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        classes = (a.get("class") or "").split()
        if tag == "svg" and "graph" in classes:
            self.graphs.append(a.get("data-graph") or "")
        if tag == "g" and "n" in classes:
            self._current = a["id"] or ""
            kinds = [c for c in classes if c.startswith("p-")]
            self.nodes[self._current] = {"class": " ".join(kinds), "title": ""}
        if tag == "title" and self._current is not None:
            self._in_title = True

    def handle_endtag(self, tag: str) -> None:
        if tag == "title":
            self._in_title = False
        if tag == "g":
            self._current = None

    def handle_data(self, data: str) -> None:
        if self._in_title and self._current is not None:
            self.nodes[self._current]["title"] += data


def _parse(page: str) -> _Page:
    parser = _Page()
    parser.feed(page)
    return parser


def tiny_model() -> onnx.ModelProto:
    """MatMul, Relu, Exp, ReduceSum and a Shape (integer only)."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "w")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("Exp", ["r"], ["e"], name="exp"),
        helper.make_node("ReduceSum", ["e"], ["y"], name="sum", keepdims=1),
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1]),
            helper.make_tensor_value_info("s", TensorProto.INT64, [2]),
        ],
        [w],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def if_model() -> onnx.ModelProto:
    """An If whose branches each hold a Mul: two bodies to draw."""

    def branch(name: str, k: float) -> onnx.GraphProto:
        c = numpy_helper.from_array(np.array(k, np.float32), f"{name}_k")
        return helper.make_graph(
            [helper.make_node("Mul", ["x", f"{name}_k"], [f"{name}_y"], name=f"{name}_mul")],
            name,
            [],
            [helper.make_tensor_value_info(f"{name}_y", TensorProto.FLOAT, [2, 3])],
            [c],
        )

    graph = helper.make_graph(
        [
            helper.make_node(
                "If",
                ["c"],
                ["y"],
                name="if",
                then_branch=branch("t", 2.0),
                else_branch=branch("e", 3.0),
            ),
        ],
        "with_if",
        [
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


_EXPECTED = {"low": {"p-fp16", "p-bf16"}, "fp32": {"p-fp32", "p-int"}, "int8": {"p-int8"}}


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_page_has_one_node_element_per_node_with_colour_and_reason(dtype: str) -> None:
    options = {"exclude_nodes": ["exp"]}  # one node surely kept FP32
    result = annotate(tiny_model(), dtype, **options)
    page = _parse(render_page(result.model, result.report))
    graph_nodes = list(result.model.graph)
    io = len(result.model.graph.inputs) + len(result.model.graph.outputs)
    assert len(page.nodes) == len(graph_nodes) + io, sorted(page.nodes)
    by_name = {r.name: r for r in result.report.nodes}
    low = "p-fp16" if dtype == "fp16" else "p-bf16"
    seen = set()
    for drawn in page.nodes.values():
        name = drawn["title"].splitlines()[0].split(" ", 1)[-1]
        row = by_name.get(name)
        if row is None:
            continue
        seen.add(name)
        assert drawn["class"] in _EXPECTED[row.precision], (name, drawn, row)
        if row.precision == "low":
            assert drawn["class"] == low, (name, drawn)
        assert row.reason in drawn["title"], (name, drawn["title"], row.reason)
    assert seen == set(by_name), seen
    assert set(by_name) >= {"mm", "relu", "exp", "sum"}, sorted(by_name)
    classes = {d["class"] for d in page.nodes.values()}
    assert {low, "p-fp32", "p-int", "p-io"} <= classes, classes
    shape = next(d for d in page.nodes.values() if d["title"].startswith("Shape shape"))
    assert shape["class"] == "p-int" and "not painted" in shape["title"], shape
    exp = next(d for d in page.nodes.values() if d["title"].startswith("Exp exp"))
    assert exp["class"] == "p-fp32" and "exclude" in exp["title"], exp


def test_page_is_self_contained() -> None:
    result = annotate(tiny_model(), "fp16")
    page = render_page(result.model, result.report)
    for marker in ("http://", "https://", "<link", "src="):
        assert marker not in page, marker
    assert "<script>" in page and 'id="mp-data"' in page
    data = page.split('id="mp-data">', 1)[1].split("</script>", 1)[0]
    graphs = json.loads(data)["graphs"]
    assert len(graphs["g0"]["nodes"]) == len(graphs["g0"]["ids"]) == 8


def test_if_bodies_are_drawn_as_their_own_graphs() -> None:
    result = annotate(if_model(), "fp16", calibrate=False)
    page_text = render_page(result.model, result.report)
    page = _parse(page_text)
    assert len(page.graphs) == 3, page.graphs
    body_nodes = [d for i, d in page.nodes.items() if not i.startswith("g0_")]
    assert sum("Mul" in d["title"] for d in body_nodes) == 2, body_nodes
    data = json.loads(page_text.split('id="mp-data">', 1)[1].split("</script>", 1)[0])
    if_detail = next(d for d in data["graphs"]["g0"]["nodes"] if d.get("op") == "If")
    assert [b[0] for b in if_detail["bodies"]] == ["g0.1", "g0.2"], if_detail


def test_layered_layout_without_graphviz_keeps_ranks() -> None:
    edges = [(0, 1), (1, 2), (0, 2), (2, 3)]
    lay = layout_graph([80.0] * 4, [30.0] * 4, edges, engine="layered")
    assert len(lay.x) == len(lay.y) == 4
    assert len(lay.paths) == len(edges)
    for a, b in edges:
        assert lay.y[a] < lay.y[b], (a, b, lay.y)
    assert all(0 <= x <= lay.width for x in lay.x), (lay.x, lay.width)


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXPREC_")}
    return subprocess.run(
        [sys.executable, "-m", "mixprec", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=300,
    )


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("report")
    path = folder / "demo.onnx"
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "make_demo_model.py"), str(path)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return path


def test_cli_convert_report_annotate_and_model_explorer(demo: Path) -> None:
    folder = demo.parent
    done = _cli(
        "convert", str(demo), "-o", "out16.onnx", "--validate", "--report", "r16.html",
        "--annotate-model", "--model-explorer", "me.json", "-q", cwd=folder,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    page = (folder / "r16.html").read_text()
    parsed = _parse(page)
    assert any(d["class"] == "p-cast" for d in parsed.nodes.values()), "no Cast drawn"
    assert 'Validation: <span class="v-passed">passed' in page
    assert "<h3>Each output read as rows</h3>" in page  # the readings beside the rel L2
    assert "the whole tensor&#x27;s relative L2" not in page  # that is the table's
    assert "<td>class scores: Softmax &#x27;softmax&#x27; (class axis -1, 10 classes)</td>" in page
    model = onnx.load(str(folder / "out16.onnx"))
    props = {n.name: {p.key: p.value for p in n.metadata_props} for n in model.graph.node}
    assert props["conv1"]["mixprec.precision"] == "FP16", props["conv1"]
    assert props["conv1"]["mixprec.reason"].startswith("["), props["conv1"]
    casts = [n for n in model.graph.node if n.op_type == "Cast"]
    assert casts and all(props[c.name]["mixprec.precision"] == "Cast" for c in casts)
    overlay = json.loads((folder / "me.json").read_text())
    ((_graph_id, graph_data),) = overlay.items()
    results = graph_data["results"]
    conv1_out = next(n.output[0] for n in model.graph.node if n.name == "conv1")
    assert results[conv1_out]["value"] == 16, results.get(conv1_out)
    assert all(set(r) == {"value", "bgColor"} for r in results.values())


def test_cli_quantize_report_shows_qdq_and_scales(demo: Path) -> None:
    folder = demo.parent
    done = _cli(
        "quantize", str(demo), "-o", "q.onnx", "--speed", "off", "--report", "q.html", cwd=folder
    )
    assert done.returncode == 0, done.stderr
    page = (folder / "q.html").read_text()
    classes = [d["class"] for d in _parse(page).nodes.values()]
    assert classes.count("p-qdq") >= 4 and "p-int8" in classes, classes
    assert "zero point" in page


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "int8"])
def test_cli_report_writes_no_model(demo: Path, dtype: str) -> None:
    folder = demo.parent
    before = set(os.listdir(folder))
    done = _cli("report", str(demo), "--dtype", dtype, "-o", f"plan_{dtype}.html", cwd=folder)
    assert done.returncode == 0, done.stderr
    assert set(os.listdir(folder)) - before == {f"plan_{dtype}.html"}
    kinds = {d["class"] for d in _parse((folder / f"plan_{dtype}.html").read_text()).nodes.values()}
    expected = {"fp16": "p-fp16", "bf16": "p-bf16", "int8": "p-int8"}[dtype]
    assert expected in kinds, kinds
    assert "wrote" in done.stdout
    if dtype == "int8":  # the plan shows the scales quantize would compute
        assert "(planned, MinMax uint8): scale" in (folder / "plan_int8.html").read_text()


def test_cli_report_bad_input_is_one_line(tmp_path: Path) -> None:
    done = _cli("report", str(tmp_path / "missing.onnx"), "-o", "x.html", cwd=tmp_path)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "x.html").exists()


def test_model_explorer_keys_are_output_names() -> None:
    result = annotate(tiny_model(), "fp16")
    data = model_explorer_data(result.model, result.report)
    results = data["tiny"]["results"]
    assert results["h"]["value"] == 16 and results["s"]["value"] == 0, results


def test_page_without_graphviz_uses_the_layered_layout() -> None:
    result = annotate(tiny_model(), "fp16")
    with_dot = _parse(render_page(result.model, result.report))
    text = render_page(result.model, result.report, engine="layered")
    assert "layered (graphviz not installed)" in text
    assert _parse(text).nodes.keys() == with_dot.nodes.keys()


def test_cli_report_path_checked_before_any_work(demo: Path) -> None:
    folder = demo.parent
    missing = folder / "no_such_folder" / "r.html"
    done = _cli("convert", str(demo), "-o", "never.onnx", "--report", str(missing), cwd=folder)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "does not exist" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (folder / "never.onnx").exists()


def test_names_cannot_break_out_of_the_page() -> None:
    model = tiny_model()
    model.graph.node[0].name = "</script><!--mm"
    result = annotate(model, "fp16")
    page = render_page(result.model, result.report)
    assert page.count("</script>") == 2, page.count("</script>")  # the data and the code
    assert "<!--" not in page
    assert "&lt;/script&gt;&lt;!--mm" in page  # the tooltip, escaped


def test_tuner_extras_and_search_curve(tmp_path: Path) -> None:
    from mixprec.report.html import write_report_html

    result = annotate(tiny_model(), "fp16")
    path = tmp_path / "tuned.html"
    curve = [(0.2, 0.001), (0.5, 0.004), (0.9, 0.02)]
    write_report_html(
        result, path, converted=False, extra={"tuner": "greedy, 3 trials"}, curve=curve
    )
    page = path.read_text()
    assert "<th>tuner</th><td>greedy, 3 trials</td>" in page
    assert page.count("<circle ") == 3
    points = page.split('<polyline points="', 1)[1].split('"', 1)[0].split()
    assert len(points) == 3, points
    xs = [float(p.split(",")[0]) for p in points]
    assert xs == sorted(xs), xs
