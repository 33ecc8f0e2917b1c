"""``mixprec optimize``: the candidates (precision x runtime), each checked by the guard
room and timed beside the input in ONNX Runtime; pruning; the winner with how to run it."""
