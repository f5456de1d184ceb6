"""Three "hosts" on this machine for the multi-host tests: network namespaces joined by veth pairs
and a bridge, one subnet, a `reactor daemon` in each. Where namespaces cannot be made (not root, no
`ip`), three daemons on loopback with distinct names stand in, and the fixture says so (a warning in
the test output). Everything is torn down even when the test fails: daemons stopped, any process
left in a namespace killed, the namespaces and the bridge deleted.
"""

from __future__ import annotations

import contextlib
import csv
import ipaddress
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from reactor.launch._keys import init_keys
from reactor.transport._shm import list_segments

ROOT = Path(__file__).resolve().parents[2]


def segments_launched_by(pid: int | None = None) -> set[str]:
    """The bulk segments in /dev/shm of runs launched by process ``pid`` (default: this one; a run id
    holds its launcher's pid): after a run, any left is one it did not unlink. Tests running beside
    this one in another xdist worker have segments of their own at any moment."""
    mine = f"-{os.getpid() if pid is None else pid}-"
    return {s for s in list_segments() if mine in s.split(".")[1]}


def evaluations(csv_path: Path) -> list[float]:
    """The evaluation returns in a run's metrics.csv so far (Metrics flushes it at each one), in order."""
    with open(csv_path, newline="") as f:
        return [float(r["value"]) for r in csv.DictReader(f) if r["name"] == "eval_return"]


def wait_for(pred: Any, timeout_s: float, what: str, period_s: float = 0.05) -> Any:
    """``pred()``'s first truthy value, polled every ``period_s`` for up to ``timeout_s``.

    Raises:
        AssertionError: it stayed falsy, naming ``what``.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if got := pred():
            return got
        time.sleep(period_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def in_thread(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """Run ``fn`` (a blocking ``run(...)``) in a daemon thread; its ``result`` or ``error`` and the
    monotonic time it ``ended_at`` land in the returned dict."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
        box["ended_at"] = time.monotonic()

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, box


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def namespaces_available() -> str | None:
    """None if network namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "not root"
    if shutil.which("ip") is None:
        return "no `ip` command"
    name = f"rxq{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", name)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        return f"`ip netns add` failed: {getattr(e, 'stderr', e)}"
    _ip("netns", "del", name, check=False)
    return None


_ROUTE_TYPES = ("local", "broadcast", "anycast", "multicast", "unicast", "blackhole", "unreachable", "prohibit",
                "throw", "nat")


_RANGE = ipaddress.ip_network("198.18.0.0/15")  # where the test clusters' subnets come from (free_subnet)


def routed_here() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network this (root) namespace has a route to or an address in (``ip -4 route show
    table all``), but catch-alls: the default route, and any route wider than the whole of
    198.18.0.0/15 (a VPN's ``0.0.0.0/1`` and ``128.0.0.0/1``, say). A test cluster's /24 is more
    specific than those, and there are no hosts of theirs in that range to cut off."""
    nets = []
    for line in _ip("-4", "route", "show", "table", "all", check=False).stdout.splitlines():
        words = line.split()
        if words and words[0] in _ROUTE_TYPES:
            words = words[1:]
        if not words or words[0] == "default":
            continue
        with contextlib.suppress(ValueError):
            net = ipaddress.ip_network(words[0], strict=False)
            if not (net.version == 4 and net.prefixlen < _RANGE.prefixlen and net.supernet_of(_RANGE)):
                nets.append(net)
    return nets


def free_subnet(seed: int, taken: list[ipaddress.IPv4Network]) -> str:
    """The first three octets of a /24 for a test cluster's bridge and hosts: one of the 512 of
    198.18.0.0/15 (RFC 2544's range for benchmarking, routed nowhere), starting from ``seed``, that
    overlaps none of ``taken``. The bridge's address and route are the machine's while the test runs:
    a subnet of its own networks would cut it off from the hosts there.

    Raises:
        RuntimeError: every one overlaps.
    """
    for k in range(512):
        i = (seed + k) % 512
        prefix = f"198.{18 + i // 256}.{i % 256}"
        if not any(ipaddress.ip_network(f"{prefix}.0/24").overlaps(net) for net in taken):
            return prefix
    raise RuntimeError("every /24 of 198.18.0.0/15 overlaps a network this machine routes: no test cluster here")


