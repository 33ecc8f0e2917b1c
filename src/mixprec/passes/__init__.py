"""Generic onnx_ir passes: the input graph's checks and repairs (``input_checks``,
``sanitize``), opset upgrade, folding, cleanup, shape inference, MAC counting, bf16/fp16
emulation."""
