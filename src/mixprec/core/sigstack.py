"""The main thread's alternate signal stack, made safe before mixprec relies on a signal.

Python installs its signal handlers with ``SA_ONSTACK``: a handler runs on the thread's
alternate signal stack when one is set. OpenVINO's CPU plugin (2026.4, on CPUs with AMX)
sets its own alternate stack when it builds a plugin engine (large enough for AMX tile
state) and frees it when the engine goes, but with two ``ov.Core`` objects released out of
order it leaves the thread pointing at the freed stack. The next signal then kills the
process with SIGSEGV instead of running the handler: Ctrl-C, or the SIGTERM that a save
(:func:`mixprec.io.models.save_model`) catches to remove its temporary files. Seen in the
suite: an optimize test (mixprec's Core), then a test that compiles with a Core of its
own, then a save interrupted by SIGTERM.

:func:`ensure_signal_stack` turns such a dangling stack off (the kernel then delivers on
the thread's own stack, as without one). Linux only; elsewhere, and where the stack is
sound or unset, it does nothing.
"""

from __future__ import annotations

import ctypes
import sys

__all__ = ["ensure_signal_stack"]

_SS_DISABLE = 2


class _Stack(ctypes.Structure):  # Linux's stack_t
    _fields_ = [("sp", ctypes.c_void_p), ("flags", ctypes.c_int), ("size", ctypes.c_size_t)]


def _mapped(*addresses: int) -> bool:
    """Whether every one of ``addresses`` lies in a mapping of this process (one read of
    ``/proc/self/maps``)."""
    left = set(addresses)
    with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
        for line in maps:
            low, _, high = line.partition(" ")[0].partition("-")
            left = {a for a in left if not int(low, 16) <= a < int(high, 16)}
            if not left:
                return True
    return False


def ensure_signal_stack() -> bool:
    """Turn off the calling thread's alternate signal stack where its memory is gone;
    True when it did."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        now = _Stack()
        if libc.sigaltstack(None, ctypes.byref(now)) != 0 or now.flags & _SS_DISABLE:
            return False
        start = now.sp or 0
        if _mapped(start, start + max(now.size, 1) - 1):
            return False
        off = _Stack(None, _SS_DISABLE, 0)
        return bool(libc.sigaltstack(ctypes.byref(off), None) == 0)
    except (OSError, AttributeError, ValueError):  # no libc, no procfs: nothing to mend
        return False
