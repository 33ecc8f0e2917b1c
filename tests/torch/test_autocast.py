"""``mixprec.torch.autocast``: what ran, per op, recorded below autograd with a
``TorchDispatchMode`` (the dtype of every aten call's output), against the lists; the
exclusions, list changes, loss scaling, the report's counts, the backward, and the
limits (checkpointing, torch.compile)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import mixprec.torch as mt  # noqa: E402
from helpers import assert_close  # noqa: E402
from mixprec.core.errors import MixprecError  # noqa: E402


class Recorder(TorchDispatchMode):
    """Every aten call below autograd: (op name, dtype of its first tensor output)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = out[0] if isinstance(out, tuple | list) and out else out
        if isinstance(first, torch.Tensor):
            self.calls.append((func.overloadpacket.__name__, str(first.dtype)))
        return out

    def dtypes(self, *names: str) -> list[str]:
        return [d for n, d in self.calls if n in names]


class Net(nn.Module):
    """Conv -> BatchNorm -> ReLU -> Linear -> LayerNorm -> head (Linear)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.body = nn.Linear(4 * 6 * 6, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = F.relu(self.bn(self.conv(x))).flatten(1)
        return self.head(self.norm(self.body(h)))


def _data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)


def _run(amp, net, x, y):
    rec = Recorder()
    with amp, rec:
        loss = F.cross_entropy(net(x), y)
    return loss, rec


def test_allow_ops_run_low_and_deny_ops_stay_float32():
    torch.manual_seed(0)
    net, (x, y) = Net(), _data()
    loss, rec = _run(mt.autocast("bf16", module=net), net, x, y)
    assert rec.dtypes("convolution") == ["torch.bfloat16"]
    assert rec.dtypes("addmm") == ["torch.bfloat16", "torch.bfloat16"]  # body, head
    assert set(rec.dtypes("native_batch_norm", "_native_batch_norm_legit")) == {"torch.float32"}
    assert rec.dtypes("native_layer_norm") == ["torch.float32"]
    assert set(rec.dtypes("_log_softmax", "nll_loss_forward")) == {"torch.float32"}
    assert loss.dtype == torch.float32
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in net.parameters())


def test_an_excluded_submodule_stays_float32_and_is_reported():
    torch.manual_seed(0)
    net, (x, y) = Net(), _data()
    amp = mt.autocast("bf16", module=net, exclude=[r"^head$"])
    _, rec = _run(amp, net, x, y)
    assert rec.dtypes("addmm") == ["torch.bfloat16", "torch.float32"]  # body low, head not
    assert amp.report.excluded == ["head"]
    head = [k for k in amp.report.calls if k.module == "head"]
    assert [(k.op, k.dtype, k.rule) for k in head] == [("Gemm", "float32", "exclude")]


def test_deny_add_and_allow_remove_take_effect():
    torch.manual_seed(0)
    net, (x, y) = Net(), _data()
    amp = mt.autocast("bf16", module=net, deny_add=["Gemm"], allow_remove=["Conv"])
    _, rec = _run(amp, net, x, y)
    assert rec.dtypes("convolution") == ["torch.float32"]
    assert rec.dtypes("addmm") == ["torch.float32", "torch.float32"]
    lists = {(k.op, k.list) for k in amp.report.calls}
    assert ("Gemm", "deny") in lists and ("Conv", "none") in lists


def test_the_report_counts_match_the_recorded_calls(tmp_path: Path):
    torch.manual_seed(0)
    net, (x, y) = Net(), _data()
    amp = mt.autocast("bf16", module=net, log_dir=str(tmp_path))
    for _ in range(3):
        _, rec = _run(amp, net, x, y)
    by_op = amp.report.by_op()
    assert sum(by_op[("Gemm", "allow", "allow")].values()) == 3 * 2
    assert by_op[("Conv", "allow", "allow")] == Counter({"bfloat16": 3})
    # one run recorded below autograd: as many convolutions and addmms as the report's
    assert len(rec.dtypes("convolution")) == 1 and len(rec.dtypes("addmm")) == 2
    assert (tmp_path / "amp_report.json").is_file()
    table = (tmp_path / "amp_report.txt").read_text()
    assert "Gemm" in table and "head" in table


def test_matches_float32_eager_within_the_bf16_tolerance():
    torch.manual_seed(0)
    net, (x, _) = Net(), _data()
    ref = net(x)
    with mt.autocast("bf16", module=net):
        low = net(x)
    assert_close(ref.detach().numpy(), low.float().detach().numpy(), "bf16", name="logits")


def test_fp16_with_grad_scaler_skips_a_step_on_inf_and_backs_off():
    torch.manual_seed(0)
    net, (x, y) = Net(), _data()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    before = [p.detach().clone() for p in net.parameters()]
    with mt.autocast("fp16", module=net):
        loss = F.cross_entropy(net(x * 1e4), y) * 1e4  # its fp16 gradients overflow
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**15  # backed off
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))
    opt.zero_grad()
    with mt.autocast("fp16", module=net):
        loss = F.cross_entropy(net(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)  # a finite step is taken
    scaler.update()
    assert not all(torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))


def test_unknown_names_and_exclude_without_module_are_errors():
    with pytest.raises(MixprecError, match=r"'Linear' names no op .*known: .*Gemm"):
        mt.autocast("bf16", allow_add=["Linear"])
    with pytest.raises(MixprecError, match="needs module="):
        mt.autocast("bf16", exclude=["head"])
    with pytest.raises(MixprecError, match="autocast dtype"):
        mt.autocast("int8")


def test_a_decorator_and_the_convert_hand_over():
    torch.manual_seed(0)
    net, (x, _) = Net(), _data()
    amp = mt.autocast("bf16", deny_add=["Gemm"])

    @amp
    def forward(inp):
        return net(inp)

    assert forward(x).dtype == torch.float32  # the head is DENY
    assert amp.convert_options() == {"deny_add": ["Gemm"], "dtype": "bf16"}


def test_gradient_checkpointing_runs_the_recompute_under_the_same_lists():
    torch.manual_seed(0)
    net, (x, y) = Net(), _data()
    from torch.utils.checkpoint import checkpoint

    amp = mt.autocast("bf16", module=net)
    with amp:
        out = checkpoint(net, x, use_reentrant=False, context_fn=amp.checkpoint_contexts)
        loss = F.cross_entropy(out, y)
    loss.backward()
    assert all(p.grad is not None for p in net.parameters())


def test_torch_compile_runs_under_the_lists_and_counts_every_call():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    compiled = torch.compile(net)
    amp = mt.autocast("bf16", module=net)
    for _ in range(2):
        with amp:
            out = compiled(x)
    assert out.dtype == torch.bfloat16  # the last Linear is ALLOW, as in eager
    assert amp.report.by_op()[("Gemm", "allow", "allow")] == Counter({"bfloat16": 4})
    assert_close(net(x).detach().numpy(), out.float().detach().numpy(), "bf16", name="out")


def test_the_trained_model_converts_under_the_same_lists_and_exclusions():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    x = torch.randn(4, 8)
    amp = mt.autocast("bf16", module=net, exclude=[r"^2$"], deny_add=["Relu"])
    with amp:
        trained = net(x)
    fast = mt.convert_module(net, (x,), **amp.convert_options())
    rows = {(r.op_type, r.precision) for r in fast.report.nodes}
    assert ("Gemm", "low") in rows and ("Gemm", "fp32") in rows  # 0 low, 2 excluded
    assert ("Relu", "fp32") in rows  # the DENY change went along
    head = [r for r in fast.report.nodes if r.op_type == "Gemm" and r.precision == "fp32"]
    assert len(head) == 1 and "exclude" in head[0].reason, head
    assert_close(trained.float().detach().numpy(), fast(x).numpy(), "bf16", name="logits")


def test_nested_entries_of_one_autocast_keep_the_exclusions():
    torch.manual_seed(0)
    net, (x, _) = Net(), _data()
    amp = mt.autocast("bf16", module=net, exclude=[r"^head$"])

    @amp
    def body(inp):
        return net.body(F.relu(net.bn(net.conv(inp))).flatten(1))

    rec = Recorder()
    with amp, rec:
        out = net.head(net.norm(body(x)))  # a decorated call inside the outer with
    assert rec.dtypes("addmm") == ["torch.bfloat16", "torch.float32"]  # head still excluded
    assert out.dtype == torch.float32


def test_nested_entries_of_one_autocast_count_each_call_once():
    torch.manual_seed(0)
    net, (x, y) = Net(), _data()
    once = mt.autocast("bf16", module=net)
    _run(once, net, x, y)
    amp = mt.autocast("bf16", module=net)

    @amp
    def forward(inp):
        return net(inp)

    rec = Recorder()
    with amp, rec, amp:  # three entries deep around the model's calls
        F.cross_entropy(forward(x), y)
    assert len(rec.dtypes("addmm")) == 2  # the calls ran once each
    assert amp.report.by_op()[("Gemm", "allow", "allow")] == Counter({"bfloat16": 2})
    assert amp.report.counts == once.report.counts  # as one entry counts them


def test_the_inner_autocast_object_decides_as_in_torch_autocast():
    torch.manual_seed(0)
    lin, x = nn.Linear(8, 4), torch.randn(2, 8)
    outer, inner = mt.autocast("bf16"), mt.autocast("bf16", deny_add=["Gemm"])
    with outer:
        with inner:
            assert lin(x).dtype == torch.float32  # the inner DENY wins over the outer ALLOW
        assert lin(x).dtype == torch.bfloat16
    assert inner.report.by_op() == {("Gemm", "deny", "deny"): Counter({"float32": 1})}
    assert outer.report.by_op() == {("Gemm", "allow", "allow"): Counter({"bfloat16": 1})}
    with mt.autocast("bf16", deny_add=["Gemm"]), mt.autocast("fp16"):
        assert lin(x).dtype == torch.float16  # the inner ALLOW wins over the outer DENY
    with torch.autocast("cpu", torch.bfloat16), torch.autocast("cpu", enabled=False):
        assert lin(x).dtype == torch.float32  # torch.autocast: the inner one decides too


def test_multi_head_attention_with_weights_keeps_its_softmax_float32():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 5, 16)
    ref, ref_weights = mha(x, x, x)  # need_weights=True: nn.MultiheadAttention's default
    amp, rec = mt.autocast("bf16", module=mha), Recorder()
    with amp, rec:
        out, weights = mha(x, x, x)
    assert rec.dtypes("_softmax") == ["torch.float32"]  # the weights: softmax in float32
    assert weights.dtype == torch.float32
    assert set(rec.dtypes("addmm", "baddbmm", "bmm")) == {"torch.bfloat16"}  # matmuls low
    assert out.dtype == torch.bfloat16
    assert_close(ref_weights.detach().numpy(), weights.detach().numpy(), "bf16", name="weights")
    assert_close(ref.detach().numpy(), out.float().detach().numpy(), "bf16", name="out")
    ops = {(k.op, k.rule) for k in amp.report.calls}
    assert ("Attention", "need_weights: op by op") in ops and ("Softmax", "deny") in ops
    with amp:  # without the weights: one fused call, allowed low
        out, weights = mha(x, x, x, need_weights=False)
    assert weights is None and out.dtype == torch.bfloat16
    assert amp.report.by_op()[("Attention", "allow", "allow")] == Counter({"bfloat16": 1})
