"""The stages composed for each target, and the conversion report (data)."""
