"""INT8: the plan (annotate), scales, QDQ and dynamic apply passes, bias correction, speed
timing.
"""
