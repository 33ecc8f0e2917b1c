"""Harness: the bench's models and data, measuring, reports and golden results."""
