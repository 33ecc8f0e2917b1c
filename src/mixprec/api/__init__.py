"""The public entry points: convert, inspect, quantize, tune, validate."""
