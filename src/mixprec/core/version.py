"""The package version: one home, read by the log dir and re-exported from ``mixprec``."""

__version__ = "0.1.0"
