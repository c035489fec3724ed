"""SIGTERM ends gstrain the way Ctrl-C does: as a KeyboardInterrupt that saves what it can.

pycolmap's logging library installs native failure handlers on import (they dump a native
stack on SIGTERM and kill the process), so the CLI imports pycolmap before installing this.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
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


@contextlib.contextmanager
def stop_signals_deferred() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait until the block ends, then raise KeyboardInterrupt: a few quick
    writes that belong together (a new run folder and its run.json) happen whole or not at all.
    Main thread only, like install_term_handler; elsewhere the block runs as it is."""
    caught: list[int] = []
    previous: dict[int, Any] = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda signum, frame: caught.append(signum))
    except ValueError:  # not the main thread: nothing was replaced
        pass
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if any(previous[sig] is not signal.SIG_IGN for sig in caught):
        raise KeyboardInterrupt
