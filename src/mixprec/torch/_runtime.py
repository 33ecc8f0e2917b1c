"""Running a converted model on ONNX Runtime with torch tensors in and out.

Inputs are bound in place through ``io_binding`` (no copy for contiguous tensors of the
graph's dtype, on CPU or, with the CUDA execution provider, on the GPU); outputs are
allocated by ONNX Runtime on the device of the first input and handed to torch.

ONNX Runtime's CPU provider has almost no bfloat16 kernels: a bfloat16 model that it
cannot load is run as its FP32 emulation (:class:`mixprec.EmulateLowPrecisionPass`:
every bfloat16 tensor rounded through bfloat16, arithmetic in FP32), and
:attr:`OrtRunner.kind` says so.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import torch

from mixprec.core.config import ort_log_severity
from mixprec.core.errors import MixprecError
from mixprec.runtime.emulate import emulate_low_precision
from mixprec.runtime.ort import ort_first_line

__all__ = ["OrtRunner", "default_providers"]

logger = logging.getLogger(__name__)

_CUDA = "CUDAExecutionProvider"
_CPU = "CPUExecutionProvider"
_NUMPY_TYPES: dict[ir.DataType, type[np.generic]] = {
    ir.DataType.FLOAT: np.float32,
    ir.DataType.FLOAT16: np.float16,
    ir.DataType.DOUBLE: np.float64,
    ir.DataType.INT64: np.int64,
    ir.DataType.INT32: np.int32,
    ir.DataType.INT16: np.int16,
    ir.DataType.INT8: np.int8,
    ir.DataType.UINT8: np.uint8,
    ir.DataType.BOOL: np.bool_,
}
_TORCH_TYPES: dict[ir.DataType, torch.dtype] = {
    ir.DataType.FLOAT: torch.float32,
    ir.DataType.FLOAT16: torch.float16,
    ir.DataType.BFLOAT16: torch.bfloat16,
    ir.DataType.DOUBLE: torch.float64,
    ir.DataType.INT64: torch.int64,
    ir.DataType.INT32: torch.int32,
    ir.DataType.INT16: torch.int16,
    ir.DataType.INT8: torch.int8,
    ir.DataType.UINT8: torch.uint8,
    ir.DataType.BOOL: torch.bool,
}


def default_providers() -> list[str]:
    """CUDA then CPU when this onnxruntime build has the CUDA provider, else CPU."""
    available = ort.get_available_providers()
    return [_CUDA, _CPU] if _CUDA in available else [_CPU]


def torch_dtype_of(dtype: ir.DataType | None) -> torch.dtype | None:
    """The torch dtype of an ONNX element type, None when torch has none."""
    return _TORCH_TYPES.get(dtype) if dtype is not None else None


def _has_bfloat16(model: ir.Model) -> bool:
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        for value in node.outputs:
            if value.dtype == ir.DataType.BFLOAT16:
                return True
    return any(
        v.const_value is not None and v.const_value.dtype == ir.DataType.BFLOAT16
        for v in model.graph.initializers.values()
    )


def _to_torch(value: ort.OrtValue) -> torch.Tensor:
    """An output OrtValue as a tensor: shared through DLPack, copied where that fails."""
    try:
        return torch.from_dlpack(value)
    except (RuntimeError, TypeError, BufferError):
        return torch.from_numpy(value.numpy())


class OrtRunner:
    """An ONNX Runtime session over a converted model, fed with torch tensors.

    Attributes:
        providers: the execution providers the session uses.
        kind: "onnxruntime" (the model as converted) or "emulated" (its FP32 emulation).
        fallback_reason: why the model runs emulated, or empty.
    """

    def __init__(
        self, model: ir.Model, providers: Sequence[str] | None = None, threads: int = 0
    ) -> None:
        self.providers = list(providers) if providers else default_providers()
        self.input_types = {v.name or "": v.dtype for v in model.graph.inputs}
        self.input_shapes = {
            v.name or "": [d if isinstance(d, int) else str(d) for d in v.shape]
            if v.shape is not None
            else None
            for v in model.graph.inputs
        }
        self.output_names = [v.name or "" for v in model.graph.outputs]
        self.kind = "onnxruntime"
        self.fallback_reason = ""
        self._threads = threads
        try:
            self.session = self._session(model)
        except Exception as exc:
            if not _has_bfloat16(model):
                raise MixprecError(
                    f"onnxruntime cannot load the converted model: {ort_first_line(exc)}"
                ) from exc
            self.fallback_reason = (
                f"onnxruntime ({', '.join(self.providers)}) cannot run this bfloat16 model "
                f"({ort_first_line(exc)}); running its FP32 emulation"
            )
            logger.info("%s", self.fallback_reason)
            self.kind = "emulated"
            self.session = self._session(emulate_low_precision(model), optimize=False)

    def _session(self, model: ir.Model, optimize: bool = True) -> ort.InferenceSession:
        options = ort.SessionOptions()
        options.log_severity_level = ort_log_severity()
        if self._threads:
            options.intra_op_num_threads = self._threads
        if not optimize:
            # ORT's fusions would swallow the emulation's Cast round trips.
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        data = ir.to_proto(model).SerializeToString()
        return ort.InferenceSession(data, sess_options=options, providers=self.providers)

    @property
    def device(self) -> str:
        """``"cuda"`` when the session runs on the CUDA provider, else ``"cpu"``."""
        return "cuda" if self.session.get_providers()[0] == _CUDA else "cpu"

    def _bind(self, binding: ort.IOBinding, name: str, tensor: torch.Tensor) -> torch.Tensor:
        expected = self.input_types.get(name)
        want = torch_dtype_of(expected)
        if want is not None and tensor.dtype != want:
            raise MixprecError(
                f"input {name!r} is {tensor.dtype}, but the converted model takes {want}"
            )
        on_gpu = tensor.is_cuda and self.device == "cuda"
        tensor = tensor.contiguous() if on_gpu else tensor.detach().cpu().contiguous()
        if expected is None or expected not in _NUMPY_TYPES:
            binding.bind_cpu_input(name, tensor.numpy())
            return tensor
        binding.bind_input(
            name,
            "cuda" if on_gpu else "cpu",
            tensor.device.index or 0 if on_gpu else 0,
            _NUMPY_TYPES[expected],
            list(tensor.shape),
            tensor.data_ptr(),
        )
        return tensor

    def run(self, feeds: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """Run on named tensors; the outputs in graph order, on the first input's device.

        Raises:
            MixprecError: a dtype does not match, or onnxruntime fails (e.g. a shape
                that the export made static); the message shows the expected shapes.
        """
        binding = self.session.io_binding()
        kept = []  # the bound tensors must outlive the run
        device = "cpu"
        for name, tensor in feeds.items():
            if name not in self.input_types:
                continue
            device = "cuda" if tensor.is_cuda and self.device == "cuda" else device
            kept.append(self._bind(binding, name, tensor))
        for name in self.output_names:
            binding.bind_output(name, self.device)
        try:
            self.session.run_with_iobinding(binding)
        except Exception as exc:
            got = {n: list(t.shape) for n, t in feeds.items()}
            raise MixprecError(
                f"onnxruntime failed to run the converted model: {ort_first_line(exc)} "
                f"(inputs {got}; the exported model takes {self.input_shapes})"
            ) from exc
        del kept
        outputs = [_to_torch(value) for value in binding.get_outputs()]
        target = torch.device(device)
        return [out.to(target) if out.device != target else out for out in outputs]