class Cluster:
    """Daemons on three hosts sharing one cluster key directory (``keys``: also the client's)."""

    def __init__(self, tmp: Path, n: int = 3, heartbeat_timeout_s: float | None = None,
                 fork_server: bool = True) -> None:
        self.tmp = tmp
        self.fork_server = fork_server
        self.keys = tmp / "keys"
        init_keys(self.keys)
        self.tag = secrets.token_hex(2)
        self.netns: list[str] = []
        self.bridge: str | None = None
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.addresses: dict[str, str] = {}
        self.ips: dict[str, str] = {}
        self.names = [f"h{i + 1}" for i in range(n)]
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._log_at: dict[str, int] = {}  # (see mark)
        self._runs_at: dict[str, set[Path]] = {}
        self._hosted_at: dict[str, set[str]] = {}
        why = namespaces_available()
        try:
            if why is None:
                self._make_namespaces()
            else:
                warnings.warn(f"multi-host test on loopback daemons, not network namespaces: {why}", stacklevel=2)
                self.ips = dict.fromkeys(self.names, "127.0.0.1")
            for h in self.names:  # all three start at once (each imports the runtime: ~1 s of CPU)
                self._spawn_daemon(h)
            for h in self.names:
                self._read_address(h)
            if fork_server:
                for h in self.names:
                    self.wait_fork_server(h)
        except BaseException:
            self.close()
            raise

    # -- making it

    def _make_namespaces(self) -> None:
        t = self.tag
        subnet = free_subnet(int(t, 16), routed_here())
        self.bridge = f"rx{t}b"
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{subnet}.254/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, h in enumerate(self.names, 1):
            ns, veth, peer = f"rx{t}{h}", f"rx{t}v{i}", f"rx{t}p{i}"
            _ip("netns", "add", ns)
            self.netns.append(ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
            _ip("link", "set", peer, "netns", ns)
            _ip("link", "set", veth, "master", self.bridge)
            _ip("link", "set", veth, "up")
            _ip("-n", ns, "addr", "add", f"{subnet}.{i}/24", "dev", peer)
            _ip("-n", ns, "link", "set", peer, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self.ips[h] = f"{subnet}.{i}"

    def ns(self, host: str) -> str | None:
        return f"rx{self.tag}{host}" if self.netns else None

    def start_daemon(self, host: str, address: str | None = None) -> None:
        """Start ``host``'s daemon (again: at ``address``, say its last one, as a supervisor would)."""
        self._spawn_daemon(host, address)
        self._read_address(host)

    def _spawn_daemon(self, host: str, address: str | None = None) -> None:
        listen = address or f"tcp://{self.ips[host]}:*"
        cmd = [sys.executable, "-m", "reactor.cli", "daemon", "--listen", listen, "--name", host,
               "--state-dir", str(self.tmp / host), "--keys", str(self.keys)]
        if not self.fork_server:
            cmd.append("--no-fork-server")
        if self.ns(host):
            cmd = ["ip", "netns", "exec", self.ns(host), *cmd]
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        self.procs[host] = p

    def _read_address(self, host: str) -> None:
        p = self.procs[host]
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"daemon {host} did not start: {p.stderr.read()[-2000:]}")
        self.addresses[host] = json.loads(line)["address"]

    def ping(self, host: str) -> dict[str, Any]:
        return self._request(host, "ping")  # type: ignore[no-any-return]

    def wait_fork_server(self, host: str, timeout_s: float = 90.0) -> str:
        """Wait for ``host``'s daemon to have its fork server up (workers start forked from it)."""
        deadline = time.monotonic() + timeout_s
        while (state := self.ping(host)["fork_server"]) == "starting" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert state.startswith("up"), f"{host}'s fork server: {state}"
        return state

    def hosts_toml(self, addresses: dict[str, str] | None = None) -> str:
        text = "[hosts]\n" + "".join(f'{h} = "{a}"\n' for h, a in (addresses or self.addresses).items())
        if self.heartbeat_timeout_s is not None:
            text += f"\n[cluster]\nheartbeat_timeout_s = {self.heartbeat_timeout_s}\n"
        return text

    def write_hosts(self, name: str = "hosts.toml") -> Path:
        path = self.tmp / name
        path.write_text(self.hosts_toml())
        return path

    def env(self) -> dict[str, str]:
        """A client's environment: the cluster key."""
        return {**os.environ, "REACTOR_KEYS": str(self.keys), "PYTHONPATH": str(ROOT)}

    # -- looking at it (a test on a cluster that other tests used looks past its mark)

    def mark(self) -> None:
        """Note where each daemon's log, run directories and hosted runs stand now: :meth:`log`,
        :meth:`new_runs` and :meth:`hosted` then show only what came after."""
        self._log_at = {h: self._log_path(h).stat().st_size if self._log_path(h).exists() else 0 for h in self.names}
        self._runs_at = {h: set(self._runs(h)) for h in self.names}
        self._hosted_at = {h: {w["run"] for w in self._request(h, "hosted")} for h in self.names}

    def log(self, host: str) -> str:
        """``host``'s daemon log since the mark."""
        with open(self._log_path(host), "rb") as f:
            f.seek(self._log_at.get(host, 0))
            return f.read().decode(errors="replace")

    def new_runs(self, host: str) -> list[Path]:
        """The run directories ``host``'s daemon made since the mark."""
        return sorted(set(self._runs(host)) - self._runs_at.get(host, set()))

    def hosted(self, host: str) -> list[dict[str, Any]]:
        """``host``'s daemon's hosted workers (``reactor status``) of the runs it took since the mark."""
        seen = self._hosted_at.get(host, set())
        return [w for w in self._request(host, "hosted") if w["run"] not in seen]

    def _log_path(self, host: str) -> Path:
        return self.tmp / host / "daemon.log"

    def _runs(self, host: str) -> list[Path]:
        d = self.tmp / host / "runs"
        return list(d.iterdir()) if d.is_dir() else []

    def _request(self, host: str, *req: Any) -> Any:
        from reactor.launch._daemon import DaemonClient
        from reactor.launch._keys import load_keys

        keys = load_keys(self.keys)
        with DaemonClient(self.addresses[host], keys.public, keys) as c:
            return c.request(*req)

    def daemons_alive(self) -> bool:
        return all(p.poll() is None for p in self.procs.values())


    def worker_pids(self, host: str | None = None) -> dict[int, str]:
        """pid -> group of every live reactor worker (in ``host``'s namespace, or anywhere)."""
        out = {}
        for env in Path("/proc").glob("[0-9]*/environ"):
            try:
                items = env.read_bytes().split(b"\0")
                cmd = (env.parent / "cmdline").read_bytes()
                cwd = os.readlink(env.parent / "cwd")
            except OSError:  # it exited meanwhile
                continue
            vals = dict(i.split(b"=", 1) for i in items if b"=" in i)
            if b"reactor.launch._forkserver" in cmd:  # forked by a daemon's fork server: named rx:GROUP
                try:
                    comm = (env.parent / "comm").read_text().strip()
                except OSError:
                    continue
                if not comm.startswith("rx:"):
                    continue  # the fork server itself, or a job's coordinator (rx-job)
                vals[b"REACTOR_WORKER_GROUP"] = comm[3:].encode()
            elif b"reactor.launch._worker" not in cmd:
                continue
            if vals.get(b"REACTOR_HOST_ID", b"").decode() not in ((f"daemon:{host}",) if host else
                                                                   tuple(f"daemon:{h}" for h in self.names)):
                continue
            if str(self.tmp) not in cwd:
                continue
            out[int(env.parent.name)] = vals.get(b"REACTOR_WORKER_GROUP", b"?").decode()
        return out

    def wait_no_workers(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.worker_pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        left = self.worker_pids()
        assert not left, f"workers left on the hosts: {left}"

    def kill_workers(self) -> None:
        """SIGKILL every worker left on the hosts (after a test that failed mid-run)."""
        for pid in self.worker_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def cut(self, host: str) -> None:
        """Unplug ``host`` from the network (its veth down): its daemon and workers run on, unreachable."""
        assert self.netns, "cutting a host needs namespaces"
        _ip("link", "set", f"rx{self.tag}v{self.names.index(host) + 1}", "down")

    def plug(self, host: str) -> None:
        _ip("link", "set", f"rx{self.tag}v{self.names.index(host) + 1}", "up")

    # -- ending it

    def stop_daemon(self, host: str, sig: int = signal.SIGTERM) -> str:
        p = self.procs[host]
        if p.poll() is None:
            p.send_signal(sig)
        try:
            _, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        return err

    def close(self) -> None:
        for p in self.procs.values():  # every daemon told at once, then each awaited
            if p.poll() is None:
                with contextlib.suppress(Exception):
                    p.send_signal(signal.SIGTERM)
        for h in list(self.procs):
            with contextlib.suppress(Exception):
                self.stop_daemon(h)
        self.kill_workers()
        for ns in self.netns:
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _ip("netns", "del", ns, check=False)
        if self.bridge:
            _ip("link", "del", self.bridge, check=False)
