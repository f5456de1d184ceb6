"""A reaction held in one C call that keeps the interpreter's lock (tests/integration/test_placements.py), as a
long regex match or a C extension that does not release the GIL is: a default mutex locked twice by its own
thread, through ``ctypes.PyDLL`` (which, unlike ``CDLL``, keeps the lock during the call). No thread of the
process runs Python again, and no core is spent. ``ready_file``: written just before."""

from __future__ import annotations

import ctypes
from pathlib import Path

from reactor import Graph, Reactor, reaction, startup


class Holder(Reactor):
    def __init__(self, ready_file: str) -> None:
        self.ready_file = ready_file

    @reaction(triggers=[startup])
    def hold(self) -> None:
        Path(self.ready_file).write_text("holding")
        libc = ctypes.PyDLL(None)
        mutex = ctypes.create_string_buffer(64)  # zeros: PTHREAD_MUTEX_INITIALIZER, a default mutex (40 or 48 bytes)
        libc.pthread_mutex_lock(mutex)
        libc.pthread_mutex_lock(mutex)  # (relocked by its owner: a default mutex waits for good, signals or not)


def build(config: dict) -> Graph:
    g = Graph()
    g.add(Holder(str(config["ready_file"])), name="holder")
    return g
