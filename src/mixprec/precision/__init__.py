"""FP16/BF16: the painter (annotate) and the apply pass."""
