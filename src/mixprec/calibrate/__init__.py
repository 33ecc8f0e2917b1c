"""Observers, the streaming calibration runner and the calibrate pass."""
