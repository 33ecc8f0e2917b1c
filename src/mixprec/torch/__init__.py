"""mixprec.torch: convert a PyTorch module to FP16/BF16 mixed precision or INT8.

Needs the ``torch`` extra (``pip install "mixprec[torch]"``: torch 2.13.0 and
onnxscript); ``import mixprec`` works without it.

Example:
    >>> import mixprec.torch                                          # doctest: +SKIP
    >>> fast = mixprec.torch.convert_module(model, (x,), dtype="fp16")  # doctest: +SKIP
    >>> y = fast(x)                                                   # doctest: +SKIP
    >>> fast.save("model_fp16")                                       # doctest: +SKIP
    >>> again = mixprec.torch.load("model_fp16")                      # doctest: +SKIP
"""

from __future__ import annotations

try:
    import torch as _torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        'mixprec.torch needs PyTorch: pip install "mixprec[torch]" (torch 2.13.0, onnxscript)'
    ) from exc

from mixprec.torch._amp_report import AmpReport
from mixprec.torch._autocast import autocast, training_policy
from mixprec.torch._check import CheckReport, TorchCheckError
from mixprec.torch._convert import convert_module
from mixprec.torch._export import DYNAMO, TORCHSCRIPT
from mixprec.torch._module import ConvertedModule, ModuleSpec, load

__all__ = [
    "DYNAMO",
    "TORCHSCRIPT",
    "AmpReport",
    "CheckReport",
    "ConvertedModule",
    "ModuleSpec",
    "TorchCheckError",
    "autocast",
    "convert_module",
    "load",
    "training_policy",
]
