"""Generic onnx_ir passes: opset upgrade, folding, cleanup, shape inference, MAC counting."""
