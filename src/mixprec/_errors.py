"""Error types raised at mixprec's public boundary."""

from __future__ import annotations


class MixprecError(Exception):
    """A user-facing error: bad input, bad configuration, or a model mixprec cannot handle.

    The CLI prints ``str(error)`` on one line and exits with status 2.
    """
