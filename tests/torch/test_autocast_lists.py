"""``mixprec.torch.autocast``'s float32 functions against ``torch.autocast``'s: every op
that ``torch.autocast`` runs in float32 on CPU or on CUDA is float32 under mixprec's
training defaults, checked op by op against the installed torch; and a few of them run
with low inputs."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

import mixprec.torch as mt  # noqa: E402

_F = "torch.nn.functional."

#: The AutocastCPU registrations of aten/src/ATen/autocast_mode.cpp (torch 2.13) that are
#: not float32: its ``lower_precision_fp`` and ``promote`` entries (the .cpp is not
#: installed; every other op with an AutocastCPU kernel is float32 there).
CPU_NOT_FP32 = frozenset(
    {
        # lower_precision_fp
        "conv1d",
        "conv2d",
        "conv3d",
        "bmm",
        "mm",
        "linalg_vecdot",
        "baddbmm",
        "addmm",
        "addbmm",
        "linear",
        "_convolution",
        "matmul",
        "conv_tbc",
        "mkldnn_rnn_layer",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
        "prelu",
        "scaled_dot_product_attention",
        "_native_multi_head_attention",
        "_addmm_activation",
        # promote
        "stack",
        "cat",
        "index_copy",
    }
)

#: The float32 lists of the installed torch's ATen/autocast_mode.h (CUDA's; ``norm`` is
#: its fp32_append_dtype entry).
CUDA_FP32_MACROS = (
    "AT_FORALL_FP32",
    "AT_FORALL_FP32_SET_OPT_DTYPE",
    "AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE",
)

#: How Python reaches the aten ops that are not torch.NAME, Tensor.NAME, F.NAME,
#: torch.linalg.X (linalg_X) or torch.fft.X (fft_X), or not only those.
ENTRIES = {
    "cross_entropy_loss": [f"{_F}cross_entropy"],
    "nll_loss2d": [f"{_F}nll_loss"],
    "multilabel_margin_loss_forward": [f"{_F}multilabel_margin_loss"],
    "native_layer_norm": [f"{_F}layer_norm"],
    "norm": [f"{_F}normalize", "torch.linalg.norm"],
    "frobenius_norm": ["torch.norm", "torch.Tensor.norm", "torch.linalg.norm"],
    "nuclear_norm": ["torch.norm", "torch.Tensor.norm", "torch.linalg.norm"],
    "linalg_vector_norm": ["torch.norm", "torch.linalg.norm", f"{_F}normalize"],
    "linalg_matrix_norm": ["torch.linalg.norm"],
    "pow": ["torch.Tensor.__pow__", "torch.Tensor.__rpow__"],
    "reciprocal": ["torch.Tensor.__rtruediv__"],
    "softmax": [f"{_F}softmin", "torch.special.softmax"],
    "log_softmax": ["torch.special.log_softmax"],
    "logsumexp": ["torch.special.logsumexp"],
    "cosine_similarity": [f"{_F}pairwise_distance"],
    "_lu_with_info": ["torch.lu", "torch.Tensor.lu"],
    "max_pool3d": [f"{_F}max_pool3d_with_indices"],
    "adaptive_max_pool3d": [f"{_F}adaptive_max_pool3d_with_indices"],
    "fractional_max_pool2d": [f"{_F}fractional_max_pool2d_with_indices"],
    "fractional_max_pool3d": [f"{_F}fractional_max_pool3d_with_indices"],
    **{
        f"{kind}_pad{d}d": [f"{_F}pad"] for kind in ("reflection", "replication") for d in (1, 2, 3)
    },
    **{op: [f"{_F}grid_sample"] for op in ("grid_sampler", "grid_sampler_2d", "grid_sampler_3d")},
    **{
        op: [f"{_F}interpolate", f"{_F}upsample", f"{_F}upsample_nearest", f"{_F}upsample_bilinear"]
        for op in (
            "upsample_nearest1d",
            "upsample_nearest2d",
            "upsample_nearest3d",
            "_upsample_nearest_exact1d",
            "_upsample_nearest_exact2d",
            "_upsample_nearest_exact3d",
            "upsample_linear1d",
            "upsample_bilinear2d",
            "_upsample_bilinear2d_aa",
            "upsample_trilinear3d",
            "upsample_bicubic2d",
            "_upsample_bicubic2d_aa",
        )
    },
}


def _base(op: str) -> str:
    """``aten::pow.Scalar`` -> ``pow``."""
    return op.split("::")[-1].split(".")[0]


def _with_kernel(key: str) -> set[str]:
    return {
        _base(op)
        for op in torch._C._dispatch_get_all_op_names()
        if torch._C._dispatch_has_kernel_for_dispatch_key(op, key)
    }


def _cuda_fp32() -> set[str]:
    """The ops of the installed torch's CUDA float32 lists, read from its header."""
    header = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"
    if not header.is_file():
        pytest.skip(f"{header} is not installed")
    lines = header.read_text().splitlines()
    ops: set[str] = set()
    for macro in CUDA_FP32_MACROS:
        start = lines.index(next(ln for ln in lines if ln.startswith(f"#define {macro}(_)")))
        for line in lines[start + 1 :]:
            ops.update(re.findall(r"^\s*_\((?:ADD_NS\()?(\w+)", line))
            if not line.rstrip().endswith("\\"):
                break
    return ops


