"""Accuracy-aware tuning: sensitivity, search, targets, metrics, result."""
