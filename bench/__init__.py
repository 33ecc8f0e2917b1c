"""The bench: mixprec against its peers on real pretrained models (`bash bench/run.sh`).

A package by family; run its scripts from the repository root as modules
(``python -m bench``, ``python -m bench.harness.golden``, ...):

- ``harness``: the models and their data (corpus, probes, sentences), measuring,
  reports, golden results, the zoo and the report-page timing;
- ``precision``: FP16/BF16: conversion by each converter, OpenVINO's bf16, FP16 tuning,
  training with AMP;
- ``int8``: every INT8 quantizer on every model, the guard's readings, INT8 tuning,
  ResNet-50;
- ``weights``: weight-only INT4/INT8 on decoders, language-model evaluation, llama.cpp;
- ``optimize``: ``mixprec optimize`` against the obvious recipes;
- ``exporters``: the models the bench derives (MiniLM, MNIST, the decoders with KV caches).

``main`` runs the whole bench (``python -m bench``).
"""