def torch_autocast_fp32() -> set[str]:
    """Every aten op that torch.autocast runs in float32 on CPU or CUDA (base names)."""
    cuda = _cuda_fp32()
    assert len(cuda) > 50 and cuda <= _with_kernel("AutocastCUDA"), cuda
    cpu_kernels = _with_kernel("AutocastCPU")
    assert cpu_kernels >= CPU_NOT_FP32, CPU_NOT_FP32 - cpu_kernels  # the copy is current
    return cuda | (cpu_kernels - CPU_NOT_FP32)


def _resolve(dotted: str):
    module, _, rest = dotted.partition(".")
    obj = importlib.import_module(module)
    for part in rest.split("."):
        obj = getattr(obj, part, None)
    return obj


def _python_entries(op: str) -> list[str]:
    """The Python functions through which ``op`` is called."""
    names = [f"torch.{op}", f"torch.Tensor.{op}", f"{_F}{op}"]
    for prefix, module in (("linalg_", "torch.linalg."), ("fft_", "torch.fft.")):
        if op.startswith(prefix):
            names.append(module + op.removeprefix(prefix))
    names += ENTRIES.get(op, [])
    return [n for n in names if _resolve(n) is not None]


def test_torch_autocasts_own_lists_are_read_as_expected():
    with torch.autocast("cpu", torch.bfloat16):  # the hard-coded CPU copy, spot-checked
        low, f32 = torch.randn(3, 3, dtype=torch.bfloat16), torch.randn(3, 3)
        assert torch.mm(f32, f32).dtype == torch.bfloat16  # lower_precision_fp
        assert torch.cat([low, low]).dtype == torch.bfloat16  # promote
        assert torch.trace(low).dtype == torch.float32  # the rest: float32
    fp32 = torch_autocast_fp32()
    assert {"exp", "norm", "logsumexp", "cumprod", "cosine_similarity"} <= fp32  # CUDA
    assert {"trace", "reflection_pad2d", "fft_rfft", "nll_loss2d"} <= fp32  # CPU
    assert not fp32 & {"mm", "linear", "conv2d", "cat", "addcmul"}


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_every_op_torch_autocast_keeps_in_float32_is_float32_in_training(dtype: str):
    fp32 = {name for op, name, lst, kind in mt.autocast(dtype).entries.values() if kind == "fp32"}
    missing = {}
    for op in sorted(torch_autocast_fp32()):
        entries = _python_entries(op)
        uncovered = [n for n in entries if n not in fp32 and not _same(n, fp32)]
        if not entries or uncovered:
            missing[op] = uncovered or "no Python entry known (add one to ENTRIES)"
    assert not missing, missing


def _same(name: str, fp32_names: set[str]) -> bool:
    """``name`` is an alias of a float32 function (the table names it otherwise)."""
    func = _resolve(name)
    return any(_resolve(n) is func for n in fp32_names)


@pytest.mark.parametrize(
    "call",
    [
        lambda t: torch.norm(t),
        lambda t: t.norm(dim=1),
        lambda t: torch.linalg.vector_norm(t),
        lambda t: torch.cumprod(t, 1),
        lambda t: F.cosine_similarity(t, t),
        lambda t: torch.logsumexp(t, 1),
        lambda t: t.var(1),
        lambda t: torch.std(t),
        lambda t: torch.expm1(t),
        lambda t: 1 / t,
        lambda t: F.softplus(t),
        lambda t: F.interpolate(t[None], scale_factor=2.0),
        lambda t: F.pad(t[None], (1, 1), mode="reflect"),
        lambda t: torch.cdist(t, t),
        lambda t: F.mse_loss(t, t.flip(0)),
    ],
)
def test_float32_functions_run_in_float32_from_low_inputs(call):
    low = torch.rand(4, 6, dtype=torch.bfloat16) + 0.5
    amp = mt.autocast("bf16")
    with amp:
        out = call(low)
    assert out.dtype == torch.float32
    assert sum(amp.report.dtype_counts().values()) == 1  # counted, once
