"""ONNX Runtime: sessions, probes, low-precision emulation, validation, kernel reading."""
