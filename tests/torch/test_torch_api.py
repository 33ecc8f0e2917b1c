"""mixprec.torch's boundary: errors, the exporter fallback, budgets, structures, loading."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from collections import namedtuple
from pathlib import Path
from typing import Any

import onnx.parser
import onnx_ir as ir
import pytest

torch = pytest.importorskip("torch")

import mixprec  # noqa: E402
import mixprec.torch as mt  # noqa: E402
from helpers import assert_close  # noqa: E402
from mixprec.core.metrics import rel_l2_error  # noqa: E402
from mixprec.torch._export import _specialized, failing_op  # noqa: E402
from mixprec.torch._tree import flatten_outputs, leaf_paths, unflatten_outputs  # noqa: E402
from torch_models import MLP  # noqa: E402

#: slow: PyTorch exports, a script in a subprocess
pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]


@torch.library.custom_op("mixprec_test::opaque", mutates_args=())
def _opaque(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_opaque.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class Opaque(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _opaque(x) + 1


class DataDependent(torch.nn.Module):
    """A branch on a tensor's value: torch.export refuses it, TorchScript traces one side."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if x.abs().sum() > 0:
            return torch.relu(y)
        return y


class TakesScale(torch.nn.Module):
    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return x * scale


def _x(*shape: int, seed: int = 0) -> Any:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_non_tensor_input_is_refused_by_name() -> None:
    with pytest.raises(mixprec.MixprecError, match=r"input 'scale' is a float, not a torch"):
        mt.convert_module(TakesScale(), (_x(2, 3), 2.0))


def test_example_inputs_of_the_wrong_kind() -> None:
    with pytest.raises(mixprec.MixprecError, match="example_inputs must be a tensor"):
        mt.convert_module(MLP(), 3.0)


def test_export_failure_names_the_op() -> None:
    with pytest.raises(mixprec.MixprecError) as info:
        mt.convert_module(Opaque(), (_x(2, 3),))
    assert info.value.stage == "export"
    message = str(info.value)
    assert "mixprec_test" in message and "opaque" in message, message
    assert "TorchScript" in message, message


def test_failing_op_reads_both_exporters_messages() -> None:
    dynamo = "No ONNX function found for <OpOverload(op='mylib.foo', overload='default')>"
    assert failing_op(dynamo) == "mylib.foo"
    assert failing_op("failed on an operator with unrecognized namespace my::op. If") == "my::op"
    assert failing_op("Exporting the operator 'aten::unfold_copy' to ONNX") == "aten::unfold_copy"
    assert failing_op("nothing to see") is None


def test_dims_the_export_fixed_are_named() -> None:
    proto = onnx.parser.parse_model(
        """<ir_version: 10, opset_import: ["" : 20]>
        g (float[B, 6] x) => (float[B, 6] y) { y = Relu(x) }"""
    )
    notes = _specialized(ir.from_proto(proto), {"x": {0: "batch", 1: "steps"}})
    assert len(notes) == 1 and "'x' dim 1" in notes[0] and "fixed it to 6" in notes[0], notes


def test_dynamo_failure_falls_back_to_torchscript() -> None:
    module = DataDependent().eval()
    converted = mt.convert_module(module, (_x(4, 8).abs() + 0.1,))
    assert converted.spec.exporter == mt.TORCHSCRIPT
    notes = converted.report.notes
    assert notes[0] == f"exported by {mt.TORCHSCRIPT}", notes
    assert "dynamo=True) failed" in notes[1], notes
    x = _x(6, 8, seed=3).abs() + 0.1  # another batch size: dynamic_axes from the spec
    with torch.no_grad():
        ref = module(x)
    assert_close(ref.numpy(), converted(x).numpy(), "fp16")


def test_budget_refuses_with_the_report() -> None:
    module = MLP().eval()
    with pytest.raises(mt.TorchCheckError) as info:
        mt.convert_module(module, (_x(4, 32),), budget=1e-9)
    error = info.value
    assert isinstance(error, mixprec.MixprecError) and error.stage == "check"
    assert not error.check.passed and error.check.threshold == 1e-9
    assert error.report.validation is not None and error.report.validation["passed"] is False
    assert "rel L2" in str(error) and "FAIL" in str(error), str(error)
    labels = [s.label for s in error.check.samples]
    assert labels == ["example 0", "example 0 perturbed"], labels


