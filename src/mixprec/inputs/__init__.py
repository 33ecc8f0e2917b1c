"""What is fed to a model: its input signature (``signature``), given samples checked
against it (``samples``), generated inputs and calibration streams (``feeds``), text
tokenized into windows (``text``) and the lower bounds of symbolic lengths (``bounds``).
Model files themselves are :mod:`mixprec.io`'s.
"""
