"""The conversion report: per-node decisions, casts, bytes, low-precision shares."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field

import onnx_ir as ir

from mixprec.calibrate.measure import MACS
from mixprec.core.jsonio import json_text
from mixprec.int8.plan import int8_decision
from mixprec.precision.paint import decision_of

__all__ = ["NodeReport", "Report", "node_row"]


#: Node precisions that count as reduced: fp16/bf16 ("low"), INT8 and weight-only int4/int8.
_LOW = frozenset({"low", "int8", "int4"})


@dataclass(frozen=True)
class NodeReport:
    name: str
    op_type: str
    precision: str  # "low" | "int8" | "int4" (weight-only) | "fp32"
    op_class: str
    step: str
    reason: str
    macs: int = 0


def node_row(node: ir.Node, *, paint: bool = True) -> NodeReport | None:
    """The report row of the decision recorded on ``node``: its fp16/bf16 painting (unless
    ``paint`` is False), else its INT8 decision; None where it carries neither."""
    name, macs = node.name or "", int(node.meta.get(MACS, 0))
    if paint and (d := decision_of(node)) is not None:
        precision, op_class = d.precision.value, d.op_class.value
        return NodeReport(name, node.op_type, precision, op_class, d.step, d.reason, macs)
    if (q := int8_decision(node)) is not None:
        precision = "int8" if q.int8 else "fp32"
        return NodeReport(name, node.op_type, precision, q.role or "none", "int8", q.reason, macs)
    return None


@dataclass
class Report:
    """What a conversion did. ``to_dict()`` is the ``--json`` output."""

    target: str
    nodes: list[NodeReport] = field(default_factory=list)
    casts_before: int = 0
    casts_after: int = 0
    casts_inserted: int = 0
    casts_removed: int = 0
    param_bytes_before: int = 0
    param_bytes_after: int = 0
    weights: dict[str, int] = field(default_factory=dict)
    batchnorm_folded: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    input_shapes: dict[str, list[int]] = field(default_factory=dict)
    calibrated: bool = False
    timings: dict[str, float] = field(default_factory=dict)
    policy: dict[str, object] = field(default_factory=dict)
    validation: dict[str, object] | None = None
    quantization: dict[str, object] | None = None
    #: The INT8 accuracy guard's checks and verdict (:mod:`mixprec.repair.int8_guard`).
    guard: dict[str, object] | None = None
    #: The result is the input model as given (nothing was worth changing).
    unchanged: bool = False

    @property
    def low_nodes(self) -> int:
        return sum(1 for n in self.nodes if n.precision in _LOW)

    @property
    def low_node_share(self) -> float:
        return self.low_nodes / len(self.nodes) if self.nodes else 0.0

    @property
    def total_macs(self) -> int:
        return sum(n.macs for n in self.nodes)

    @property
    def low_mac_share(self) -> float:
        total = self.total_macs
        return sum(n.macs for n in self.nodes if n.precision in _LOW) / total if total else 0.0

    def fp32_nodes(self) -> list[NodeReport]:
        return [n for n in self.nodes if n.precision == "fp32"]

    def to_dict(self) -> dict[str, object]:
        data = dataclasses.asdict(self)
        data["summary"] = {
            "nodes": len(self.nodes),
            "low_nodes": self.low_nodes,
            "low_node_share": round(self.low_node_share, 4),
            "macs": self.total_macs,
            "low_mac_share": round(self.low_mac_share, 4),
            "casts_inserted": self.casts_inserted,
            "casts_after": self.casts_after,
            "param_bytes_before": self.param_bytes_before,
            "param_bytes_after": self.param_bytes_after,
        }
        return data

    def to_json(self) -> str:
        return json_text(self.to_dict(), indent=2)

    def format_summary(self, *, max_fp32: int = 25) -> str:
        """A readable summary: counts, shares, casts, bytes, and nodes kept in FP32."""
        lines = [f"mixprec: {self.target} mixed precision"]
        counts = Counter(n.precision for n in self.nodes)
        rows = [
            ("float nodes painted", f"{len(self.nodes)}"),
            (
                "  low precision" if self.target != "int8" else "  INT8",
                f"{self.low_nodes} ({self.low_node_share:.1%})",
            ),
            ("  kept fp32", f"{counts['fp32']}"),
            (
                "multiply-accumulates in low precision",
                f"{self.low_mac_share:.1%} of {self.total_macs / 1e6:.1f} M"
                if self.total_macs
                else "n/a (no Conv/MatMul/Gemm with known shapes)",
            ),
            ("casts inserted", f"{self.casts_inserted}"),
            ("casts in model (before -> after)", f"{self.casts_before} -> {self.casts_after}"),
            (
                "parameter bytes",
                f"{_mb(self.param_bytes_before)} -> {_mb(self.param_bytes_after)}",
            ),
            ("BatchNormalization folded", f"{len(self.batchnorm_folded)}"),
            ("range calibration", "yes" if self.calibrated else "no (--no-calibrate)"),
        ]
        if self.quantization is not None:
            share = self.quantization.get("integer_kernel_mac_share")
            rows.append(
                (
                    "MACs in ORT integer kernels",
                    f"{share:.1%} of the Conv/MatMul/Gemm MACs"
                    if isinstance(share, float)
                    else "n/a",
                )
            )
        if self.weights.get("flushed_to_zero"):
            rows.append(("weight values flushed to zero", str(self.weights["flushed_to_zero"])))
        if self.weights.get("overflowed"):
            rows.append(("weight values overflowed to inf", str(self.weights["overflowed"])))
        if self.timings:
            rows.append(("time", f"{sum(self.timings.values()):.2f} s"))
        width = max(len(k) for k, _ in rows)
        lines += [f"  {k.ljust(width)}  {v}" for k, v in rows]
        fp32 = [n for n in self.fp32_nodes() if n.step not in ("rest",) or n.op_class != "none"]
        if fp32:
            by_reason = Counter((n.step, n.reason) for n in fp32)
            names: dict[tuple[str, str], list[str]] = {}
            for n in fp32:
                names.setdefault((n.step, n.reason), []).append(n.name or n.op_type)
            lines.append(f"kept in fp32 ({len(fp32)} nodes), by reason:")
            for (step, reason), k in by_reason.most_common(max_fp32):
                shown = names[(step, reason)]
                more = f", +{len(shown) - 3}" if len(shown) > 3 else ""
                lines.append(f"  {k:4d}  [{step}] {reason}: {', '.join(shown[:3])}{more}")
            if len(by_reason) > max_fp32:
                lines.append(f"  ... {len(by_reason) - max_fp32} more reasons (see --json)")
        for note in self.notes:
            lines.append(f"note: {note}")
        if self.validation is not None:
            lines.append(str(self.validation.get("table", "")))
        return "\n".join(lines)


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"
