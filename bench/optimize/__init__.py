"""`mixprec optimize` against the obvious recipes."""
