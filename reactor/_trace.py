"""Trace files: the delivery schedule of an async run, per reactor.

A trace records, for every reactor instance, the sequence of events it processed, each as
``(kind, rank, seq)``: the kind (startup, timer, action, input), the timer/action index or the
link index the message came through, and the message's sequence number on that link. Payloads are
not stored: a replay run regenerates them, because every reactor's behaviour is a function of the
events it saw and its seeded generators. The file is msgpack (never pickle), written atomically, and
holds the sha256 of its events table: a schedule cut short or edited by hand replayed to a "successful"
end (a reactor's list halved, or gone: the run did less, exit 0).

A recorded run that fails writes its trace too, up to the failure, and says so (:func:`write_failed_trace`):
the event that failed is the last of its reactor's schedule (an event is recorded as it is handed to its
reactor), so a replay runs the same events again and meets the same failure where it follows from them
(a bug in a reaction, a value an env returned). The trace keeps the failure's line (``failure``), said by
``trace show`` and at the replay's start. A failure that comes from outside the events (a process killed)
leaves no schedule a replay could follow: no trace then, and one line says why (:func:`no_trace_line`).
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgpack

from ._errors import MalformedFrameError, TraceMismatchError
from ._files import read_small, replace_small
from ._graph import Graph
from ._scheduler import KIND_NAMES

FORMAT = "reactor-trace"
VERSION = 1
#: The largest trace read (~16M events; held in memory as Python tuples, a trace takes ~45x its size).
MAX_TRACE_NBYTES = 64 * 2**20
_SHA256 = re.compile(r"^[0-9a-f]{64}\Z")


def _events_digest(events: dict[str, list[Any]]) -> str:
    return hashlib.sha256(msgpack.packb(events, use_bin_type=True)).hexdigest()


def graph_shape(graph: Graph) -> dict[str, list[Any]]:
    """What a trace's events refer to: the graph's reactor instances and its links, in the order
    that numbers them (an event's rank is a link index)."""
    return {"reactors": sorted(n for _, _, n in graph.instances()),
            "links": [[lk.src, lk.src_port, lk.dst, lk.dst_port, lk.delay_ns] for lk in graph.links()]}


def check_graph(trace: dict[str, Any], graph: Graph, path: str | Path, seed: int | None = None) -> None:
    """Refuse to replay ``trace`` on a graph other than the one it was recorded from, or with another
    ``seed`` (the reactors' generators would draw otherwise, and the run go elsewhere in silence).

    Raises:
        TraceMismatchError: the seed, or the reactors or links differ, naming what differs.
    """
    if seed is not None and trace.get("seed", seed) != seed:
        raise TraceMismatchError(f"trace {path} was recorded with seed {trace['seed']}, and this run has seed {seed}: "
                                 f"replay it with --seed {trace['seed']} (in Python, seed={trace['seed']})")
    recorded = trace.get("graph")
    if recorded is None:  # written before traces recorded their graph: nothing to compare
        return
    now = graph_shape(graph)
    if recorded == now:
        return
    diffs = []
    for what, key in (("reactors", "reactors"), ("links", "links")):
        old = {tuple(x) if isinstance(x, list) else x for x in recorded[key]}
        new = {tuple(x) if isinstance(x, list) else x for x in now[key]}
        if old - new:
            diffs.append(f"{what} only in the trace: {_few(old - new)}")
        if new - old:
            diffs.append(f"{what} only in this graph: {_few(new - old)}")
    if not diffs:
        diffs.append("the links are numbered in another order")
    raise TraceMismatchError(f"trace {path} was recorded from another graph ({'; '.join(diffs)}): a replay "
                             f"needs the graph it was recorded from (same app and --set values)")


_CONFIG_KEYS = 4096
_CONFIG_VALUE_CHARS = 1000


def _config_text(v: Any) -> str:
    """A --set value as the trace keeps it: its repr, a long one cut and marked by its digest (a
    sweep's list of 20,000 seeds made a trace no replay could read)."""
    text = repr(v)
    if len(text) <= _CONFIG_VALUE_CHARS:
        return text
    return f"{text[:200]}...[{len(text)} characters, sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}]"


def check_config(trace: dict[str, Any], config: Mapping[str, Any] | None, path: str | Path,
                 app: str | None = None) -> None:
    """Say, before a replay starts, which ``--set`` values differ from those ``trace`` was recorded with
    (a replay with another lr ran to its end and only then ended with TraceMismatchError; a newcomer's
    pass, session 55), and whether it was recorded from another app (``app``: its file's name or its
    builder; a DQN trace replayed on the transformer app, whose graph has the same reactors and links,
    ran to its end before the error). Said, not refused: some settings (run_dir, live) do not change the
    schedule, and a copy of an app under another name is the same app. A trace of a run that failed says
    so too: its replay is meant to fail alike."""
    log = logging.getLogger("reactor")
    if isinstance(trace.get("failure"), str):
        log.warning("replaying %s, recorded from a run that failed (%s): the replay runs its events to that failure",
                    path, trace["failure"])
    recorded_app = trace.get("app")
    if isinstance(recorded_app, str) and app is not None and recorded_app != app:
        log.warning("replaying %s, recorded from app %r, on app %r: another app's run goes elsewhere, and the replay "
                    "then ends with TraceMismatchError (replay a trace on the app it was recorded from)",
                    path, recorded_app, app)
    recorded = trace.get("config")
    if recorded is None or config is None:
        return
    now = {str(k)[:128]: _config_text(v) for k, v in config.items()}
    differ = sorted(k for k in set(recorded) | set(now) if recorded.get(k) != now.get(k))
    if differ:
        shown = ", ".join(f"{k}={now.get(k, '(not set)')} (recorded: {recorded.get(k, '(not set)')})"
                          for k in differ[:8])
        log.warning(
            "replaying %s with other --set values than it was recorded with: %s%s; other settings than where the "
            "run writes usually change its schedule, and the replay then ends with TraceMismatchError",
            path, shown, f" and {len(differ) - 8} more" if len(differ) > 8 else "")


def _few(items: set[Any], n: int = 5) -> str:
    shown = sorted(items, key=str)[:n]
    text = ", ".join(_show(x) for x in shown)
    return text + (f" and {len(items) - n} more" if len(items) > n else "")


def _show(x: Any) -> str:
    if isinstance(x, tuple):
        return f"{x[0]}.{x[1]} -> {x[2]}.{x[3]} (delay {x[4]} ns)"
    return str(x)


def write_trace(path: str | Path, trace: dict[str, Any]) -> None:
    """Write ``trace`` (keys: seed, placement, events, and graph: :func:`graph_shape`; config and app if
    known: :func:`check_config`) to ``path`` atomically."""
    path = Path(path)
    body = {
        "format": FORMAT,
        "version": VERSION,
        "seed": trace.get("seed", 0),
        "placement": trace.get("placement", "single"),
        "events": {k: [list(e) for e in v] for k, v in sorted(trace["events"].items())},
    }
    body["events_sha256"] = _events_digest(body["events"])
    if trace.get("graph") is not None:
        body["graph"] = trace["graph"]
    if isinstance(trace.get("app"), str):  # the app's file name or builder (check_config)
        body["app"] = trace["app"][:1000]
    if trace.get("config") is not None:  # the run's --set values, as text (check_config)
        body["config"] = {str(k)[:128]: _config_text(v) for k, v in sorted(trace["config"].items())[:_CONFIG_KEYS]}
    if isinstance(trace.get("failure"), str):  # the run failed: its line (write_failed_trace)
        body["failure"] = trace["failure"][:_FAILURE_CHARS]
    data = msgpack.packb(body, use_bin_type=True)
    if len(data) > MAX_TRACE_NBYTES:  # (written whole all the same: the run happened, and the file says what)
        logging.getLogger("reactor").warning(
            "trace %s is %.0f MiB, past the %d MiB a replay reads: it cannot be replayed (record a shorter run)",
            path, len(data) / 2**20, MAX_TRACE_NBYTES // 2**20)
    replace_small(path, data, sync=True)


_FAILURE_CHARS = 2000


def failure_line(e: BaseException) -> str:
    """A run's failure as its trace keeps it: its class and first line (``RuntimeError: the env broke``)."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")[:_FAILURE_CHARS]


def write_failed_trace(path: str | Path, trace: dict[str, Any], failure: str) -> None:
    """A recorded run failed (``failure``: its line, :func:`failure_line`): write its trace up to the
    failure and say so, or say why it could not be written. Never raises: the run's own error is the one
    its caller raises. (A failed recording wrote nothing, in silence: the run a user most needs to replay.)"""
    log = logging.getLogger("reactor")
    try:
        write_trace(path, {**trace, "failure": failure})
    except (OSError, ValueError) as e:  # (a full disk, a directory gone since the run began)
        log.warning("the run failed, and its trace could not be written to %s: %s", path, e)
        return
    log.warning("the run failed; its trace up to the failure is in %s: --replay %s runs the same events again, to "
                "the same failure where it follows from them (a reaction's bug, a value an env returned)", path, path)


def no_trace_line(path: str | Path, why: str) -> None:
    """A recorded run ended with no trace to write (``why``: it failed and whose events are missing, or it
    was stopped at once): one line, where a trace was asked for and none comes."""
    logging.getLogger("reactor").warning("no trace was written to %s: %s", path, why)


def read_trace(path: str | Path) -> dict[str, Any]:
    """Read a trace file.

    Raises:
        FileNotFoundError: no such file (naming it).
        MalformedFrameError: the file is not a reactor trace (a directory, say), or is damaged.
    """
    path = Path(path)
    try:
        data = read_small(path, MAX_TRACE_NBYTES)  # (a FIFO or a device is refused, not read forever)
    except ValueError as e:
        raise MalformedFrameError(str(e)) from None
    except FileNotFoundError:  # (was "[Errno 2] No such file or directory: 'x'", naming no trace)
        raise FileNotFoundError(f"no trace file at {str(path)!r} (reactor run --async --record writes one)") from None
    except IsADirectoryError:
        raise MalformedFrameError(f"{path} is a directory, not a trace file") from None
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=MAX_TRACE_NBYTES)
    except Exception as e:
        raise MalformedFrameError(f"{path} is not a readable trace file ({e})") from e
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise MalformedFrameError(f"{path} is not a reactor trace file (no '{FORMAT}' header)")
    if body.get("version") != VERSION:
        raise MalformedFrameError(f"{path} has trace version {body.get('version')!r}; this reactor reads {VERSION}")
    if type(body.get("seed")) is not int or not isinstance(body.get("placement"), str):
        raise MalformedFrameError(f"{path}: the header is damaged (its seed or placement)")
    events = body.get("events")
    if not isinstance(events, dict) or not all(isinstance(v, list) for v in events.values()):
        raise MalformedFrameError(f"{path}: the events table is damaged")
    digest = body.get("events_sha256")
    if not isinstance(digest, str) or not _SHA256.match(digest):
        raise MalformedFrameError(f"{path} holds no digest of its events (a trace of an older reactor, or damaged): "
                                  f"record the run again")
    if _events_digest(events) != digest:
        raise MalformedFrameError(f"{path}: its events are not those it was written with (cut short or edited: their "
                                  f"sha256 differs from the one recorded); record the run again")
    for name, evs in events.items():  # each event: [a known kind, a rank, a sequence number]
        for i, e in enumerate(evs):
            if not (isinstance(e, list) and len(e) == 3 and all(type(x) is int and x >= 0 for x in e)
                    and e[0] in KIND_NAMES):
                raise MalformedFrameError(f"{path}: the events table is damaged (event {i} of {name!r} is {e!r})")
    body["events"] = {k: [tuple(e) for e in v] for k, v in events.items()}
    shape = body.get("graph")
    if shape is not None and not (
        isinstance(shape, dict) and isinstance(shape.get("reactors"), list)
        and all(isinstance(r, str) for r in shape["reactors"]) and isinstance(shape.get("links"), list)
        and all(isinstance(lk, list) and len(lk) == 5 and all(isinstance(x, str) for x in lk[:4])
                and isinstance(lk[4], int) for lk in shape["links"])
    ):
        raise MalformedFrameError(f"{path}: the graph table is damaged")
    if shape is None:
        raise MalformedFrameError(f"{path} does not record its graph (a trace of an older reactor): record the run again")
    if body.get("app") is not None and not isinstance(body["app"], str):  # (only a replay's warning reads it)
        body.pop("app")
    config = body.get("config")
    if config is not None and not (isinstance(config, dict) and len(config) <= _CONFIG_KEYS and all(
            isinstance(k, str) and isinstance(v, str) and len(k) + len(v) <= 1 << 16 for k, v in config.items())):
        # (only a replay's warning reads it: the schedule stays replayable without)
        logging.getLogger("reactor").warning("%s: its table of --set values is damaged; left aside", path)
        body.pop("config")
    if body.get("failure") is not None and not isinstance(body["failure"], str):  # (only words for people)
        body.pop("failure")
    strangers = set(body["events"]) - set(shape["reactors"])
    if strangers:
        raise MalformedFrameError(f"{path}: its events name reactors its graph lacks: {_few(strangers)}")
    return body


def merge_events(parts: list[dict[str, list[Any]]]) -> dict[str, list[Any]]:
    """Merge per-process event tables (each reactor lives in exactly one process)."""
    out: dict[str, list[Any]] = {}
    for p in parts:
        for k, v in p.items():
            if k in out:
                raise ValueError(f"reactor {k!r} appears in two processes' traces")
            out[k] = v
    return out


def describe(trace: dict[str, Any], *, limit: int = 20) -> str:
    """A human summary: per reactor, the number of events by kind and the first ``limit`` events."""
    lines = [f"trace seed={trace['seed']} placement={trace['placement']} reactors={len(trace['events'])}"]
    if trace.get("failure"):
        lines.append(f"recorded from a run that failed: {trace['failure']}")
    for name, evs in trace["events"].items():
        counts: dict[str, int] = {}
        for kind, _, _ in evs:
            counts[KIND_NAMES[kind]] = counts.get(KIND_NAMES[kind], 0) + 1
        summary = ", ".join(f"{k}={v}" for k, v in sorted(counts.items()))
        lines.append(f"  {name}: {len(evs)} events ({summary})")
        for kind, rank, seq in evs[:limit]:
            lines.append(f"    {KIND_NAMES[kind]:<7} #{rank} seq {seq}")
        if len(evs) > limit:
            lines.append(f"    ... {len(evs) - limit} more")
    return "\n".join(lines)


def diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Differences between two traces: per reactor, the first position where they diverge."""
    out = []
    for name in sorted(set(a["events"]) | set(b["events"])):
        ea, eb = a["events"].get(name), b["events"].get(name)
        if ea is None or eb is None:
            out.append(f"{name}: only in {'first' if eb is None else 'second'} trace")
            continue
        for i, (x, y) in enumerate(zip(ea, eb)):
            if x != y:
                out.append(f"{name}: event {i} differs: {_ev(x)} vs {_ev(y)}")
                break
        else:
            if len(ea) != len(eb):
                out.append(f"{name}: same first {min(len(ea), len(eb))} events, then {len(ea)} vs {len(eb)} in all")
    return out


def _ev(e: tuple[int, int, int]) -> str:
    return f"{KIND_NAMES.get(e[0], '?')} #{e[1]} seq {e[2]}"
