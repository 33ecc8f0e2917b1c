"""Model files in and out, safely: load and atomic save (``models``), external data
(``external``, ``data_files``), protobuf helpers (``protos``), the checks and repairs of
an odd input file (``sanitize``, ``input_checks``) and onnxruntime-genai's files beside a
decoder (``genai``). What is fed to a model lives in :mod:`mixprec.inputs`.
"""
