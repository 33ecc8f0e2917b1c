"""The language-model repair's search (mixprec.repair.lm_repair) on a made-up run: it
ranks by the run's own recorded scores (no second pass over the data), and a step whose
layer choices change nothing, or repeat a step already measured, is not quantized and
checked again. The quantizer and the checker are stand-ins that count what they are
asked; the real repair, on a real decoder in ONNX Runtime, is in test_language_guard."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import onnx_ir as ir

from mixprec.pipeline.weight_only import GuardContext, WeightsReport
from mixprec.repair.lm_repair import Repair, recorded_ranking
from mixprec.weights.config import WeightsConfig
from mixprec.weights.mixed_bits import packed_bytes

SCORES = {"a": 9.0, "b": 5.0, "c": 1.0}  # "a" the most sensitive
K, N = 64, 32


def _quantized() -> ir.Model:
    """A graph with one MatMulNBits per layer, named as the report names them."""
    x = ir.Value(name="x")
    nodes = [
        ir.node("MatMulNBits", [x], {"K": K, "N": N}, domain="com.microsoft", name=name)
        for name in SCORES
    ]
    graph = ir.Graph([x], [n.outputs[0] for n in nodes], nodes=nodes, opset_imports={"": 21})
    return ir.Model(graph, ir_version=10)


def _report() -> WeightsReport:
    report = WeightsReport(target="int4 weights")
    report.quantization = {"mixed": {"scores": dict(SCORES), "basis": "output error on x"}}
    return report


class _Checker:
    """Passes once "c" is at 8 bits; counts the models it measured."""

    def __init__(self) -> None:
        self.measured = 0

    def measure(self, model: Any) -> dict[str, Any]:
        self.measured += 1
        return {"c": model["c"]}

    def misses(self, stats: dict[str, Any], budget: Any) -> list[str]:
        return [] if stats["c"] == "int8" else ["c at 4 bits"]


def test_recorded_ranking_reads_the_runs_scores_with_their_costs() -> None:
    config = WeightsConfig(bits=4)
    ranked, what = recorded_ranking(_quantized(), _report(), config, ["c", "a", "b"])
    assert [s.name for s in ranked] == ["a", "b", "c"]
    assert [s.score for s in ranked] == [9.0, 5.0, 1.0]
    four = packed_bytes(K, N, config.spec("int4"))
    assert ranked[0].extra8 == packed_bytes(K, N, config.spec("int8")) - four
    assert ranked[0].extra_float == 4 * K * N - four
    assert what.startswith("the run's ranking: output error")
    # a layer the run did not score: no recorded ranking (the repair ranks on data)
    assert recorded_ranking(_quantized(), _report(), config, ["a", "d"]) is None
    assert recorded_ranking(None, _report(), config, ["a"]) is None


def test_steps_that_change_nothing_are_not_quantized_again() -> None:
    """ "a" is at 8 bits already: the first 8-bit step (the top-ranked layer) would
    quantize the model as it is, and is skipped; the next steps each quantize once."""
    asked: list[dict[str, str]] = []

    def requantize(config: WeightsConfig) -> tuple[dict[str, str], WeightsReport]:
        now = {"a": "int8", "b": "int4", "c": "int4"}
        now.update({name: c.precision for name, c in config.layers.items()})
        asked.append(now)
        return now, _report()

    checker = _Checker()
    runs = SimpleNamespace(streamed=False)
    context = GuardContext(None, [], "", WeightsConfig(bits=4), requantize, runs)  # type: ignore[arg-type]
    first = (_quantized(), _report(), {}, ["c at 4 bits"])
    repair = Repair(checker, None, context, first)
    repair.run({"a": "int8", "b": "int4", "c": "int4"})
    # steps of 1, 2 and 3 ranked layers to 8 bits: 1 ("a") changes nothing
    assert asked == [
        {"a": "int8", "b": "int8", "c": "int4"},
        {"a": "int8", "b": "int8", "c": "int8"},
    ]
    assert checker.measured == 2
    assert [s["layers"] for s in repair.steps] == [2, 3]
    assert repair.chosen is not None and repair.chosen["layers"] == 3
