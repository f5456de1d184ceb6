"""Soak a daemon by hand: one `reactor daemon`, many tiny jobs in sequence, its resources sampled.

    python scripts/soak_daemon.py --jobs 300 --every 25                     # jobs on one host
    python scripts/soak_daemon.py --jobs 300 --hosts --placement processes  # its workers hosted by it
    python scripts/soak_daemon.py --jobs 150 --hosts --placement processes \\
        --daemon-args "--keep-ended 20 --forget-after-s 0 --remove-forgotten"

Every ``--every`` jobs it prints one JSON line: the daemon's open descriptors, threads and RSS (KiB), its
fork server's, how many jobs and hosted workers ``status`` lists and how long it took, and the sizes of
the state directory and of ``daemon.log``. What grows per job without bound shows as a column that does
not level off once ``--keep-ended`` jobs have ended. Not a test: a run of hundreds of jobs takes minutes
(0.2 s a job on one host, 0.9 s over hosts, on a 2-core machine). Everything it made (the daemon, its
fork server, its directory) is gone at its end, unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from reactor.launch._daemon import DaemonClient, job_spec  # noqa: E402
from reactor.launch._keys import init_keys, load_keys  # noqa: E402
from reactor.transport import CurveKeys  # noqa: E402


def proc_info(pid: int) -> list[int] | None:
    """[open descriptors, threads, RSS in KiB] of ``pid``, or None if it is gone."""
    try:
        rss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                   if line.startswith("VmRSS"))
        return [len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task")), rss]
    except (OSError, StopIteration):
        return None


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        if int(text[text.rindex(")") + 2:].split()[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=100)
    ap.add_argument("--every", type=int, default=10, help="sample every N jobs")
    ap.add_argument("--app", default=str(ROOT / "tests" / "apps" / "gated.py"), help="a job that ends by itself")
    ap.add_argument("--placement", default="single")
    ap.add_argument("--hosts", action="store_true", help="the jobs' groups run on the daemon's own workers")
    ap.add_argument("--daemon-args", default="", help="more `reactor daemon` options")
    ap.add_argument("--dir", default=None, help="where (default: a new temporary directory)")
    ap.add_argument("--keep", action="store_true", help="leave the directory (the daemon is stopped all the same)")
    a = ap.parse_args()
    tmp = Path(a.dir or tempfile.mkdtemp(prefix="reactor-soak-"))
    tmp.mkdir(parents=True, exist_ok=True)
    dk, ck = tmp / "dk", tmp / "ck"
    if not (dk / "key").exists():
        init_keys(dk)
        init_keys(ck)
        (dk / "authorized" / "client.pub").write_bytes((ck / "key.pub").read_bytes())
        (dk / "authorized" / "self.pub").write_bytes((dk / "key.pub").read_bytes())  # (its jobs over hosts)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "REACTOR_RUNTIME_DIR": str(tmp / "rt")}
    with open(tmp / "daemon.err", "ab") as err:
        daemon = subprocess.Popen([sys.executable, "-m", "reactor.cli", "daemon", "--listen", "tcp://127.0.0.1:*",
                                   "--name", "soak", "--state-dir", str(tmp / "state"), "--keys", str(dk),
                                   *shlex.split(a.daemon_args)], cwd=ROOT, stdout=subprocess.PIPE, stderr=err, env=env)
    try:
        assert daemon.stdout is not None
        address = json.loads(daemon.stdout.readline())["address"]
        hosts = None
        if a.hosts:
            hosts = tmp / "hosts.toml"
            hosts.write_text(f'[hosts]\nsoak = "{address}"\n')
        with DaemonClient(address, CurveKeys.load_public(dk / "key.pub"), load_keys(ck), timeout_s=30) as c:
            while c.request("ping")["fork_server"] == "starting":
                time.sleep(0.5)
            t0 = time.monotonic()
            for i in range(a.jobs + 1):
                if i % a.every == 0 or i == a.jobs:
                    t = time.monotonic()
                    jobs = c.request("status", None)
                    status_s = time.monotonic() - t
                    print(json.dumps({"jobs_done": i, "daemon": proc_info(daemon.pid),
                                      "fork_server": [proc_info(p) for p in children(daemon.pid)],
                                      "listed": len(jobs), "hosted": len(c.request("hosted")),
                                      "status_s": round(status_s, 3), "state_bytes": tree_bytes(tmp / "state"),
                                      "log_bytes": (tmp / "state" / "daemon.log").stat().st_size,
                                      "t_s": round(time.monotonic() - t0, 1)}), flush=True)
                if i == a.jobs:
                    break
                job = c.request("submit", job_spec(a.app, placement=a.placement, hosts=hosts))
                while (got := c.request("status", job))["state"] == "running":
                    time.sleep(0.05)
                if got["state"] != "finished":
                    print(f"job {job}: {got['state']} {got['returncode']}: {got['last_line']}", flush=True)
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=90)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
