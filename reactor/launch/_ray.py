"""Ray starts the daemons, reactor places the reactors: ``reactor ray APP --address auto``.

For users who already run a Ray cluster (RLlib's). Ray starts and supervises processes here, and
nothing else: the data plane stays reactor's (ZeroMQ with CURVE, shared memory within a daemon).

1. :func:`start_daemons` reserves one bundle on each of ``nodes`` Ray nodes (a placement group,
   ``STRICT_SPREAD``: one daemon per node) and starts a :class:`ReactorDaemon` actor in each. The
   actor runs ``reactor daemon --die-with-parent`` as its child (it ends with the actor),
   listening on the node's IP, its state in the node's temp directory.
2. Keys: the driver makes a key pair for the job (kept in a 0700 directory on the driver's
   machine); each daemon makes its own pair on its node and admits the driver's public key.
   Only public keys travel through Ray (whose channels pickle), never a secret.
3. :func:`here` writes a hosts file naming each daemon with its address and public key, and runs
   the app over them through the command line's ``run`` (the coordinator in the driver).
4. At the end, on every path, each actor stops its daemon (SIGTERM: it ends what it hosts) and
   removes the job's keys from its node, then the actors are killed and the placement group
   removed. The daemons' logs stay in ``TMP/reactor-ray/JOB/NAME/`` on each node.

Ray restarts a daemon actor that dies (``max_restarts``). The new life reuses its state directory
on that node: the same key pair and the same port, so the same address. A run whose groups have a
restart policy (``--async --restart on-failure``) starts them again there once the daemon answers.

``ray`` is an optional extra (``pip install -e ".[ray]"``); importing this module without it is fine,
and calling into it says how to install it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .._errors import ReactorError

START_TIMEOUT_S = 120.0

__all__ = ["RayError", "here"]


class RayError(ReactorError):
    """Ray is missing, has too few nodes, or a daemon did not start."""


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise RayError('reactor ray needs Ray: pip install -e ".[ray]" (or pip install ray)') from e
    return ray


class ReactorDaemon:
    """A Ray actor that runs one ``reactor daemon`` on its node (wrapped by ``ray.remote`` below)."""

    def __init__(self, job: str, name: str, client_public: str) -> None:
        import ray

        from ..transport import CurveKeys
        from ..transport._curve import write_public
        from ._keys import init_keys

        self.name = name
        self.closing = False
        ip = ray.util.get_node_ip_address()
        self.root = root = Path(tempfile.gettempdir()) / "reactor-ray" / job / name
        keys = root / "keys"
        if not (keys / "key").exists():
            init_keys(keys)
        write_public(keys / "authorized" / "driver.pub", client_public.encode())
        self.public = CurveKeys.load(keys / "key").public.decode()
        port = "*"
        with contextlib.suppress(OSError, ValueError, KeyError):  # a new life of this actor: same port
            port = json.loads((root / "state" / "daemon.json").read_text())["address"].rsplit(":", 1)[1]
        with open(root / "daemon.err", "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "reactor.cli", "daemon", "--listen", f"tcp://{ip}:{port}", "--name", name,
                 "--state-dir", str(root / "state"), "--keys", str(keys), "--die-with-parent"],
                stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RayError(f"daemon {name} did not start: {(root / 'daemon.err').read_text()[-2000:]}")
        self.address = json.loads(line)["address"]
        # A daemon that dies takes its actor with it, so Ray starts both again (max_restarts).
        threading.Thread(target=self._watch, name="reactor-daemon-watch", daemon=True).start()

    def _watch(self) -> None:
        rc = self.proc.wait()
        if self.closing:
            return
        print(f"reactor daemon {self.name} ended (exit status {rc}); ending its actor for Ray to restart",
              file=sys.stderr, flush=True)
        os._exit(1)

    def close(self) -> None:
        """Stop the daemon cleanly (it ends what it hosts) and remove this job's keys on the node;
        its logs and state stay in the node's temp directory."""
        self.closing = True
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.root / "keys", ignore_errors=True)

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "address": self.address, "public_key": self.public, "pid": self.proc.pid,
                "running": self.proc.poll() is None}

    def daemon_pid(self) -> int:
        return self.proc.pid