@pytest.mark.parametrize("budget", [0, -1.0, float("nan"), "0.1"])
def test_bad_budget(budget: Any) -> None:
    with pytest.raises(mixprec.MixprecError, match="budget"):
        mt.convert_module(MLP(), (_x(2, 32),), budget=budget)


def test_training_module_warns_and_keeps_its_mode() -> None:
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5)).train()
    with pytest.warns(UserWarning, match="training mode"):
        converted = mt.convert_module(module, (_x(3, 8),))
    assert module.training, "convert_module left the module in eval mode"
    assert converted.check is not None and converted.check.passed


def test_call_errors() -> None:
    converted = mt.convert_module(MLP().eval(), (_x(2, 32),), check=False)
    assert converted.check is None
    with pytest.raises(mixprec.MixprecError, match="positional"):
        converted(_x(2, 32), _x(2, 32))
    with pytest.raises(mixprec.MixprecError, match="unknown input 'y'"):
        converted(y=_x(2, 32))
    with pytest.raises(mixprec.MixprecError, match="missing input"):
        converted()
    with pytest.raises(mixprec.MixprecError, match="float64"):
        converted(_x(2, 32).double())
    with pytest.raises(mixprec.MixprecError, match="exported model takes"):
        converted(_x(2, 31))
    assert converted(x=_x(2, 32)).shape == (2, 10)
    with pytest.raises(mixprec.MixprecError, match="threads"):
        converted.new_session(threads=-1)
    single = converted.new_session(threads=1)(_x(2, 32, seed=5))
    assert single.shape == (2, 10)


@dataclasses.dataclass
class Output:
    logits: Any
    hidden: Any = None


Pair = namedtuple("Pair", ["first", "second"])


def test_tree_round_trip() -> None:
    a, b, c = torch.zeros(1), torch.ones(2), torch.full((3,), 2.0)
    value = {"out": Output(a, None), "pair": Pair(b, [c, 7]), "t": (a,)}
    leaves, tree = flatten_outputs(value)
    assert len(leaves) == 4
    json.dumps(tree)  # JSON-ready
    again = unflatten_outputs(tree, leaves)
    assert isinstance(again["out"], Output) and again["out"].hidden is None
    assert isinstance(again["pair"], Pair) and again["pair"].second[1] == 7
    assert leaf_paths(tree) == [
        "output['out'].logits",
        "output['pair'].first",
        "output['pair'].second[0]",
        "output['t'][0]",
    ]
    tree["items"][0]["class"] = "no_such_module:Output"
    assert unflatten_outputs(tree, leaves)["out"] == {"logits": a, "hidden": None}


def test_unsupported_output_is_refused() -> None:
    with pytest.raises(mixprec.MixprecError, match=r"output\[0\] is a object"):
        flatten_outputs((object(),))


