"""SIGTERM ends gstrain the way Ctrl-C does: as a KeyboardInterrupt that saves what it can.

pycolmap's logging library installs native failure handlers on import (they dump a native
stack on SIGTERM and kill the process), so the CLI imports pycolmap before installing this.
"""

from __future__ import annotations

import signal
from typing import Any


def _term(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def install_term_handler() -> None:
    """SIGTERM -> KeyboardInterrupt in the main thread (a no-op elsewhere, where Python forbids it)."""
    try:
        signal.signal(signal.SIGTERM, _term)
    except ValueError:  # not the main thread (a test runner's worker)
        pass


def ignore_stop_signals() -> None:
    """Ctrl-C and SIGTERM do nothing from here on (main thread only, like install_term_handler)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            signal.signal(sig, signal.SIG_IGN)
        except ValueError:  # not the main thread
            pass
