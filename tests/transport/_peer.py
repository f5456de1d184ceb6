"""A peer process for the endpoint tests: ``python -m tests.transport._peer ROLE CONFIG_JSON``.

It prints one JSON line when its endpoint is open (``{"address": ..., "public_key": ...}``) and,
for roles that finish, one JSON line with its results. Roles:

- ``echo``: connect back to the parent and return every message to its sender until ``"stop"``.
- ``slow_sink``: receive ``n`` messages ``{"i": k, ...}``, sleeping ``delay_s`` per message; report
  order, count, peak queue and RSS.
- ``idle``: open and never read (a peer that does not consume); runs until killed.
- ``held``: print every message received (``{"from": sender, "msg": msg}``); on ``"hold"``, print
  ``{"holding": true}`` and hold its loop (a long reaction) until the file ``release`` exists; on
  ``"stats"``, print its hellos refused and messages dropped. Runs until killed.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

from reactor.transport import CurveKeys, Endpoint


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def emit(obj: object) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def main(role: str, cfg: dict) -> None:
    curve = CurveKeys.load(cfg["keys"]) if cfg.get("keys") else None
    ep = await Endpoint.open(
        cfg["name"], cfg.get("bind", "tcp://127.0.0.1:*"), curve=curve, credit_window=cfg.get("credit_window", 64)
    )
    emit({"address": ep.address})
    try:
        if role == "echo":
            server_key = curve.public if curve is not None else None  # one key pair for the whole job
            await ep.connect(cfg["parent_name"], cfg["parent_address"], server_public_key=server_key, timeout_s=30)
            while True:
                for sender, msg in await ep.recv_batch():
                    if msg == "stop":
                        return
                    await ep.send(sender, msg)
        elif role == "slow_sink":
            n, delay_s = cfg["n"], cfg["delay_s"]
            expected, in_order, rss_start, rss_max = 0, True, None, 0
            while expected < n:
                for _sender, msg in await ep.recv_batch(max_n=cfg.get("max_n", 1024)):
                    in_order &= msg["i"] == expected
                    expected += 1
                    await asyncio.sleep(delay_s)
                if rss_start is None:
                    rss_start = rss_bytes()
                rss_max = max(rss_max, rss_bytes())
            st = ep.statistics()
            emit(
                {
                    "received": expected,
                    "in_order": in_order,
                    "max_queued_messages": st.max_queued_messages,
                    "max_queued_nbytes": st.max_queued_nbytes,
                    "dropped": st.dropped_malformed + st.dropped_too_large + st.dropped_over_credit,
                    "rss_growth": rss_max - rss_start,
                }
            )
        elif role == "idle":
            await asyncio.sleep(3600)
        elif role == "held":
            while True:
                for sender, msg in await ep.recv_batch():
                    emit({"from": sender, "msg": msg})
                    if msg == "hold":
                        emit({"holding": True})
                        while not os.path.exists(cfg["release"]):  # the loop held, as in a long update
                            time.sleep(0.01)
                    elif msg == "stats":
                        st = ep.statistics()
                        emit({"hellos_refused": st.hellos_refused, "dropped": st.dropped})
    finally:
        await ep.aclose()


if __name__ == "__main__":
    role, cfg = sys.argv[1], json.loads(sys.argv[2])
    if cfg.get("loop") == "uvloop":
        import uvloop

        uvloop.run(main(role, cfg))
    else:
        asyncio.run(main(role, cfg))
