"""A user's own function named on the command line: ``MODULE:FUNCTION`` or
``path/to/file.py:FUNCTION`` (``quantize --metric``)."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mixprec.core.errors import MixprecError

__all__ = ["load_callable"]


def load_callable(spec: str, flag: str = "--metric") -> Callable[..., Any]:
    """The function ``spec`` names; one error line (naming ``flag``) when it cannot load."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise MixprecError(f"{flag} {spec!r}: expected MODULE:FUNCTION or FILE.py:FUNCTION")
    try:
        if where.endswith(".py"):
            found = importlib.util.spec_from_file_location(Path(where).stem, where)
            if found is None or found.loader is None:
                raise ImportError(f"cannot load {where}")
            module = importlib.util.module_from_spec(found)
            found.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except (ImportError, OSError, SyntaxError) as e:
        raise MixprecError(f"{flag} {spec!r}: cannot load {where}: {e}") from e
    function = getattr(module, name, None)
    if not callable(function):
        raise MixprecError(f"{flag} {spec!r}: {where} has no function {name!r}")
    return function
