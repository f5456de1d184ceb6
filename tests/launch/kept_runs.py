"""Runs several multi-process runs in this one process, the way a sweep through the Python API does,
and prints what each run's workers saw as one JSON line per run (tests/launch/test_forkserver.py)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from reactor import run
from reactor.launch import _forkserver
from reactor.launch._app import build_graph

APP = str(Path(__file__).resolve().parents[1] / "apps" / "runid.py")
OUT = Path(sys.argv[1])
report = os.fdopen(os.dup(1), "w", buffering=1)  # stays on the test's pipe when fd 1 is pointed elsewhere


def one(step: str) -> None:
    out = OUT / step
    out.mkdir()
    config = {"out_dir": str(out), "write": "parent"}
    run(build_graph(APP, config), app=APP, config=config, placement="processes")
    parents = sorted({int(p.read_text()) for p in out.iterdir()})
    kept = _forkserver._kept[0].proc.pid if _forkserver._kept is not None else None
    report.write(json.dumps({"step": step, "parents": parents, "kept": kept, "cwd": os.getcwd()}) + "\n")


one("first")
one("second")
os.kill(_forkserver._kept[0].proc.pid, signal.SIGKILL)  # a kept server that died is not used again
time.sleep(0.2)
one("after-kill")
os.chdir(OUT)
one("other-cwd")
os.dup2(os.open(OUT / "stdout.txt", os.O_WRONLY | os.O_CREAT | os.O_APPEND), 1)
one("other-stdout")
for step in ("thread-kept", "thread-own"):  # a thread uses the kept server while it fits, else its own
    t = threading.Thread(target=one, args=(step,))
    t.start()
    t.join()
    os.dup2(os.open(OUT / "stdout2.txt", os.O_WRONLY | os.O_CREAT | os.O_APPEND), 1)
one("main-again")


async def cell() -> None:  # a notebook's cell: run() where a loop runs gets a thread of its own
    one("notebook")


asyncio.run(cell())
