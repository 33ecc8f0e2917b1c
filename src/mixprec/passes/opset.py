"""The bfloat16 opset upgrade: many ops admit bfloat16 only from opset 22."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import onnx
import onnx.defs
import onnx_ir as ir
from onnx import version_converter

from mixprec.core.errors import MixprecError
from mixprec.core.graphs import iter_nodes, opset_of
from mixprec.core.ops import is_onnx_domain
from mixprec.core.policy import OpClass, Policy
from mixprec.io.protos import weightless_proto

__all__ = [
    "BF16_OPSET",
    "ConvertOpsetPass",
    "UpgradeOpsetPass",
    "UpgradeOpsetResult",
    "ops_needing_upgrade",
    "upgrade_to",
]

#: The first ai.onnx opset whose Conv, ConvTranspose, pooling and most activations admit
#: bfloat16.
BF16_OPSET = 22


def _admits_bf16(schema: onnx.defs.OpSchema) -> bool:
    return any("tensor(bfloat16)" in c.allowed_type_strs for c in schema.type_constraints)


def ops_needing_upgrade(model: ir.Model, policy: Policy) -> list[str]:
    """Op types in the model that would admit the target dtype only at :data:`BF16_OPSET`."""
    opset = opset_of(model, "")
    if policy.target != "bfloat16" or opset >= BF16_OPSET:
        return []
    wanted = set().union(*(policy.lists[c] for c in (OpClass.ALLOW, OpClass.INFER, OpClass.CLEAR)))
    needed = set()
    for node in iter_nodes(model.graph):
        if not is_onnx_domain(node.domain) or node.op_type not in wanted:
            continue
        try:
            old = onnx.defs.get_schema(node.op_type, opset)
            new = onnx.defs.get_schema(node.op_type, BF16_OPSET)
        except onnx.defs.SchemaError:
            continue
        if not _admits_bf16(old) and _admits_bf16(new):
            needed.add(node.op_type)
    return sorted(needed)


@dataclasses.dataclass
class UpgradeOpsetResult(ir.passes.PassResult):
    """``note`` says what was done (or why not); ``ops`` are the op types that needed it."""

    note: str = ""
    ops: list[str] = dataclasses.field(default_factory=list)


class UpgradeOpsetPass(ir.passes.FunctionalPass):
    """Raise the ai.onnx opset to :data:`BF16_OPSET` when the policy's bfloat16 ops need it.

    Functional: returns a new model built by ``onnx.version_converter`` (the input is left
    as it was); ``modified`` says whether the opset changed. When the converter fails, or
    no op needs it, the new model is a copy of the input (with a note when it failed).
    Run it after calibration: the FP32 reference runs on the model as the user gave it,
    because ONNX Runtime may lack kernels at the new opset.
    """

    def __init__(
        self,
        policy: Policy,
        missing: Callable[[ir.Model, Sequence[str], int], list[str]] | None = None,
    ) -> None:
        super().__init__()
        self.policy = policy
        # the runtime's kernels: (model, op types, opset) -> "Op-version" it lacks
        self.missing = missing

    def call(self, model: ir.Model) -> UpgradeOpsetResult:
        ops = ops_needing_upgrade(model, self.policy)
        opset = opset_of(model, "")
        lacking = self._lacking(model, opset) if ops else []
        if lacking:
            light, _ = weightless_proto(model, with_arrays=False)
            note = (
                f"opset kept at {opset}: raising it to {BF16_OPSET} would move "
                f"{', '.join(lacking)} to a version onnxruntime does not implement; bfloat16 "
                f"{', '.join(ops[:8])}{' ...' if len(ops) > 8 else ''} stay FP32 (they "
                f"admit bfloat16 only from opset {BF16_OPSET})"
            )
            return UpgradeOpsetResult(
                _restore_weights(light, model), modified=False, note=note, ops=ops
            )
        # Large weights travel as placeholders and are put back by name afterwards: no
        # serialization of the weights, and external data keeps its own folder.
        light, _ = weightless_proto(model, with_arrays=False)
        if not ops:
            return UpgradeOpsetResult(_restore_weights(light, model), modified=False)
        try:
            proto = version_converter.convert_version(light, BF16_OPSET)
        except Exception as exc:
            note = (
                f"could not raise opset {opset} -> {BF16_OPSET} for bfloat16 "
                f"({str(exc).splitlines()[0][:100]}): {', '.join(ops)} stay FP32"
            )
            return UpgradeOpsetResult(
                _restore_weights(light, model), modified=False, note=note, ops=ops
            )
        note = (
            f"opset raised {opset} -> {BF16_OPSET}: bfloat16 {', '.join(ops[:8])}"
            f"{' ...' if len(ops) > 8 else ''} need it (upgrade_opset=False to keep {opset}); "
            "calibration ran before the upgrade"
        )
        return UpgradeOpsetResult(_restore_weights(proto, model), modified=True, note=note, ops=ops)

    def _lacking(self, model: ir.Model, opset: int) -> list[str]:
        """Ops whose version the upgrade changes and the runtime has no kernel for."""
        if self.missing is None:
            return []
        moved = []
        for op in {n.op_type for n in iter_nodes(model.graph) if is_onnx_domain(n.domain)}:
            try:
                old = onnx.defs.get_schema(op, opset).since_version
                new = onnx.defs.get_schema(op, BF16_OPSET).since_version
            except onnx.defs.SchemaError:
                continue
            if new != old:
                moved.append(op)
        return self.missing(model, sorted(moved), BF16_OPSET) if moved else []


class ConvertOpsetPass(ir.passes.FunctionalPass):
    """Raise the ai.onnx opset to ``opset`` (``onnx.version_converter``), keeping the
    original weight tensors and the model's meta; ``modified`` when the opset changed.

    Raises:
        MixprecError: the converter cannot raise this model's opset.
    """

    def __init__(self, opset: int) -> None:
        super().__init__()
        self.opset = opset

    def call(self, model: ir.Model) -> UpgradeOpsetResult:
        old = opset_of(model, "")
        light, _ = weightless_proto(model, with_arrays=False)
        if old >= self.opset:
            return UpgradeOpsetResult(_restore_weights(light, model), modified=False)
        try:
            proto = version_converter.convert_version(light, self.opset)
        except Exception as exc:
            raise MixprecError(
                f"cannot raise opset {old} -> {self.opset}: {str(exc).splitlines()[0][:120]}"
            ) from None
        note = f"opset raised {old} -> {self.opset}"
        return UpgradeOpsetResult(_restore_weights(proto, model), modified=True, note=note)


def upgrade_to(opset: int) -> ConvertOpsetPass:
    """The pass that raises the ai.onnx opset to ``opset``."""
    return ConvertOpsetPass(opset)


def _restore_weights(proto: onnx.ModelProto, original: ir.Model) -> ir.Model:
    """``proto`` as a new model whose initializers hold ``original``'s tensors again and
    whose meta carries ``original``'s analyses (they are keyed by value name)."""
    model = ir.from_proto(proto)
    model.meta.update(original.meta)
    for name, value in model.graph.initializers.items():
        old = original.graph.initializers.get(name)
        if old is not None and old.const_value is not None:
            value.const_value = old.const_value
    return model
