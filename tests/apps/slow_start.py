"""Test app: forever.py's ticker and sink, whose worker processes take ``worker_sleep_s`` to build the
graph (an import or an env's setup that long), so that they are late to say "hello". The process that
passes its own pid as ``parent_pid`` builds it at once."""

from __future__ import annotations

import os
import time

from forever import Sink, Ticker  # (beside this file: the app's folder is on every process's sys.path)

from reactor import Graph


def build(config: dict) -> Graph:
    if int(config.get("parent_pid", 0)) not in (0, os.getpid()):
        time.sleep(float(config.get("worker_sleep_s", 0.0)))
    g = Graph()
    g.connect(g.add(Ticker(), name="ticker").out, g.add(Sink(), name="sink").inp)
    return g
