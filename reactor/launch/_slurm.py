"""Slurm starts the daemons, reactor places the reactors: ``reactor slurm``.

``reactor slurm APP --nodes N [--tasks-per-node K] [--partition P] [--time T] [run options]`` writes
``JOB_DIR/job.sbatch`` and submits it with ``sbatch --parsable``; it prints Slurm's job id. The job
directory (``--out``, default ``./reactor-slurm/APP-TIME``) must be on a file system every node sees
(a cluster's shared home): the batch step, the daemons and the user read it.

Inside the allocation the batch script runs ``reactor slurm --here APP ...`` on the first node
(users already in an allocation, from ``salloc``, run that themselves):

1. It makes a CURVE key pair for the job in ``JOB_DIR/keys`` (a cluster key: it admits itself), so
   every link of the job is authenticated with a key made for it and gone with it.
2. It starts one step, ``srun --overlap --ntasks-per-node=K python -m reactor.launch._slurm
   daemon-task JOB_DIR K``: one daemon per task (K per node), named after its node (``NODE`` or
   ``NODE-LOCALID``), its state in ``JOB_DIR/daemons/NAME/``, listening on the address its node
   reaches the batch node from (``SLURM_LAUNCH_NODE_IPADDR``).
3. It waits for every daemon's ``daemon.json`` (its address), writes ``JOB_DIR/hosts.toml`` (the
   first node's daemons first: the learner's host), and runs ``reactor run APP --hosts
   JOB_DIR/hosts.toml`` with the run options given: the coordinator in this process, the groups
   spread over the daemons by the distribution policy (``--placement``, default ``actors``). The
   run's files come back to the directory the job was submitted from (the batch step's).
4. When the run ends, on every path, it sends SIGTERM to the daemons' step (srun passes it on; each
   daemon ends what it hosts) and waits for it; the job's exit status is the run's.

``scancel`` sends SIGTERM to every process of both steps at once: the coordinator, the daemons and
their workers. The coordinator stops the run cleanly; a worker the same SIGTERM ended is no failure of
the run (``_session``: it ended as asked, its shutdown reactions cut short); and the daemons, started
with ``--stop-after-runs`` (``KillWait`` less ``DAEMON_END_S``), let the coordinator end the run through
them and copy its files back before they end what is left, remove its shared memory and stop (they ended
their workers and stopped at once, and the run failed with its hosts lost, its files left in
``JOB_DIR/daemons/NAME/runs/RUN/``). The run ends stopped by the signal (exit 143), as Slurm's
CANCELLED says. After ``KillWait`` Slurm kills whatever is left of both steps (its process
tracking covers the daemons' fork servers and workers: their descendants). Nothing of the job outlives
it on any node. ``scancel --batch --signal=TERM`` reaches the coordinator alone: every worker's shutdown
reactions run too (a last checkpoint, the summary).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from .._errors import GraphError, ReactorError

DAEMONS_TIMEOUT_S = 120.0  # every daemon of the job up (their nodes may be slow to start Python)
STOP_TIMEOUT_S = 30.0

__all__ = ["SlurmError", "daemon_task", "here", "kill_wait_s", "node_names", "sbatch_script", "submit"]


class SlurmError(ReactorError):
    """Slurm refused the job, or its daemons did not come up."""


# A node's name as a hosts file takes it (_cluster's host names): each daemon is named after its node.
_NODE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,62}")


def node_names(nodelist: str | None = None) -> list[str]:
    """The allocation's nodes, in Slurm's order (``scontrol show hostnames`` of the node list:
    ``nodelist``, else the allocation's ``SLURM_JOB_NODELIST``).

    scontrol exits 0 on a node list it cannot expand (``node[1-3,x]``, ``node[3-1]``, ``node[]``): it
    says "Invalid hostlist" on stderr and prints no name, so its stderr and its names are checked, not
    its exit status alone (a line without "invalid", "error" or "fatal", a site's warning, is no refusal).

    Raises:
        SlurmError: not inside an allocation; scontrol said it was invalid or an error on stderr, failed or gave no name;
            it gave a name no host has (``node[1-3`` gives ``node]``) or one name twice; or, for the
            allocation's list, another count of nodes than ``SLURM_JOB_NUM_NODES``. Each names the list.
    """
    from_env = not nodelist
    where = "node list"
    if from_env:
        where = "SLURM_JOB_NODELIST" if os.environ.get("SLURM_JOB_NODELIST") else "SLURM_NODELIST"
    nodelist = nodelist or os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        raise SlurmError("not inside a Slurm allocation (no SLURM_JOB_NODELIST): use `reactor slurm APP` to submit "
                         "a job, or run --here from sbatch or salloc")
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    except FileNotFoundError as e:
        raise SlurmError(f"{where} {nodelist!r:.200}: scontrol, which expands it, is not on PATH") from e
    names = out.stdout.split()
    said = "; ".join(line.strip() for line in out.stderr.splitlines() if line.strip())
    if out.returncode != 0 or any(w in said.lower() for w in ("invalid", "error", "fatal")) or not names:
        raise SlurmError(f"{where} {nodelist!r:.200}: scontrol show hostnames cannot expand it "
                         f"({said[:300] or f'exit status {out.returncode}, no node named'})")
    if bad := next((n for n in names if not _NODE_RE.fullmatch(n)), None):
        raise SlurmError(f"{where} {nodelist!r:.200}: scontrol expanded it to {bad!r:.80}, not a node's name "
                         f"(letters, digits, '_', '.' and '-'): is a bracket unclosed?")
    if twice := next((n for i, n in enumerate(names) if n in names[:i]), None):
        raise SlurmError(f"{where} {nodelist!r:.200}: names node {twice} twice")
    count = os.environ.get("SLURM_JOB_NUM_NODES") if from_env else None
    if count is not None and count.strip() != str(len(names)):
        raise SlurmError(f"{where} {nodelist!r:.200} names {len(names)} nodes, but SLURM_JOB_NUM_NODES is "
                         f"{count!r:.40}")
    return names


def daemon_name(node: str, local_id: int, tasks_per_node: int) -> str:
    return node if tasks_per_node == 1 else f"{node}-{local_id}"


# What sbatch reads in an #SBATCH line as more than the value's characters (Slurm 22.05, src/sbatch/opt.c,
# get_argument): it splits the line into arguments at unquoted whitespace, takes the rest of the line after an
# unquoted, unescaped '#' as a comment, strips the single or double quotes around a part of an argument, and a
# backslash escapes the next character (inside quotes too), but not whitespace: the split comes first.
_SBATCH_SPECIAL = "#'\"\\"


def _sbatch_quote(arg: str) -> str:
    """``arg`` as one argument of an #SBATCH line that sbatch reads back as exactly ``arg``.

    An argument with no whitespace and none of :data:`_SBATCH_SPECIAL` is written as it is (so a script
    of such values renders as it always did). Any other is double-quoted, its backslashes and double
    quotes escaped with a backslash: inside double quotes sbatch keeps whitespace, '#' and single quotes
    and drops the backslash before the character it escapes. A backslash cannot escape whitespace instead
    (sbatch ends the argument at the whitespace before it reads the backslash). Only the value of an
    ``--option=value`` is quoted, so the line still reads as the option it is. (Python's whitespace,
    wider than sbatch's ASCII ``isspace``, is quoted too: harmless, and no locale's reading matters.)
    """
    def special(text: str) -> bool:
        return any(c.isspace() or c in _SBATCH_SPECIAL for c in text)

    if not special(arg):
        return arg
    name, eq, value = arg.partition("=")
    if not eq or special(name):
        name, eq, value = "", "", arg
    return name + eq + '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _refuse_in_script(label: str, value: str, *, output: bool = False) -> None:
    """Refuse a value that would change what the batch script says, or where the job's output goes.

    No control character anywhere (the script's values are the user's: a newline in an #SBATCH line
    starts a shell command of the script, and sbatch reads no directive after a command; quoting cannot
    help, sbatch ends an argument at a newline even inside quotes). In the job's output path
    (``output``), no '%': sbatch expands it (``%j``, ``%N``, ...) in ``--output``; and no backslash: Slurm
    reads one there as an escape (slurmstepd drops it, then expands no '%'), so the output went to
    another file than the one named. Whitespace, '#', quotes and other backslashes are carried, quoted
    (:func:`_sbatch_quote`).

    Raises:
        ValueError: one line naming ``label``, the value and the character.
    """
    for c in value:
        if ord(c) < 0x20 or 0x7f <= ord(c) < 0xa0:
            why = "is a control character, which cannot go into the batch script (a newline starts a shell command)"
        elif output and c == "%":
            why = "cannot go into the job's output path (sbatch expands '%' there: %j is the job id)"
        elif output and c == "\\":
            why = ("cannot go into the job's output path (Slurm drops a backslash there and then expands no '%': "
                   "the output went to another file)")
        else:
            continue
        raise ValueError(f"{label} {value!r:.120}: {c!r} {why}")


def sbatch_script(app: str, run_args: Sequence[str], job_dir: Path, *, nodes: int, tasks_per_node: int,
                  partition: str | None = None, time_limit: str | None = None,
                  sbatch_args: Sequence[str] = ()) -> str:
    """The batch script of a job: Slurm's directives, then ``reactor slurm --here`` on the first node.

    The values go into the script as they are: the ``exec`` line quotes them for the shell, and each
    #SBATCH line's value is quoted the way sbatch reads it (:func:`_sbatch_quote`), where it needs to be:
    a job directory with a space, ``--sbatch-arg='--comment=my experiment #3'``. What quoting cannot
    carry is refused (:func:`_refuse_in_script`).

    Raises:
        ValueError: a control character in any value (the app's path, the job directory, the directory
            submitted from, a run option); '%' or a backslash in ``--out``; an ``--sbatch-arg`` that is
            not an option, or whose option's name (before its '=') holds whitespace: two arguments in
            one. Each names the option and the character. (The app's file name names the job, any
            character but letters, digits, '_', '.' and '-' as '_'.)
    """
    _refuse_in_script("app file", app)
    _refuse_in_script("--out", str(job_dir), output=True)
    _refuse_in_script("the directory submitted from", os.getcwd())
    for option, value in (("--partition", partition), ("--time", time_limit)):
        _refuse_in_script(option, value or "")
    for a in sbatch_args:
        _refuse_in_script("--sbatch-arg", a)
        if not a.startswith("-"):
            raise ValueError(f"--sbatch-arg {a!r:.120}: not an sbatch option (one option each: --sbatch-arg=--mem=8G)")
        if a.startswith("--") and (c := next((c for c in a.partition("=")[0] if c.isspace()), None)):
            raise ValueError(f"--sbatch-arg {a!r:.120}: {c!r} in the option's name: give one option each, its value "
                             f"after '=', as --sbatch-arg=--mem=8G")
    for i, a in enumerate(run_args):
        _refuse_in_script(run_args[i - 1] if i and run_args[i - 1].startswith("-") else "run option", a)
    job_name = "reactor-" + re.sub(r"[^A-Za-z0-9_.\-]", "_", Path(app).stem)[:100]  # (a label: any other character '_')
    directives = [f"--job-name={job_name}", f"--nodes={nodes}", f"--ntasks-per-node={tasks_per_node}",
                  f"--output={job_dir}/slurm-%j.out"]
    if partition:
        directives.append(f"--partition={partition}")
    if time_limit:
        directives.append(f"--time={time_limit}")
    lines = ["#!/bin/bash", *(f"#SBATCH {_sbatch_quote(d)}" for d in [*directives, *sbatch_args])]
    cmd = [sys.executable, "-m", "reactor.cli", "slurm", "--here", app, "--out", str(job_dir),
           "--tasks-per-node", str(tasks_per_node), *run_args]
    lines += [f"cd {shlex.quote(os.getcwd())}", "exec " + " ".join(shlex.quote(c) for c in cmd), ""]
    return "\n".join(lines)


def submit(app: str, run_args: Sequence[str], job_dir: Path, **kw: object) -> str:
    """Write ``job.sbatch`` in ``job_dir`` and submit it; Slurm's job id.

    Raises:
        ValueError: a value the batch script cannot hold (:func:`sbatch_script`), before anything is written.
        SlurmError: sbatch is not on PATH, or refused the job.
    """
    if not Path(app).is_file():
        raise FileNotFoundError(f"no app file {app}")
    text = sbatch_script(str(Path(app).resolve()), run_args, job_dir, **kw)  # type: ignore[arg-type]
    job_dir.mkdir(parents=True, exist_ok=True)  # (after the script's values were checked: nothing made for a refusal)
    script = job_dir / "job.sbatch"
    script.write_text(text)
    try:
        out = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=60)
    except FileNotFoundError as e:
        raise SlurmError("sbatch is not on PATH: is this a Slurm cluster's login node?") from e
    if out.returncode != 0:
        raise SlurmError(f"sbatch refused the job: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout.strip().split(";")[0]


def _advertise() -> str:
    """The address this node reaches the batch node at (where the coordinator runs).

    Raises:
        SlurmError: ``SLURM_LAUNCH_NODE_IPADDR`` is not an IP address (Slurm sets it to the address of
            the node srun ran on), or this node has no route to it; without it, this node's own name
            does not resolve.
    """
    from ._cluster import address_towards

    launcher = os.environ.get("SLURM_LAUNCH_NODE_IPADDR")
    if launcher:
        try:
            ip = ipaddress.ip_address(launcher)
        except ValueError:
            raise SlurmError(f"SLURM_LAUNCH_NODE_IPADDR {launcher!r:.80}: not an IP address (Slurm sets it to the "
                             f"address of the node srun ran on)") from None
        try:  # (a name, which address_towards would resolve and blame a hosts file for, is refused above)
            return address_towards(f"tcp://[{ip}]:9" if ip.version == 6 else f"tcp://{ip}:9")
        except (GraphError, OSError) as e:
            raise SlurmError(f"SLURM_LAUNCH_NODE_IPADDR {launcher}: this node has no route to it "
                             f"({getattr(e, 'strerror', None) or e})") from None
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError as e:
        raise SlurmError(f"this node's name {socket.gethostname()!r} does not resolve ({e.strerror}) and "
                         f"SLURM_LAUNCH_NODE_IPADDR is not set") from None


def kill_wait_s() -> float:
    """Slurm's ``KillWait``: how long after a cancellation's SIGTERM its SIGKILL comes (``scontrol show config``;
    Slurm's default, 30 s, where it cannot be read)."""
    try:
        out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 30.0
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "KillWait" and value.split() and value.split()[0].isdigit():
            return float(value.split()[0])
    return 30.0


#: Of KillWait, what a daemon keeps for itself after its wait for the run's coordinator (``--stop-after-runs``):
#: its end of what is left (SIGTERM, SIGKILL after END_GRACE_S) and removing the run's shared memory.
DAEMON_END_S = 8.0


def daemon_task(job_dir: Path, tasks_per_node: int, stop_after_s: float = 0.0) -> None:
    """One srun task: become this task's daemon (exec; never returns). On a cancellation's SIGTERM (which
    reaches the coordinator with it) it gives the coordinator ``stop_after_s`` to end the run through it.

    Raises:
        SlurmError: ``SLURM_LOCALID`` is not this node's task index, or ``SLURM_LAUNCH_NODE_IPADDR`` is
            not an address this node reaches (:func:`_advertise`); each names the variable.
    """
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    local_id = os.environ.get("SLURM_LOCALID", "0")
    if not (local_id.isascii() and local_id.isdigit() and int(local_id) < tasks_per_node):
        raise SlurmError(f"SLURM_LOCALID {local_id!r:.40}: not the index of a task on this node (0 to "
                         f"{tasks_per_node - 1} for {tasks_per_node} per node; Slurm sets it for each task)")
    name = daemon_name(node, int(local_id), tasks_per_node)
    address = _advertise()
    os.execv(sys.executable, [sys.executable, "-m", "reactor.cli", "daemon", "--listen", f"tcp://{address}:*",
                              "--name", name, "--state-dir", str(job_dir / "daemons" / name),
                              "--keys", str(job_dir / "keys"), "--stop-after-runs", f"{stop_after_s:g}"])


def _wait_daemons(job_dir: Path, names: list[str], step: subprocess.Popen[bytes]) -> dict[str, str]:
    deadline = time.monotonic() + DAEMONS_TIMEOUT_S
    addresses: dict[str, str] = {}
    while len(addresses) < len(names):
        for n in names:
            f = job_dir / "daemons" / n / "daemon.json"
            if n not in addresses and f.exists():
                with contextlib.suppress(ValueError, OSError, KeyError):
                    addresses[n] = json.loads(f.read_text())["address"]
        if len(addresses) == len(names):
            break
        if step.poll() is not None:
            raise SlurmError(f"the daemons' step ended (exit status {step.returncode}) before every daemon was up; "
                             f"see {job_dir / 'daemons.log'}")
        if time.monotonic() > deadline:
            missing = sorted(set(names) - set(addresses))
            raise SlurmError(f"daemons {missing} did not come up within {DAEMONS_TIMEOUT_S:.0f} s; "
                             f"see {job_dir / 'daemons.log'}")
        time.sleep(0.2)
    return addresses


def here(app: str, run_args: Sequence[str], job_dir: Path, tasks_per_node: int,
         run_app: Callable[[list[str]], int]) -> int:
    """Inside an allocation: start the daemons, run the app over them (``run_app``: the command
    line's ``reactor run``, given its arguments), stop them; the run's exit status."""
    from ._keys import init_keys

    nodes = node_names()
    job_dir = job_dir.resolve()
    job_dir.mkdir(parents=True, exist_ok=True)
    keys = job_dir / "keys"
    if not (keys / "key").exists():
        init_keys(keys)
    names = [daemon_name(n, i, tasks_per_node) for n in nodes for i in range(tasks_per_node)]
    with open(job_dir / "daemons.log", "ab") as log:
        step = subprocess.Popen(
            ["srun", "--overlap", f"--nodes={len(nodes)}", f"--ntasks={len(names)}",
             f"--ntasks-per-node={tasks_per_node}", "--kill-on-bad-exit=0", "--job-name=reactor-daemons",
             sys.executable, "-m", "reactor.launch._slurm", "daemon-task", str(job_dir), str(tasks_per_node),
             f"{max(0.0, kill_wait_s() - DAEMON_END_S):g}"],
            stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    stop = {"signal": 0}

    def on_signal(sig: int, _frame: object) -> None:  # scancel before the run began
        stop["signal"] = sig
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_signal)
    try:
        addresses = _wait_daemons(job_dir, names, step)
        hosts = job_dir / "hosts.toml"
        hosts.write_text("[hosts]\n" + "".join(f'"{n}" = "{addresses[n]}"\n' for n in names))
        print(f"reactor slurm: {len(names)} daemons on {len(nodes)} nodes ({', '.join(names)}); hosts in {hosts}",
              file=sys.stderr, flush=True)
        signal.signal(signal.SIGTERM, old)  # the run owns SIGTERM from here: a clean stop
        os.environ["REACTOR_KEYS"] = str(keys)
        # The run's files come back to this directory: where the user submitted from.
        return run_app(["run", app, "--hosts", str(hosts), *run_args])
    except KeyboardInterrupt:
        return 128 + (stop["signal"] or signal.SIGINT)
    finally:
        signal.signal(signal.SIGTERM, old)
        if step.poll() is None:
            step.send_signal(signal.SIGTERM)
            try:
                step.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                step.kill()
                step.wait()


if __name__ == "__main__":
    if len(sys.argv) in (4, 5) and sys.argv[1] == "daemon-task":
        try:
            daemon_task(Path(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]) if len(sys.argv) == 5 else 0.0)
        except SlurmError as e:  # (one line in daemons.log, which the batch step's error names)
            sys.exit(f"reactor slurm daemon-task: {e}")
    sys.exit("usage: python -m reactor.launch._slurm daemon-task JOB_DIR TASKS_PER_NODE [STOP_AFTER_S]")
