"""The op registry's torch table: which PyTorch functions implement each ONNX op type of
mixprec's lists, so that ``mixprec.torch.autocast`` governs training with the same lists
and names as the converter. Plain data (dotted names); the torch layer resolves them.

Also the training defaults: the ops that training keeps in float32 (or allows low) on
top of the converter's default lists, at least as safe as ``torch.autocast``'s own.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

__all__ = [
    "TORCH_FUNCTIONS",
    "TORCH_OP_BY_OP",
    "TRAINING_ALLOW",
    "TRAINING_DENY",
    "TRAINING_FP32_FUNCTIONS",
]

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
        # fused attention (ONNX Attention, opset 23); multi_head_attention_forward is one
        # call unless it returns the attention weights (see TORCH_OP_BY_OP)
        "Attention": (f"{_F}scaled_dot_product_attention", f"{_F}multi_head_attention_forward"),
        # normalizations, softmax, losses
        "Softmax": (*_both("softmax"), f"{_F}softmax", f"{_F}softmin", "torch.special.softmax"),
        "LogSoftmax": (*_both("log_softmax"), f"{_F}log_softmax", "torch.special.log_softmax"),
        "LayerNormalization": (
            f"{_F}layer_norm",
            f"{_F}rms_norm",
            "torch.layer_norm",
            "torch.native_layer_norm",
            "torch.rms_norm",
        ),
        "BatchNormalization": (f"{_F}batch_norm",),
        "GroupNormalization": (f"{_F}group_norm", "torch.group_norm"),
        "InstanceNormalization": (f"{_F}instance_norm",),
        "LpNormalization": (f"{_F}normalize",),
        "SoftmaxCrossEntropyLoss": (f"{_F}cross_entropy",),
        "NegativeLogLikelihoodLoss": (f"{_F}nll_loss",),
        # pointwise math and reductions
        "Exp": _both("exp"),
        "Log": _both("log"),
        "Pow": (*_both("pow"), f"{_T}__pow__", f"{_T}__rpow__"),
        "Sqrt": _both("sqrt"),
        # ``scalar / t`` is ``t.reciprocal() * scalar`` in torch
        "Reciprocal": (*_both("reciprocal"), f"{_T}__rtruediv__", f"{_T}__rdiv__"),
        "Acos": _both("acos", "arccos"),
        "Asin": _both("asin", "arcsin"),
        "Cosh": _both("cosh"),
        "Sinh": _both("sinh"),
        "Tan": _both("tan"),
        "ReduceSum": _both("sum"),
        "ReduceMean": _both("mean"),
        "ReduceProd": _both("prod"),
        "ReduceLogSumExp": (*_both("logsumexp"), "torch.special.logsumexp"),
        "CumSum": _both("cumsum"),
        "Add": (*_both("add"), f"{_T}__add__", f"{_T}__radd__"),
        "Sub": (*_both("sub"), f"{_T}__sub__", f"{_T}__rsub__"),
        "Mul": (*_both("mul"), f"{_T}__mul__", f"{_T}__rmul__"),
        "Div": (*_both("div"), f"{_T}__truediv__"),
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
        # pooling, resampling and data movement (CLEAR: they follow their input); the
        # 3-D pools are float32 in training (TRAINING_FP32_FUNCTIONS)
        "MaxPool": (f"{_F}max_pool1d", f"{_F}max_pool2d"),
        "AveragePool": (f"{_F}avg_pool1d", f"{_F}avg_pool2d"),
        "GlobalAveragePool": (f"{_F}adaptive_avg_pool1d", f"{_F}adaptive_avg_pool2d"),
        "Resize": (
            f"{_F}interpolate",
            f"{_F}upsample",
            f"{_F}upsample_nearest",
            f"{_F}upsample_bilinear",
        ),
        "GridSample": (
            f"{_F}grid_sample",
            "torch.grid_sampler",
            "torch.grid_sampler_2d",
            "torch.grid_sampler_3d",
            "torch._grid_sampler_2d_cpu_fallback",
        ),
        "Pad": (f"{_F}pad",),
        "Dropout": (f"{_F}dropout",),
        "Concat": ("torch.cat", "torch.concat"),
        "Flatten": _both("flatten"),
        "Reshape": (*_both("reshape"), f"{_T}view"),
        "Transpose": (*_both("transpose", "permute"),),
    }
)

#: Composites that the mode runs op by op (each inner torch call under the lists) when
#: the named argument (default in the tuple) is true: ``multi_head_attention_forward``
#: with ``need_weights`` computes its weights with ``baddbmm`` and ``softmax`` in the
#: dtype it gets, so it cannot be allowed low as one call (the softmax must be float32).
TORCH_OP_BY_OP: Mapping[str, tuple[str, bool]] = MappingProxyType(
    {f"{_F}multi_head_attention_forward": ("need_weights", True)}
)

#: Training moves these to DENY, on top of the converter's defaults: norms, softmax and
#: log-softmax, losses, exp/log/pow/reciprocal/softplus, reductions, resampling and
#: padding in float32. With TRAINING_FP32_FUNCTIONS this covers every op that
#: ``torch.autocast`` keeps in float32 on CPU or CUDA (tests/torch checks it op by op
#: against the installed torch).
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
        "Reciprocal",
        "Softplus",
        "ReduceSum",
        "ReduceMean",
        "ReduceProd",
        "CumSum",
        "Resize",  # torch.autocast: upsample_* (CUDA)
        "GridSample",  # grid_sampler (CPU)
        "Pad",  # reflection_pad*, replication_pad* (CPU)
    }
)
#: Training allows these low: fused attention kernels that keep their softmax in
#: float32 (PyTorch's CPU flash attention and CUDA kernels accumulate in float32).
TRAINING_ALLOW = frozenset({"Attention"})


def _fn(*names: str) -> tuple[str, ...]:
    return tuple(f"{_F}{n}" for n in names)


def _in(module: str, *names: str) -> tuple[str, ...]:
    return tuple(f"torch.{module}.{n}" for n in names)


#: Functions with no op type in the table that training runs in float32 whatever the
#: lists say: the losses, and the rest of ``torch.autocast``'s float32 lists (CPU and
#: CUDA: precision-sensitive math, norms and distances, 3-D pools, linear algebra,
#: FFTs), plus variance and standard deviation (reductions).
TRAINING_FP32_FUNCTIONS: tuple[str, ...] = (
    *_fn(
        "mse_loss",
        "l1_loss",
        "smooth_l1_loss",
        "huber_loss",
        "binary_cross_entropy",
        "binary_cross_entropy_with_logits",
        "kl_div",
        "poisson_nll_loss",
        "gaussian_nll_loss",
        "cosine_embedding_loss",
        "hinge_embedding_loss",
        "margin_ranking_loss",
        "multi_margin_loss",
        "multilabel_margin_loss",
        "multilabel_soft_margin_loss",
        "soft_margin_loss",
        "triplet_margin_loss",
        "triplet_margin_with_distance_loss",
        "ctc_loss",
    ),
    *(
        f"torch.{n}"
        for n in (
            "binary_cross_entropy_with_logits",
            "kl_div",
            "poisson_nll_loss",
            "cosine_embedding_loss",
            "hinge_embedding_loss",
            "margin_ranking_loss",
            "triplet_margin_loss",
            "ctc_loss",
        )
    ),
    # pointwise math
    *_both("expm1", "log10", "log2", "log1p", "erfinv", "rsqrt", "cumprod"),
    *_in("special", "expm1", "log1p", "erfinv"),
    # norms, distances, statistics
    *_both("norm", "renorm", "dist", "var", "std", "trace", "quantile", "nanquantile"),
    *(f"torch.{n}" for n in ("frobenius_norm", "nuclear_norm", "var_mean", "std_mean")),
    *("torch.cdist", "torch.pdist", "torch.cosine_similarity", "torch.pairwise_distance"),
    *_in("linalg", "norm", "vector_norm", "matrix_norm"),
    # the 3-D and the rarer pools (CPU)
    *_fn("avg_pool3d", "max_pool3d", "max_pool3d_with_indices", "adaptive_avg_pool3d"),
    *_fn("adaptive_max_pool3d", "adaptive_max_pool3d_with_indices"),
    *_fn("fractional_max_pool2d", "fractional_max_pool2d_with_indices"),
    *_fn("fractional_max_pool3d", "fractional_max_pool3d_with_indices"),
    *_fn("max_unpool2d", "max_unpool3d"),
    "torch.max_pool3d",
    # linear algebra, FFTs, complex numbers, fake quantization (CPU)
    *_both("cholesky", "cholesky_inverse", "cholesky_solve", "inverse", "lu", "lu_solve"),
    *_both("orgqr", "ormqr", "pinverse", "geqrf", "qr", "svd", "triangular_solve", "stft"),
    *("torch._lu_with_info", "torch.polar", "torch.view_as_complex"),
    "torch.fake_quantize_per_tensor_affine",
    *_in("linalg", "cholesky", "cholesky_ex", "cond", "eig", "eigh", "eigvals", "eigvalsh"),
    *_in("linalg", "householder_product", "inv", "inv_ex", "lstsq", "matrix_rank", "qr"),
    *_in("linalg", "solve", "svd", "svdvals", "tensorinv", "tensorsolve"),
    *_in("fft", "fft", "ifft", "fft2", "ifft2", "fftn", "ifftn", "rfft", "irfft"),
    *_in("fft", "rfft2", "irfft2", "rfftn", "irfftn", "hfft", "ihfft"),
)
