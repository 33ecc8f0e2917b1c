"""Weight-only INT4/INT8: MatMul weights in blocks (ONNX Runtime's ``MatMulNBits``) and
embedding tables (``GatherBlockQuantized``); activations stay float.

* :mod:`~mixprec.weights.config`: :class:`WeightsConfig`, validated once, and the
  CPU-chosen ``accuracy_level``;
* :mod:`~mixprec.weights.blocks`: block quantization in numpy and the contrib ops' layouts;
* :mod:`~mixprec.weights.methods`: the quantization methods by name (``rtn``; a data-aware
  method registers here);
* :mod:`~mixprec.weights.select`: which MatMul and Gather weights, at which bits, and why
  (the lm_head, embeddings, a table tied between them);
* :mod:`~mixprec.weights.apply`: the pass that rewrites the chosen nodes.
"""