def start_daemons(job: str, nodes: int, client_public: str, cpus_per_daemon: float = 1.0,
                  max_restarts: int = 3) -> tuple[Any, list[Any], list[dict[str, Any]]]:
    """Place one daemon actor per node; (placement group, actors, their infos)."""
    ray = _ray()
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    alive = [n for n in ray.nodes() if n.get("Alive")]
    if nodes > len(alive):
        raise RayError(f"--nodes {nodes}: the Ray cluster has {len(alive)} live nodes")
    pg = placement_group([{"CPU": cpus_per_daemon}] * nodes, strategy="STRICT_SPREAD", name=f"reactor-{job}")
    try:
        ray.get(pg.ready(), timeout=START_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - Ray's GetTimeoutError among others
        ray.util.remove_placement_group(pg)
        raise RayError(f"no placement of {nodes} daemon{'s' if nodes > 1 else ''} on distinct nodes "
                       f"({cpus_per_daemon} CPU each) within "
                       f"{START_TIMEOUT_S:.0f} s: {e}") from e
    actor = ray.remote(ReactorDaemon)
    actors = [actor.options(num_cpus=cpus_per_daemon, max_restarts=max_restarts, max_task_retries=-1,
                            scheduling_strategy=PlacementGroupSchedulingStrategy(
                                placement_group=pg, placement_group_bundle_index=i)).remote(job, f"ray-{i}", client_public)
              for i in range(nodes)]
    try:
        infos = ray.get([a.info.remote() for a in actors], timeout=START_TIMEOUT_S)
    except Exception:
        stop_daemons(pg, actors)
        raise
    return pg, actors, infos


def stop_daemons(pg: Any, actors: Sequence[Any]) -> None:
    ray = _ray()
    with contextlib.suppress(Exception):  # an actor that is gone or hangs: killed below all the same
        ray.get([a.close.remote() for a in actors], timeout=30)
    for a in actors:
        with contextlib.suppress(Exception):
            ray.kill(a, no_restart=True)
    with contextlib.suppress(Exception):
        ray.util.remove_placement_group(pg)


def _check_address(address: str | None) -> None:
    """Refuse an ``--address`` that is not ``auto``, ``local`` (None here), ``ray://HOST:PORT`` or a cluster's
    ``HOST:PORT``, or where nothing accepts a TCP connection within 5 s: Ray's own ``init`` raised
    ``ValueError: Invalid address format`` in a traceback for the first, and retried its connect for
    minutes, printing only its warnings, for the second.

    Raises:
        RayError: naming the address and what is wrong with it.
    """
    if address in (None, "auto"):
        return
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or any(c.isspace() for c in host):
        raise RayError(f"--address {address!r:.200}: not a Ray cluster's address (auto, local, ray://HOST:PORT, or "
                       f"HOST:PORT)")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5.0).close()
    except OSError as e:
        raise RayError(f"--address {address}: nothing accepts a connection there ({e.strerror or e}); start Ray there "
                       f"(ray start --head) or give the address it printed") from None


def here(app: str, run_args: Sequence[str], *, address: str | None, nodes: int | None, cpus_per_daemon: float,
         max_restarts: int, run_app: Callable[[list[str]], int]) -> int:
    """Start the daemons on the Ray cluster at ``address``, run the app over them, stop them."""
    from ..transport import CurveKeys  # noqa: F401 - the keys' module, loaded before Ray forks anything
    from ._keys import init_keys, load_keys

    _check_address(address)
    if not 0 < cpus_per_daemon < math.inf:
        raise RayError(f"--cpus-per-daemon {cpus_per_daemon}: a positive number of CPUs expected")
    if max_restarts < 0:
        raise RayError(f"--max-restarts {max_restarts}: a count >= 0 expected")
    ray = _ray()
    try:
        ray.init(address=address, logging_level="WARNING", log_to_driver=False)
    except ConnectionError as e:  # (no cluster at `auto`, or none at the address: Ray's traceback, before)
        where = "--address auto: no Ray cluster found from this machine" if address in (None, "auto") else \
            f"--address {address}: cannot reach a Ray cluster there"
        raise RayError(f"{where} ({(str(e).splitlines() or [type(e).__name__])[0]}); start one (ray start --head) "
                       f"or give --address ray://HOST:PORT, or --address local for a one-node Ray here") from None
    try:
        n = nodes or len([x for x in ray.nodes() if x.get("Alive")])
        job = time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"
        with tempfile.TemporaryDirectory(prefix="reactor-ray-") as tmp:
            keys_dir = Path(tmp) / "keys"
            init_keys(keys_dir)
            public = load_keys(keys_dir).public.decode()
            pg, actors, infos = start_daemons(job, n, public, cpus_per_daemon, max_restarts)
            try:
                hosts = Path(tmp) / "hosts.toml"
                hosts.write_text("[hosts]\n" + "".join(
                    f'"{i["name"]}" = {{ address = "{i["address"]}", key = "{i["public_key"]}" }}\n' for i in infos))
                print(f"reactor ray: {n} daemon{'s' if n > 1 else ''} on {n} Ray node{'s' if n > 1 else ''}: "
                      + ", ".join(f"{i['name']} {i['address']}" for i in infos), file=sys.stderr, flush=True)
                os.environ["REACTOR_KEYS"] = str(keys_dir)
                return run_app(["run", app, "--hosts", str(hosts), *run_args])
            finally:
                stop_daemons(pg, actors)
    finally:
        ray.shutdown()
