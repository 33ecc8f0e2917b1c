"""Readers of the decisions: the HTML page, graph view, layout, log dir, tune page."""
