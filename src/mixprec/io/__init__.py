"""Model files in and out, safely: load and atomic save (``models``), external data
(``external``, ``data_files``), protobuf helpers (``protos``), the checks of a file's
protobuf before ``onnx_ir`` parses it (``proto_checks``), the fields a written model
carries to say how it runs (``runtime_fields``) and onnxruntime-genai's files beside a
decoder (``genai``). What is fed to a model lives in :mod:`mixprec.inputs`; the checks and
repairs of an odd input graph are passes (:mod:`mixprec.passes`).
"""
