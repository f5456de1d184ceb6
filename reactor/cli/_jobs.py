"""Jobs on daemons: ``keys``, ``daemon``, ``submit``, ``status``, ``logs`` and ``stop`` (the daemon found
in a placement or hosts file, a job checked before it leaves, the lines ``status`` prints)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from .._reactor import show_value
from ..launch._app import build_graph, compile_app, parse_overrides
from ..launch._jobrecord import PID_MAX, RC_RANGE
from ._appcode import _app_code, _bounded
from ._cluster import _check_config_here
from ._run import _check_run_options

#: How long the commands that ask a daemon (submit, status, logs, stop) wait on an address whose every TCP
#: connect fails at once (refused) before they say nothing listens there (the whole --timeout-s was waited
#: out); a daemon started just before them binds within it (its imports take ~1 s on a 2-core machine).
REFUSED_AFTER_S = 2.0


def _jobs(args: argparse.Namespace) -> int:
    """keys, daemon, submit, status, logs, stop."""
    from ..launch._daemon import Daemon, DaemonClient, DaemonError, job_spec
    from ..launch._keys import default_keys_dir, init_keys, load_keys

    keys_dir = getattr(args, "keys", None) or default_keys_dir()
    if args.command == "keys":
        directory = args.dir or default_keys_dir()
        keys = init_keys(directory)
        print(f"made {directory}/key and key.pub ({keys.public.decode()}); add clients' key.pub files to "
              f"{directory}/authorized/")
        return 0
    if args.command == "daemon":
        from ..launch._runtime import asyncio_run

        state = Path(args.state_dir)
        if state.exists() and not state.is_dir():
            raise NotADirectoryError(f"--state-dir {state} is a file, not a directory")
        made = not state.exists()
        state.mkdir(parents=True, exist_ok=True)
        import logging.handlers

        # Watched: a log rotated under it (logrotate moves it away) is opened again at its path, not written
        # on in the moved file, nor (once that is deleted) in a file no one sees that still takes the disk.
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                            handlers=[logging.handlers.WatchedFileHandler(state / "daemon.log"),
                                      logging.StreamHandler()])
        from ..launch._forkserver import TRAINING_PRELOAD

        if args.die_with_parent:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
            if os.getppid() == 1:
                return 1
        extra = [m.strip() for m in args.preload.split(",") if m.strip()]
        served = False
        try:
            daemon = Daemon(args.listen, args.name, state, keys_dir, advertise=args.advertise,
                            preload=None if args.no_fork_server else [*TRAINING_PRELOAD, *extra],
                            **({} if args.keep_ended is None else {"keep_ended": args.keep_ended}),
                            **({} if args.forget_after_s is None else {"forget_after_s": args.forget_after_s}),
                            remove_forgotten=args.remove_forgotten, stop_after_runs_s=args.stop_after_runs_s,
                            **({} if args.worker_memory_mb is None else {"worker_memory": args.worker_memory_mb << 20}))

            def ready(address: str) -> None:
                nonlocal served
                served = True
                if not args.die_with_parent and (why := _volatile_state(state)):  # (a supervised one's goes with it)
                    logging.getLogger("reactor.daemon").warning(
                        "--state-dir %s is %s: the records, logs and files of the jobs kept there will not survive a "
                        "reboot (give a directory on a disk: /var/lib/reactor, say)", state, why)
                print(json.dumps({"address": address, "advertised": daemon.reach, "name": args.name,
                                  "public_key": daemon.keys.public.decode()}), flush=True)

            asyncio_run(daemon.serve(ready))
        except BaseException:
            if made and not served:  # (a port in use, say: no state directory of a daemon that never served)
                _remove_unserved_state(state)
            raise
        return 0
    if args.command == "submit":
        _check_job(args)  # (before keys and the daemon: the job's own mistakes first)
    address, daemon_key = _daemon_of(args, load_keys(keys_dir).public)
    try:
        with DaemonClient(address, daemon_key, load_keys(keys_dir), timeout_s=args.timeout_s,
                          refused_after_s=REFUSED_AFTER_S) as c:
            if args.command == "submit":
                spec = job_spec(args.app, placement=args.placement, config=parse_overrides(args.overrides),
                                seed=args.seed, async_=args.async_, files=args.files, hosts=args.hosts,
                                restart=args.restart)
                job = _asked(c, "submit", spec)
                print(job)
                if not args.daemon:
                    print(f"on {address}: reactor status {job} --daemon {address}{_key_hint(args, daemon_key, keys_dir)}",
                          file=sys.stderr)
            elif args.command == "status":
                got = _asked(c, "status", args.job)
                rows = got if isinstance(got, list) else [got]
                hosted = _asked(c, "hosted") if args.job is None else []
                if args.json:  # (stable: every job, and every worker hosted here; what the lines below sum up)
                    # (their known fields alone: a field of another daemon's, bytes or NaN, was no JSON)
                    print(json.dumps(_known_job(got) if args.job is not None else
                                     {"jobs": [_known_job(j) for j in rows],
                                      "hosted": [_known(w, _HOSTED, _HOSTED_OPTIONAL) for w in hosted]},
                                     indent=2, allow_nan=False))
                elif args.job is not None:
                    _say(_job_line(got))
                    if got.get("detail"):  # (why it ended as it did, where the daemon knows: a full disk, an
                        _say(f"  {got['detail']}")  # exit status it cannot know)
                    here = {w["group"]: w for w in _asked(c, "hosted") if w["run"] == got.get("run")}
                    for g, where in sorted((got.get("groups") or {}).items()):
                        _say(f"  {_where(g, where)}" + (f"  {_worker_line(here[g])}" if g in here else ""))
                    for w in got.get("workers") or []:  # (a running job on this host alone)
                        _say(f"  {w['group']}  {w['state']}  pid {w['pid']}  restarts {w['restarts']}")
                    if got.get("groups"):
                        _say(f"  (run {got['run']}; reactor logs {got['id']} GROUP)")
                else:
                    if not rows:  # (it answered: say so, not nothing)
                        print(f"no jobs on the daemon at {address}" + ("; runs it hosts workers of:" if hosted
                                                                        else "; it hosts no workers of runs elsewhere"))
                    for j in rows:
                        _say(_job_line(j))
                    jobs_of = {j["run"]: j["id"] for j in rows if j.get("run")}
                    for run, workers in _by_run(hosted).items():
                        _say(_run_line(run, workers, jobs_of.get(run)))
            elif args.command == "logs" and args.group is None:
                _print_log(lambda offset: _asked(c, "logs", args.job, offset), args.follow, c.who, "logs")
            elif args.command == "logs":
                job = _asked(c, "status", args.job)
                groups = job.get("groups") or {}
                if args.group not in groups:
                    raise DaemonError(f"job {args.job} has no group {args.group!r} on a host of its own (it has "
                                      f"{', '.join(sorted(groups)) or _no_groups(job)}); reactor logs {args.job} shows "
                                      f"the job's log")
                where = groups[args.group]
                keys = load_keys(keys_dir)
                host_key = where["key"].encode() if where["key"] else keys.public  # none: the cluster key
                with DaemonClient(where["address"], host_key, keys, timeout_s=args.timeout_s,
                                  refused_after_s=REFUSED_AFTER_S) as w:
                    _print_log(lambda offset: _asked(w, "worker_log", job["run"], args.group, offset), args.follow,
                               w.who, "worker_log")
            else:
                j = _asked(c, "stop", args.job)
                if j["state"] == "running":  # (asked to stop: its run stops its workers cleanly, then ends)
                    from ..launch._daemon import STOP_GRACE_S

                    print(f"{j['id']}  stopping (asked to stop cleanly; at once if it has not ended {STOP_GRACE_S:g} s "
                          f"after the first request)")
                else:
                    _say(f"{j['id']}  {_job_state(j)}")
    except DaemonError as e:  # (a refusal's text is the daemon's: its escapes reached the terminal, 50 MB of it whole)
        print(f"reactor: {_shown(str(e), lines=True)}", file=sys.stderr)
        return 1
    return 0


def _asked(client: Any, kind: str, *fields: Any) -> Any:
    """``client.request(kind, *fields)``, its answer checked before anything of it is printed: a reply is
    a peer's message, and one of another shape (a daemon of another version, or not reactor's) ended the
    command in a traceback (``TypeError`` of a ``returncode`` that was no number) or printed nonsense.

    Raises:
        DaemonError: the answer does not have its kind's shape and types (:func:`_reply_problem`), naming
            the field; or the daemon's refusal, as ``request`` raises it.
    """
    from ..launch._daemon import DaemonError

    got = client.request(kind, *fields)
    if (why := _reply_problem(kind, got, fields[0] if kind == "status" else "")) is not None:
        raise DaemonError(f"{client.who} sent a malformed answer to {kind!r}: {why} (a daemon of another reactor "
                          f"version?)")
    return got


def _fields_problem(what: str, d: Any, fields: dict[str, tuple[type, ...]],
                    optional: dict[str, tuple[type, ...]]) -> str | None:
    """What is wrong with ``d``, a dict that must hold ``fields`` (and may hold ``optional``) of those types,
    numbers finite (:func:`~reactor.launch._jobrecord.fields_problem`, as a job record is checked); None if
    nothing."""
    from ..launch._jobrecord import fields_problem

    if type(d) is not dict:
        return f"{what} is {type(d).__name__}, not a dict"
    return fields_problem(d, fields, optional, what)


#: Control characters (C0, DEL, C1) in text a daemon sent, escaped before it reaches a terminal: a job's
#: last line or a refusal holding ``ESC ]0;...BEL ESC [2J`` set the terminal's title and cleared it.
_ESCAPED = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
_ESCAPED_BUT_LINES = {c: e for c, e in _ESCAPED.items() if chr(c) not in "\n\t"}


def _shown(text: str, lines: bool = False) -> str:
    """Text a daemon sent, as it may reach a terminal: cut to ~2,000 characters (:func:`_bounded`: a
    refusal of 50 MB was printed whole) and its control characters escaped as ``\\x1b``; ``lines``: but
    newlines and tabs (an error's text of several lines), which a line of ``status`` escapes too.
    (Not a log's data: ``reactor logs`` writes the job's own bytes as they are, as its terminal would.)"""
    return _bounded(text).translate(_ESCAPED_BUT_LINES if lines else _ESCAPED)


def _say(line: str) -> None:
    """Print one line made of what a daemon answered (:func:`_shown`)."""
    print(_shown(line))


_NUMBER = (int, float)
_JOB = {"id": (str,), "app": (str,), "placement": (str,), "state": (str,), "pid": (int,), "uptime_s": _NUMBER,
        "returncode": (int, type(None)), "daemon": (str,), "last_line": (str,)}
#: (a daemon of an earlier version says none of stopped_by, over_hosts; only a job over hosts has run and groups)
_JOB_OPTIONAL = {"detail": (str,), "stopped_by": (str, type(None)), "over_hosts": (bool, type(None)),
                 "run": (str, type(None)), "groups": (dict,), "workers": (list,)}
_GROUP = {"host": (str,), "address": (str,), "key": (str, type(None))}
_GROUP_OPTIONAL = {"waiting": (str, type(None))}
_LOCAL_WORKER = {"group": (str,), "state": (str,), "pid": (int,), "restarts": (int,)}
_HOSTED = {"run": (str,), "group": (str,), "state": (str,), "pid": (int,), "uptime_s": _NUMBER,
           "returncode": (int, type(None)), "daemon": (str,)}
_HOSTED_OPTIONAL = {"restarts": (int,)}
_LOG = {"data": (bytes,), "offset": (int,), "done": (bool,)}
#: The ranges of the numbers a daemon's answers hold, as its own records hold them (``_jobrecord``: a pid
#: in (0, 2**31), an exit status in (-256, 256)): a pid of 2**64 - 1 was printed as it came.
_RANGES = {"pid": (1, PID_MAX), "returncode": RC_RANGE, "restarts": (0, PID_MAX)}


def _range_problem(what: str, d: dict[str, Any]) -> str | None:
    """What number of ``d`` (its fields' types checked) is out of :data:`_RANGES`, or None."""
    for name, (low, high) in _RANGES.items():
        if type(v := d.get(name)) is int and not low <= v <= high:
            return f"{what}'s {name} is {v}, out of its range ({low} to {high})"
    return None


def _job_problem(what: str, j: Any) -> str | None:
    """What is wrong with a job as ``status`` and ``stop`` answer it (``Daemon.describe``), or None: its
    fields' types and ranges; and where its groups run, as ``reactor logs JOB GROUP`` connects there and
    asks for its run's log (a group's address ``bogus://x``, or a key ``"short"``, ended that command in a
    ``ZMQError`` traceback, and groups without a run in a ``KeyError``)."""
    from ..launch._cluster import Z85_KEY_RE
    from ..launch._protocol import _JOB_RE, tcp_address_error

    if (why := _fields_problem(what, j, _JOB, _JOB_OPTIONAL) or _range_problem(what, j)) is not None:
        return why
    if not _JOB_RE.match(j["id"]):
        return f"{what}'s id is {show_value(j['id'])}, not a job id (16 hex digits)"
    if j.get("stopped_by") not in (None, "request", "daemon"):
        return f"{what}'s stopped_by is {j['stopped_by'][:40]!r}, not 'request', 'daemon' or None"
    if j.get("groups") and type(j.get("run")) is not str:
        return f"{what} has groups but no run (what their logs are asked for by)"
    for g, where in (j.get("groups") or {}).items():
        whose = f"{what}'s group {g!r:.40}"
        if type(g) is not str or (why := _fields_problem(whose, where, _GROUP, _GROUP_OPTIONAL)) is not None:
            return why or f"{what} has a group named by a {type(g).__name__}"
        if (why := tcp_address_error(where["address"])) is not None:
            return f"{whose} has a bad address ({why})"
        if where["key"] is not None and not Z85_KEY_RE.match(where["key"]):
            return f"{whose} has a bad key ({show_value(where['key'])}, not a CURVE public key: 40 characters of Z85)"
    for i, w in enumerate(j.get("workers") or []):
        if (why := _fields_problem(f"{what}'s worker {i}", w, _LOCAL_WORKER, {})
                or _range_problem(f"{what}'s worker {i}", w)) is not None:
            return why
    return None


def _known(d: dict[str, Any], *tables: dict[str, tuple[type, ...]]) -> dict[str, Any]:
    """``d`` (checked) with only the fields ``tables`` name: what ``status --json`` prints of it."""
    return {k: v for k, v in d.items() if any(k in t for t in tables)}


def _known_job(j: dict[str, Any]) -> dict[str, Any]:
    """A job (checked: :func:`_job_problem`) as ``status --json`` prints it: its known fields, and its
    groups' and workers'. A field of a daemon's own (of another version, or not reactor's) was printed
    as it came: bytes or a msgpack ext type ended the command in a ``TypeError`` traceback, a NaN was
    printed as ``NaN``, which is no JSON."""
    out = _known(j, _JOB, _JOB_OPTIONAL)
    if "groups" in out:
        out["groups"] = {g: _known(w, _GROUP, _GROUP_OPTIONAL) for g, w in out["groups"].items()}
    if "workers" in out:
        out["workers"] = [_known(w, _LOCAL_WORKER) for w in out["workers"]]
    return out


def _reply_problem(kind: str, got: Any, job: Any = None) -> str | None:
    """What is wrong with a daemon's answer ``got`` to a request of ``kind`` that this command prints (one
    schema per kind: ``status`` of one job, or of all when ``job`` is None, a list; ``stop``; ``hosted``,
    a list of workers; ``logs`` and ``worker_log``, a chunk), or None."""
    if kind in ("status", "hosted") and (kind == "hosted" or job is None):
        if type(got) is not list:
            return f"it is {type(got).__name__}, not a list"
        for i, item in enumerate(got):
            why = (_job_problem(f"job {i}", item) if kind == "status"
                   else _fields_problem(f"worker {i}", item, _HOSTED, _HOSTED_OPTIONAL)
                   or _range_problem(f"worker {i}", item))
            if why is not None:
                return why
        return None
    if kind in ("status", "stop"):
        return _job_problem("the job", got)
    if kind in ("logs", "worker_log"):
        return _fields_problem("the chunk", got, _LOG, {})
    if kind == "submit":  # (printed, and hinted at as `reactor status JOB`: whatever came, 100 MB of it, exit 0)
        from ..launch._protocol import _JOB_RE

        if type(got) is not str or not _JOB_RE.match(got):
            return f"it is {show_value(got)}, not a job id (16 hex digits)"
    return None


def _no_groups(job: dict[str, Any]) -> str:
    """Why a job has no group on a host of its own, for ``reactor logs JOB GROUP``: it runs on one host, or
    it runs over hosts and none of its workers started (yet, or ever: its run failed before)."""
    if not job.get("over_hosts"):  # (False; None: a daemon that does not say, or a record from before it did)
        return ("none: it runs on one host, and its groups write to its own log" if job.get("over_hosts") is False
                else "none: it runs on one host, or none of its workers started")
    if job["state"] == "running":
        return "none yet: it runs over hosts, and none of its workers has started"
    return "none: it ran over hosts, and ended before any of its workers started; its own log says why"


def _key_hint(args: argparse.Namespace, daemon_key: bytes, keys_dir: str | os.PathLike[str]) -> str:
    """The ``--daemon-key`` that ``submit``'s hint needs where the daemon's key is not the client's own
    (a hosts file gave it: each side its own pair); empty for a cluster key. Without it the hinted
    ``reactor status`` waited out its timeout and blamed the keys."""
    import shlex

    from ..launch._keys import load_keys

    if daemon_key == load_keys(keys_dir).public:
        return ""
    given = args.daemon_key if args.daemon_key else daemon_key.decode()
    if args.daemon_key and not Path(given).is_absolute() and Path(given).exists():
        given = str(Path(given).resolve())
    # (joined by "=": a Z85 key may begin with "-", which argparse takes for an option of its own)
    return f" --daemon-key={shlex.quote(given)}"


def _remove_unserved_state(state: Path) -> None:
    """Remove the state directory this command made for a daemon that failed before it served: only
    what such a daemon puts there, and only if no other daemon holds its lock (one started on the same
    new directory meanwhile); anything else found there keeps the directory."""
    import fcntl

    try:
        fd = os.open(state / "daemon.lock", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        pass  # (it failed before it took its lock)
    except OSError:
        return
    else:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(state / "daemon.lock")
        except OSError:  # (BlockingIOError: another daemon's now: leave it all)
            return
        finally:
            os.close(fd)
    for name in ("daemon.log", "daemon.json"):
        with contextlib.suppress(OSError):
            if (state / name).is_file() and not (state / name).is_symlink():
                os.unlink(state / name)
    for name in ("jobs", "runs", ".removing", ""):
        with contextlib.suppress(OSError):
            os.rmdir(state / name)  # (only if empty)


def _volatile_state(state: Path) -> str | None:
    """Why a daemon's state directory would not outlive a reboot, in words: on a file system kept in
    memory (tmpfs, ramfs: /dev/shm, a /tmp mounted so), or under /tmp (cleared at boot on many systems,
    and by systemd-tmpfiles of what is untouched for 10 days); None for any other."""
    path = state.resolve()
    mounts: list[tuple[str, str]] = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) >= 3:  # (a space in a mount point is written \040)
                mounts.append((fields[1].replace("\\040", " "), fields[2]))
    under = [(m, kind) for m, kind in mounts if path == Path(m) or Path(m) in path.parents]
    if under:
        mount, kind = max(under, key=lambda u: len(u[0]))
        if kind in ("tmpfs", "ramfs"):
            return f"on a {kind} at {mount} (kept in memory)"
    if path == Path("/tmp") or Path("/tmp") in path.parents:
        return "under /tmp (cleared at boot on many systems)"
    return None


def _where(group: str, where: dict[str, Any]) -> str:
    """A job's group in ``reactor status JOB``: its host, and a restart's wait for one."""
    return f"{group} on {where['host']}" + (f" ({where['waiting']})" if where.get("waiting") else "")


def _job_state(j: dict[str, Any]) -> str:
    """A job's state and exit status in words: ``finished exit 0``, ``failed exit 143 (ended by SIGTERM)``, and a
    job asked to stop ``stopped (by request)``: its run ends on that SIGTERM with 143, which read as a signal
    from elsewhere (``stopped exit 143``); an exit other than that clean stop's is said beside it."""
    rc = j["returncode"]
    if rc is None:
        exit_ = ""
    elif rc < 0 or rc > 128:  # (killed by a signal, as Popen says; or ended by one, as the run exits after it)
        try:
            name = signal.Signals(-rc if rc < 0 else rc - 128).name
        except ValueError:
            name = ""
        exit_ = f"exit {rc}" + (f" ({'killed' if rc < 0 else 'ended'} by {name})" if name else "")
    else:
        exit_ = f"exit {rc}"
    if j["state"] == "stopped":
        why = {"daemon": " (its daemon stopped)", "request": " (by request)"}.get(j.get("stopped_by"), "")  # (""
        # for a record that does not say: kept from a daemon before it did, or an earlier daemon's answer)
        return f"stopped{why}" + ("" if rc in (None, 128 + signal.SIGTERM) else f", {exit_}")
    return f"{j['state']}{' ' + exit_ if exit_ else ''}"


def _job_line(j: dict[str, Any]) -> str:
    """One job in ``reactor status``: id, state and exit status, age, app, where its groups run, and the last
    line of its output (without one, what its daemon says of how it ended: a full disk, say)."""
    groups = j.get("groups") or {}
    spread = (f"  {len(groups)} group{'s' * (len(groups) != 1)} on {len({w['host'] for w in groups.values()})} "
              f"host{'s' * (len({w['host'] for w in groups.values()}) != 1)}" if groups else "")
    if local := j.get("workers"):  # (a running job on its daemon's host alone: its coordinator's workers)
        spread = (f"  workers {sum(w['state'] == 'running' for w in local)}/{len(local)} alive  restarts "
                  f"{sum(w['restarts'] for w in local)}")
    return (f"{j['id']}  {_job_state(j)}  {j['app']} --placement {j['placement']}  pid {j['pid']}  "
            f"up {j['uptime_s']:.1f}s  on {j['daemon']}{spread}  | {j['last_line'] or j.get('detail', '')}")


def _exit_words(rc: int, short: bool = False) -> str:
    """An exit status with what it says of a reactor worker: "4 (stopped because the run failed)"
    (143, SIGTERM's, read as a failure of its own); ``short``: the words before the colon."""
    from ..launch._protocol import worker_exit_words

    words = worker_exit_words(rc)
    if short:
        words = words.split(":")[0]
    return f"{rc} ({words})" if words else str(rc)


def _worker_line(w: dict[str, Any]) -> str:
    """One hosted worker in ``reactor status JOB``."""
    rc = "" if w["returncode"] is None else f" exit {_exit_words(w['returncode'])}"
    return f"{w['state']}{rc}  pid {w['pid']}  up {w['uptime_s']:.1f}s  restarts {w.get('restarts', 0)}"


def _by_run(hosted: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The workers a daemon hosts (``hosted``), by run, in its order."""
    out: dict[str, list[dict[str, Any]]] = {}
    for w in hosted:
        out.setdefault(w["run"], []).append(w)
    return out


def _run_line(run: str, workers: list[dict[str, Any]], job: str | None) -> str:
    """One run a daemon hosts workers of, in ``reactor status``: one line however many workers (it was a
    line a worker: 800 lines for the 200 ended runs a daemon keeps): running while one of them runs, its
    age (its oldest worker's), workers alive of all, restarts, and the exit statuses of the first ended."""
    alive = sum(w["returncode"] is None for w in workers)
    ended = [w for w in workers if w["returncode"] is not None]
    exits = ", ".join(f"{w['group']} {_exit_words(w['returncode'], short=True)}" for w in ended[:3]) + (f" +{len(ended) - 3}" if len(ended) > 3
                                                                                else "")
    return (f"run {run}  {'running' if alive else 'ended'}  up {max(w['uptime_s'] for w in workers):.1f}s  "
            f"workers {alive}/{len(workers)} alive  restarts {sum(w.get('restarts', 0) for w in workers)}"
            f"{f'  exits {exits}' if exits else ''}  on {workers[0]['daemon']}"
            f"{f'  (job {job}; reactor status {job})' if job else ''}")


def _print_log(read: Any, follow: bool, who: str, kind: str) -> None:
    """Print a log chunk by chunk (``read(offset)`` -> data, offset, done): to its end as it is now, or
    with ``follow``, on until the job is done. (One answer carries at most ``LOG_CHUNK_NBYTES``: the log
    of a job that printed more was cut there, mid-line and without a word, its end never shown.) Each
    chunk must carry at most that, and end where its data does: an offset that did not move on (or went
    back) asked for the same chunk for ever, printing it each time. An empty one at an earlier offset is a
    log cut shorter (the daemon reads from its end): said, and read on from there.

    Raises:
        DaemonError: a chunk that is not so (``who`` sent it, in answer to ``kind``).
    """
    from ..launch._daemon import DaemonError
    from ..launch._hosting import chunk_problem

    offset = 0
    while True:
        got = read(offset)
        if not got["data"] and 0 <= got["offset"] < offset:  # (the daemon reads from the end of a log cut shorter)
            print(f"reactor: the log was cut to {got['offset']:,} bytes; going on from there", file=sys.stderr)
            offset = got["offset"]
            continue
        if (why := chunk_problem(offset, got["data"], got["offset"])) is not None:
            sys.stdout.flush()
            raise DaemonError(f"{who} sent a malformed answer to {kind!r}: {why} (a daemon of another reactor "
                              f"version?)")
        sys.stdout.buffer.write(got["data"])
        sys.stdout.flush()
        offset = got["offset"]
        if not got["data"] and (got["done"] or not follow):
            break
        if not got["data"]:
            time.sleep(0.2)


def _daemon_of(args: argparse.Namespace, own_key: bytes) -> tuple[str, bytes]:
    """The daemon a job command talks to: ``--daemon``, else the head host of the placement file
    or hosts file (its first group's first host, else the first host listed); with its key:
    ``--daemon-key`` if given, else the hosts file's, else ``own_key`` (a cluster key)."""
    from ..launch._cluster import head_host

    given = _daemon_key(args.daemon_key) if args.daemon_key else None
    if args.daemon:
        return args.daemon, given or own_key
    source = getattr(args, "hosts", None) or getattr(args, "placement", None)
    if not source or not Path(source).is_file():
        raise ValueError("which daemon? give --daemon tcp://HOST:PORT (or, to submit, a placement or --hosts file "
                         "naming [hosts])")
    host = head_host(source)
    return host.address, given or host.key or own_key


def _daemon_key(path: str) -> bytes:
    """``--daemon-key``: its public key, from a key.pub file or given as its Z85 text (as a hosts file
    takes it; what ``submit``'s hint prints for a key a hosts file gave as text); a file that cannot be
    read (a directory, say) is the user's mistake, named (ValueError: a one-line error)."""
    from ..launch._cluster import Z85_KEY_RE
    from ..transport import CurveKeys

    if Z85_KEY_RE.match(path) and not Path(path).exists():
        return path.encode()
    try:
        return CurveKeys.load_public(path)
    except FileNotFoundError:
        raise ValueError(f"--daemon-key {path}: no such file, and not a key's 40-character Z85 text either (give the "
                         f"daemon's key.pub, or the text in it)") from None
    except OSError as e:
        raise ValueError(f"--daemon-key {path}: {e.strerror or e}") from None


def _check_job(args: argparse.Namespace) -> None:
    """What ``reactor submit`` checks before the job leaves. Always what needs nothing of the daemon's
    host: the files exist, the placement is a policy or a TOML file that parses (the hosts file too),
    the hosts its groups name are in its hosts, the app file compiles, ``--set`` parses, the restart
    policy and the mode agree, ``--hosts`` and ``--restart`` have a multi-process placement; and the ``--set``
    keys and values, as ``reactor k8s render`` and ``reactor slurm`` check them (:func:`_check_config_here`:
    an app that does not import here, or whose graph does not build here but for a ``--set`` value, is
    said and goes). With ``--check`` its graph is built here as ``reactor run`` would, whatever fails.

    Raises:
        (what ``reactor run`` raises for the same mistakes, before anything starts)
    """
    from ..launch._placement import _read_toml, check_hosts_named
    from ..launch._runtime import check_settings

    _check_run_options(args)
    overrides = parse_overrides(args.overrides)
    for what, path in (("placement file", args.placement if Path(args.placement).is_file() else None),
                       ("hosts file", args.hosts)):
        if path is not None:
            _read_toml(path, what)
    deterministic = not args.async_
    # (the settings' checks that need no graph: a restart policy the mode cannot hold, --hosts or --restart
    # with placement single)
    check_settings(None, placement=args.placement, deterministic=deterministic, restart=args.restart,
                   hosts=args.hosts)
    check_hosts_named(args.placement, args.hosts)
    with _app_code(args.app):
        compile_app(args.app)
    if not args.check:
        if overrides:  # (a bad one refused here, not in the job's log after its daemon started it)
            _check_config_here(args.app, overrides, args.overrides, args.placement, args.hosts)
        return
    from ..launch._groups import restart_from_text
    from ..launch._placement import check_lookahead, resolve_placement

    with _app_code(args.app):
        graph = build_graph(args.app, overrides)
    graph.validate()
    check_settings(graph, placement=args.placement, deterministic=deterministic, restart=args.restart,
                   hosts=args.hosts)
    if args.placement != "single":
        plan = resolve_placement(graph, args.placement, args.hosts,
                                 restart_from_text(args.restart) if args.restart is not None else None)
        if deterministic:
            check_lookahead(graph, plan.groups, args.placement)
