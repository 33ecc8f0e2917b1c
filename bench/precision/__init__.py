"""FP16/BF16: converters side by side, OpenVINO's bf16, FP16 tuning, AMP training."""