class Wrapped(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> Output:
        return Output(self.mlp(x), x.mean(dim=-1))


def test_saved_module_loads_without_its_class(tmp_path: Path) -> None:
    module = Wrapped().eval()
    converted = mt.convert_module(module, (_x(4, 32),))
    x = _x(5, 32, seed=4)
    expected = converted(x)
    assert isinstance(expected, Output)
    converted.save(str(tmp_path / "m"))
    assert sorted(os.listdir(tmp_path / "m")) == ["mixprec_torch.json", "model.onnx", "report.json"]
    torch.save({"x": x, "logits": expected.logits, "hidden": expected.hidden}, tmp_path / "io.pt")
    script = textwrap.dedent(
        f"""
        import torch, mixprec.torch as mt
        data = torch.load({str(tmp_path / "io.pt")!r})
        m = mt.load({str(tmp_path / "m")!r})
        out = m(data["x"])
        assert isinstance(out, dict), type(out)  # the test's dataclass is not importable
        assert torch.equal(out["logits"], data["logits"]), (out["logits"], data["logits"])
        assert torch.equal(out["hidden"], data["hidden"])
        print(repr(m))
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "dtype=float16" in run.stdout, run.stdout


def test_load_refuses_a_folder_without_the_files(tmp_path: Path) -> None:
    with pytest.raises(mixprec.MixprecError, match=r"missing mixprec_torch\.json"):
        mt.load(tmp_path)
    with pytest.raises(mixprec.MixprecError, match="not a folder"):
        mt.load(tmp_path / "nothing")


def test_mixprec_imports_without_torch() -> None:
    script = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None  # import torch now raises ImportError
        import mixprec
        assert hasattr(mixprec, "convert")
        try:
            import mixprec.torch
        except ImportError as exc:
            assert "mixprec[torch]" in str(exc), exc
        else:
            raise SystemExit("mixprec.torch imported without torch")
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]


def test_example_script_runs(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(REPO_ROOT / "examples" / "torch_module.py"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "max abs error" in run.stdout, run.stdout
    assert (tmp_path / "out" / "model.onnx").is_file()
    assert not list(tmp_path.glob("*.onnx")), "the example left ONNX files in its cwd"


def test_a_budget_the_plain_conversion_misses_is_met_by_tuning() -> None:
    """fp16 MLP: the plain conversion's error (~3e-4 rel L2) misses a 1e-4 budget; tune
    moves the most sensitive nodes to float, and the tuned module passes the eager check."""
    module = MLP().eval()
    x = _x(4, 32)
    converted = mt.convert_module(module, (x,), budget=1e-4)
    assert converted.check is not None and converted.check.passed, converted.check
    assert converted.check.threshold == 1e-4
    notes = converted.report.notes
    assert any(n.startswith("tuned to the budget: ") for n in notes), notes
    with torch.no_grad():
        ref = module(x).numpy()
    got = converted(x).numpy()
    rel = rel_l2_error(ref, got)
    assert rel <= 1e-4, rel


def test_the_eager_check_reads_each_output_as_rows() -> None:
    """Issue 43: the check against eager PyTorch reads outputs as rows too. A small
    channel 20% off beside a large one passes the whole tensor's rel L2 (2e-4) and fails
    its own channel; class scores whose argmax moves fail by rows."""
    from mixprec.core.output_kinds import OutputKind
    from mixprec.torch._check import check_module

    scale = torch.tensor([1000.0, 1.0])

    def eager(sample):
        (x,) = sample[0]
        return [x * scale, x @ torch.eye(2)]

    def converted(sample):
        (x,) = sample[0]
        return [x * torch.tensor([1000.0, 1.2]), x @ torch.eye(2)]

    samples = [((torch.rand(8, 2) + 1.0,), {})]
    check = check_module(
        eager, converted, samples, ["box", "same"], dtype="float16", threshold=1e-2,
        runtime="onnxruntime",
    )  # fmt: skip
    assert all(s.passed for s in check.samples)  # the whole tensors: within rel L2 1e-2
    by_output = {(c.output, c.kind): c for c in check.checks}
    box = by_output[("box", "channels")]
    assert box.value == pytest.approx(0.2, rel=1e-3) and not box.passed
    assert by_output[("same", "channels")].passed and not check.passed
    assert "box: worst channel's rel L2 0.2 over 16 rows (needs <= 0.01) FAIL" in (
        check.format_table()
    )
    kinds = [(c["output"], c["kind"], c["passed"]) for c in check.to_dict()["checks"]]
    assert kinds == [
        ("box", "rel-l2", True),  # each output's rel L2 over the 2 inputs, in the one schema
        ("same", "rel-l2", True),
        ("box", "channels", False),
        ("same", "channels", True),
    ]

    def flipped(sample):
        (x,) = sample[0]
        return [x * scale, torch.flip(x @ torch.eye(2), [1])]

    scores = check_module(
        eager, flipped, samples, ["box", "scores"], dtype="float16", threshold=10.0,
        runtime="onnxruntime", kinds=[OutputKind("other"), OutputKind("top1", -1, "class scores")],
    )  # fmt: skip
    top1 = next(c for c in scores.checks if c.kind == "top1")
    assert top1.rows == 16 and top1.value < 0.99 and not scores.passed
