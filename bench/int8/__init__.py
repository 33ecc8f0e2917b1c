"""INT8: every quantizer on every model, the guard's readings, tuning, ResNet-50."""
