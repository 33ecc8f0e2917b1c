"""The op registry's torch table: which PyTorch functions implement each ONNX op type of
mixprec's lists, so that ``mixprec.torch.autocast`` governs training with the same lists
and names as the converter. Plain data (dotted names); the torch layer resolves them.

Also the training defaults: the ops that training keeps in float32 (or allows low) on
top of the converter's default lists, at least as safe as ``torch.autocast``'s own.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

__all__ = ["TORCH_FUNCTIONS", "TRAINING_ALLOW", "TRAINING_DENY", "TRAINING_FP32_FUNCTIONS"]

_F = "torch.nn.functional."
_T = "torch.Tensor."


def _both(*names: str) -> tuple[str, ...]:
    """``torch.NAME`` and the ``Tensor.NAME`` method of each name."""
    return tuple(f"torch.{n}" for n in names) + tuple(f"{_T}{n}" for n in names)


#: ONNX op type -> the torch functions (dotted names) that compute it.
TORCH_FUNCTIONS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        # ALLOW by default: the compute-heavy ops
        "MatMul": (*_both("matmul", "mm", "bmm"), f"{_T}__matmul__", f"{_T}__rmatmul__"),
        "Gemm": (f"{_F}linear", f"{_F}bilinear", *_both("addmm", "baddbmm", "addbmm")),
        "Conv": (f"{_F}conv1d", f"{_F}conv2d", f"{_F}conv3d"),
        "ConvTranspose": (
            f"{_F}conv_transpose1d",
            f"{_F}conv_transpose2d",
            f"{_F}conv_transpose3d",
        ),
        "Einsum": ("torch.einsum",),
        # fused attention (ONNX Attention, opset 23); multi_head_attention_forward is
        # seen as one call (its inner linear/softmax are not intercepted one by one)
        "Attention": (f"{_F}scaled_dot_product_attention", f"{_F}multi_head_attention_forward"),
        # normalizations, softmax, losses
        "Softmax": (*_both("softmax"), f"{_F}softmax"),
        "LogSoftmax": (*_both("log_softmax"), f"{_F}log_softmax"),
        "LayerNormalization": (f"{_F}layer_norm", f"{_F}rms_norm"),
        "BatchNormalization": (f"{_F}batch_norm",),
        "GroupNormalization": (f"{_F}group_norm",),
        "InstanceNormalization": (f"{_F}instance_norm",),
        "SoftmaxCrossEntropyLoss": (f"{_F}cross_entropy",),
        "NegativeLogLikelihoodLoss": (f"{_F}nll_loss",),
        # pointwise math and reductions
        "Exp": _both("exp"),
        "Log": _both("log"),
        "Pow": (*_both("pow"), f"{_T}__pow__"),
        "Sqrt": _both("sqrt"),
        "Reciprocal": _both("reciprocal"),
        "ReduceSum": _both("sum"),
        "ReduceMean": _both("mean"),
        "ReduceProd": _both("prod"),
        "CumSum": _both("cumsum"),
        "Add": (*_both("add"), f"{_T}__add__", f"{_T}__radd__"),
        "Sub": (*_both("sub"), f"{_T}__sub__", f"{_T}__rsub__"),
        "Mul": (*_both("mul"), f"{_T}__mul__", f"{_T}__rmul__"),
        "Div": (*_both("div"), f"{_T}__truediv__", f"{_T}__rtruediv__"),
        # activations
        "Relu": (f"{_F}relu", *_both("relu")),
        "Gelu": (f"{_F}gelu",),
        "Sigmoid": (f"{_F}sigmoid", *_both("sigmoid")),
        "Tanh": (f"{_F}tanh", *_both("tanh")),
        "Erf": _both("erf"),
        "Softplus": (f"{_F}softplus",),
        "HardSwish": (f"{_F}hardswish",),
        "LeakyRelu": (f"{_F}leaky_relu",),
        "Elu": (f"{_F}elu",),
        # pooling and data movement (CLEAR: they follow their input)
        "MaxPool": (f"{_F}max_pool1d", f"{_F}max_pool2d", f"{_F}max_pool3d"),
        "AveragePool": (f"{_F}avg_pool1d", f"{_F}avg_pool2d", f"{_F}avg_pool3d"),
        "GlobalAveragePool": (f"{_F}adaptive_avg_pool1d", f"{_F}adaptive_avg_pool2d"),
        "Dropout": (f"{_F}dropout",),
        "Concat": ("torch.cat", "torch.concat"),
        "Flatten": _both("flatten"),
        "Reshape": (*_both("reshape"), f"{_T}view"),
        "Transpose": (*_both("transpose", "permute"),),
    }
)

#: Training moves these to DENY, on top of the converter's defaults: norms, softmax and
#: log-softmax, losses, exp/log/pow and reductions in float32 (``torch.autocast`` on
#: CPU keeps only the losses and a few rarer ops in float32).
TRAINING_DENY = frozenset(
    {
        "Softmax",
        "LogSoftmax",
        "LayerNormalization",
        "BatchNormalization",
        "GroupNormalization",
        "InstanceNormalization",
        "SoftmaxCrossEntropyLoss",
        "NegativeLogLikelihoodLoss",
        "Exp",
        "Log",
        "Pow",
        "ReduceSum",
        "ReduceMean",
        "ReduceProd",
        "CumSum",
    }
)
#: Training allows these low: fused attention kernels that keep their softmax in
#: float32 (PyTorch's CPU flash attention and CUDA kernels accumulate in float32).
TRAINING_ALLOW = frozenset({"Attention"})

#: Losses that have no ONNX op type: float32 in training whatever the lists say.
TRAINING_FP32_FUNCTIONS = tuple(
    f"{_F}{n}"
    for n in (
        "mse_loss",
        "l1_loss",
        "smooth_l1_loss",
        "huber_loss",
        "binary_cross_entropy",
        "binary_cross_entropy_with_logits",
        "kl_div",
        "poisson_nll_loss",
        "cosine_embedding_loss",
        "margin_ranking_loss",
        "triplet_margin_loss",
        "ctc_loss",
    )
)
