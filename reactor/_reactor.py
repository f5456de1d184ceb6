"""Reactors, their ports, timers, actions and reactions.

A reactor declares its interface as class attributes (``Input``, ``Output``, ``Timer``, ``Action``)
and its behaviour as methods decorated with ``@reaction``. The decorator is a contract: a reaction
may only write the outputs and schedule the actions it names in ``effects``; anything else raises
``PortError`` naming the reactor, the reaction and the port.

Reactors never call each other and never share memory: the scheduler delivers messages between
their ports. State lives in the instance. ``__init__`` runs wherever the app is built (every
process of a multi-process run builds the graph), so keep it cheap and acquire resources (files,
environments, models) in a ``startup`` reaction.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import reprlib
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import numpy as np

from ._errors import PortError
from ._tag import Tag, seconds_to_ns

if TYPE_CHECKING:
    from ._scheduler import ReactorHost

T = TypeVar("T")


class PortSpec:
    """Base of every class-level declaration (ports, timers, actions, lifecycle triggers)."""

    name: str = "?"
    owner: type | None = None

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.owner = owner

    def __repr__(self) -> str:
        owner = self.owner.__name__ if self.owner else "?"
        return f"{type(self).__name__}({owner}.{self.name})"


class Input(PortSpec, Generic[T]):
    """An input port carrying values of type ``T``.

    Args:
        type_: the payload type; checked against the connected output's type when the graph is
            validated. ``object`` (the default) accepts anything.
        required: a required input must be connected, or ``Graph.validate`` raises ``GraphError``.
    """

    def __init__(self, type_: Any = object, *, required: bool = False) -> None:
        self.type = type_
        self.required = required

    def __get__(self, instance: Reactor | None, owner: type) -> Any:
        if instance is None:
            return self
        return instance._inputs[self.name]


class Output(PortSpec, Generic[T]):
    """An output port sending values of type ``T``. Write it with ``self.port.send(value)``, which
    refuses a value not of ``T`` where ``T`` is a class or a union of classes (see :func:`port_kinds`),
    under every placement alike."""

    def __init__(self, type_: Any = object) -> None:
        self.type = type_
        self.kinds = port_kinds(type_)

    def __get__(self, instance: Reactor | None, owner: type) -> Any:
        if instance is None:
            return self
        return instance._outputs[self.name]


def port_kinds(port_type: Any) -> tuple[type, ...] | None:
    """The classes a port's values are checked against: its type, or the members of its union
    (``int | None``, ``Optional[int]``); None where nothing is checked (``object``, ``Any``, a
    generic alias such as ``list[int]``, a ``Protocol`` that is not ``runtime_checkable``, or a union
    holding one). An ``int`` is taken where ``float``
    is (not a ``bool``). The same check runs where a value is sent (:meth:`_OutputPort.send`) and
    where it enters another process (``reactor/launch/_protocol.py``)."""
    if isinstance(port_type, types.UnionType) or typing.get_origin(port_type) is typing.Union:
        members = typing.get_args(port_type)
    else:
        members = (port_type,)
    if not all(isinstance(m, type) for m in members) or object in members or Any in members:
        return None
    try:
        isinstance(None, members)  # (a Protocol that is not runtime_checkable cannot be checked: not checked)
    except TypeError:
        return None
    return tuple(members)


def value_fits(kinds: tuple[type, ...], value: Any) -> bool:
    """Whether ``value`` is of one of ``kinds`` (:func:`port_kinds`)."""
    return isinstance(value, kinds) or (type(value) is int and float in kinds)


_SHOW = reprlib.Repr()  # (Python 3.11's takes no arguments)
_SHOW.maxlevel, _SHOW.maxlist, _SHOW.maxtuple, _SHOW.maxdict, _SHOW.maxset = 3, 4, 4, 4, 4
_SHOW.maxstring, _SHOW.maxlong, _SHOW.maxother = 60, 40, 60


def show_value(v: Any) -> str:
    """A value, shown in an error: its type and a repr bounded in depth and length whatever it is (a
    full ``repr`` of a list nested a thousand deep raised RecursionError, and one of millions of items
    took seconds)."""
    if isinstance(v, (dict, list, tuple, set, frozenset)) and len(v) > 64:  # (reprlib sorts a dict whole)
        return f"{type(v).__name__} of {len(v)} items"
    try:
        text = _SHOW.repr(v)
    except Exception:  # noqa: BLE001 - a hostile value's repr must not take the checker down
        text = "?"
    return f"{type(v).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"


def kinds_name(port_type: Any) -> str:
    """A port's type as an error names it."""
    return getattr(port_type, "__name__", None) or repr(port_type)


class Timer(PortSpec):
    """A periodic trigger firing at logical times ``offset_s + k * period_s`` (k = 0, 1, ...).

    ``period_s == 0`` fires once, at ``offset_s``. In deterministic mode the timer fires in logical
    time (as fast as the run can go); in async mode it follows the wall clock.
    """

    def __init__(self, period_s: float, offset_s: float = 0.0) -> None:
        self.period_ns = seconds_to_ns(period_s, "Timer period_s")
        self.offset_ns = seconds_to_ns(offset_s, "Timer offset_s")


class Action(PortSpec, Generic[T]):
    """A logical action: a reactor schedules its own future event with ``self.act.schedule(v, delay_s)``.

    Args:
        min_delay_s: a lower bound added to every scheduled delay.
    """

    def __init__(self, type_: Any = object, *, min_delay_s: float = 0.0) -> None:
        self.type = type_
        self.min_delay_ns = seconds_to_ns(min_delay_s, "Action min_delay_s")

    def __get__(self, instance: Reactor | None, owner: type) -> Any:
        if instance is None:
            return self
        return instance._actions[self.name]


class _Lifecycle(PortSpec):
    def __init__(self, name: str) -> None:
        self.name = name

    def __set_name__(self, owner: type, name: str) -> None:  # shared singletons; never owned
        pass

    def __repr__(self) -> str:
        return self.name


startup = _Lifecycle("startup")
"""Trigger: fires once, at the start tag, before any other event of the reactor."""
shutdown = _Lifecycle("shutdown")
"""Trigger: fires once when the run ends. Outputs written by shutdown reactions are not delivered."""
peer_lost = _Lifecycle("peer_lost")
"""Trigger (async runs with a restart policy): the process of other reactors died and is being
started again. ``self.peer_change`` says which reactors and why; messages sent to them meanwhile are
dropped (counted in the run's statistics)."""
peer_restarted = _Lifecycle("peer_restarted")
"""Trigger (async runs with a restart policy): the process of other reactors was started again and
takes messages. ``self.peer_change`` says which reactors; they start fresh (``restarts`` > 0)."""


@dataclass(frozen=True)
class PeerChange:
    """What a ``peer_lost`` or ``peer_restarted`` reaction is about.

    Attributes:
        event: ``"peer_lost"`` or ``"peer_restarted"``.
        reactors: the full names of the reactor instances of the process that died or came back.
        reason: how it ended (``peer_lost``), or how many times it has been restarted.
        links: this reactor's links to them: ``(its own port's name, the bank index of the reactor at
            the other end)``, sorted; e.g. ``("steps", 1)`` for an actor writing to shard 1.
        life: which life of that process: the one that ended (``peer_lost``) or began
            (``peer_restarted``), counted as its reactors' ``restarts`` count them (0: its first); -1
            where not known (a peer that was down when this process started). A process that joins
            its peers' collectives (data-parallel learners) tells from it whether a death is of a
            process it joined, or of one before it.
    """

    event: str
    reactors: tuple[str, ...]
    reason: str
    links: tuple[tuple[str, int], ...] = ()
    life: int = -1

    def indices(self, port: str) -> list[int]:
        """The bank indices of the changed reactors at the other end of ``port``'s links."""
        return sorted({i for p, i in self.links if p == port})


@dataclass(frozen=True)
class ReactionSpec:
    """A reaction as declared in the class body."""

    name: str
    func: Callable[..., Any]
    triggers: tuple[PortSpec, ...]
    effects: tuple[PortSpec, ...]
    sources: tuple[PortSpec, ...]
    params: tuple[str, ...]
    is_async: bool
    index: int = 0
    blocking: bool = False


def reaction(
    *,
    triggers: Sequence[PortSpec],
    effects: Sequence[PortSpec] = (),
    sources: Sequence[PortSpec] = (),
    blocking: bool = False,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare a reaction: what triggers it, what it may read and what it may write.

    The decorated method's parameters (after ``self``) must each name one of its ``Input`` or
    ``Action`` triggers or sources; the scheduler passes the present value, or ``None`` when that
    port has no value at this event. ``async def`` reactions are awaited to completion before the
    reactor handles its next event.

    ``blocking=True`` declares that the reaction may wait on other processes outside the graph (a
    rendezvous, a gradient all-reduce), during which its process sends nothing, promises included.
    In deterministic runs the process therefore promises its peers what it can before such a
    reaction runs (as of the reaction's tag): a peer that must reach the same logical time to join
    the collective is never left waiting on a promise this process cannot send while it waits.

    Raises:
        TypeError: a trigger, effect or source is not a port of the right kind, or a parameter
            names no trigger or source.
    """
    for t in triggers:
        if not isinstance(t, (Input, Timer, Action, _Lifecycle)):
            raise TypeError(f"reaction trigger {t!r} is not an Input, Timer, Action, startup, shutdown, "
                            f"peer_lost or peer_restarted")
    for e in effects:
        if not isinstance(e, (Output, Action)):
            raise TypeError(f"reaction effect {e!r} is not an Output or Action")
    for s in sources:
        if not isinstance(s, (Input, Action)):
            raise TypeError(f"reaction source {s!r} is not an Input or Action")
    if not triggers:
        raise TypeError("a reaction needs at least one trigger")
    if type(blocking) is not bool:
        raise TypeError(f"reaction blocking must be True or False, got {blocking!r}")

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(func)
        params = tuple(list(sig.parameters)[1:])
        func.__reaction_spec__ = (tuple(triggers), tuple(effects), tuple(sources), params, blocking)  # type: ignore[attr-defined]
        return func

    return decorate


class _OutputPort:
    """The per-instance side of an ``Output``."""

    __slots__ = ("reactor", "spec")

    def __init__(self, reactor: Reactor, spec: Output[Any]) -> None:
        self.reactor = reactor
        self.spec = spec

    def send(self, value: Any) -> None:
        """Send ``value`` at the current tag (plus the connection's delay). Never blocks.

        Raises:
            PortError: called outside a reaction, or from a reaction that does not declare this
                output among its effects, or with a value not of the port's type.
        """
        r = self.reactor
        spec = self.spec
        current = r._current
        if current is None or spec not in current.effects:
            r._effect_error(spec, current)
        kinds = spec.kinds
        if kinds is not None and not isinstance(value, kinds) and not value_fits(kinds, value):  # (the common case inline)
            hint = " (a numpy scalar: its .item() is the Python value it holds)" if isinstance(value, np.generic) else ""
            raise PortError(f"{r.name}.{current.name} sent {show_value(value)} on output {spec.name!r}, which takes "
                            f"{kinds_name(spec.type)}{hint}")
        r._host.emit(r, spec.name, value)

    def __repr__(self) -> str:
        return f"<output {self.reactor.name}.{self.spec.name}>"


class _InputPort:
    """The per-instance side of an ``Input``: its value at the current event."""

    __slots__ = ("value", "is_present", "spec")

    def __init__(self, spec: Input[Any]) -> None:
        self.spec = spec
        self.value: Any = None
        self.is_present = False


class _ActionHandle:
    """The per-instance side of an ``Action``."""

    __slots__ = ("reactor", "spec", "value", "is_present")

    def __init__(self, reactor: Reactor, spec: Action[Any]) -> None:
        self.reactor = reactor
        self.spec = spec
        self.value: Any = None
        self.is_present = False

    def schedule(self, value: Any = None, delay_s: float = 0.0) -> None:
        """Schedule this action at ``now + min_delay + delay_s`` (a zero delay means the next microstep).

        Raises:
            PortError: called outside a reaction that declares this action among its effects.
            ValueError: ``delay_s`` is negative or not finite.
        """
        r = self.reactor
        current = r._current
        if current is None or self.spec not in current.effects:
            r._effect_error(self.spec, current)
        delay_ns = self.spec.min_delay_ns + seconds_to_ns(delay_s, f"{r.name}.{self.spec.name} delay_s")
        r._host.schedule_action(r, self.spec.name, value, delay_ns)


class Reactor:
    """Base class of every reactor. See the module docstring for the model.

    Attributes available inside reactions:
        name: the instance's full name in the graph (``"actor[3]"`` for replica 3 of bank ``actor``).
        bank_index, bank_size: position in its bank (0 and 1 for a plain reactor).
        rng: a ``numpy.random.Generator`` seeded from the run seed and ``name``.
        torch_rng: a ``torch.Generator`` seeded the same way (created on first use).
        tag: the logical tag of the event being handled.
        restarts: how many times this instance's process was started again after it died (restart
            policies, async runs): 0 in its first life. A reactor restores its state when > 0.
        peer_change: in a ``peer_lost`` / ``peer_restarted`` reaction, the :class:`PeerChange`.

    Class attribute ``placement_role`` (``"actor"``, ``"replay"``, ``"learner"`` or None) tells the
    named distribution policies (``--placement actors`` etc.) where a reactor belongs; it never
    changes what the reactor does. ``replicas_apart`` (None, or why) says that a bank of this
    reactor's replicas must have each in a process of its own (data-parallel learners: each joins
    the bank's process group); a placement that puts two in one process is refused before
    anything starts.
    """

    placement_role: ClassVar[str | None] = None
    replicas_apart: ClassVar[str | None] = None
    _reaction_specs: tuple[ReactionSpec, ...] = ()
    _port_specs: dict[str, PortSpec] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        ports: dict[str, PortSpec] = {}
        for klass in reversed(cls.__mro__):
            for attr, value in vars(klass).items():
                if isinstance(value, (Input, Output, Timer, Action)):
                    ports[attr] = value
        cls._port_specs = ports
        specs: list[ReactionSpec] = []
        order: list[str] = []
        for klass in reversed(cls.__mro__):  # declaration order, base classes first
            for attr, value in vars(klass).items():
                if hasattr(value, "__reaction_spec__") and attr not in order:
                    order.append(attr)
        for attr in order:
            value = next(vars(k)[attr] for k in cls.__mro__ if attr in vars(k))  # the most derived
            raw = getattr(value, "__reaction_spec__", None)
            if raw is None:  # overridden by a plain method
                continue
            triggers, effects, sources = (tuple(_rebind(p, ports, cls, attr) for p in group) for group in raw[:3])
            params, blocking = raw[3], raw[4]
            readable = {p.name: p for p in (*triggers, *sources) if isinstance(p, (Input, Action))}
            for p in params:
                if p not in readable:
                    raise TypeError(
                        f"{cls.__name__}.{attr} has parameter {p!r}, which names none of its Input or "
                        f"Action triggers or sources ({', '.join(sorted(readable)) or 'none'})"
                    )
            specs.append(
                ReactionSpec(
                    name=attr,
                    func=value,
                    triggers=triggers,
                    effects=effects,
                    sources=sources,
                    params=params,
                    is_async=inspect.iscoroutinefunction(value),
                    index=len(specs),
                    blocking=blocking,
                )
            )
        cls._reaction_specs = tuple(specs)

    def __new__(cls, *args: Any, **kwargs: Any) -> Reactor:
        self = super().__new__(cls)
        # Banks rebuild replicas from the constructor arguments, in the process that owns them.
        self._init_args = (args, kwargs)
        self._bind_ports()
        return self

    def _bind_ports(self) -> None:
        self._inputs = {n: _InputPort(s) for n, s in self._port_specs.items() if isinstance(s, Input)}
        self._outputs = {n: _OutputPort(self, s) for n, s in self._port_specs.items() if isinstance(s, Output)}
        self._actions = {n: _ActionHandle(self, s) for n, s in self._port_specs.items() if isinstance(s, Action)}
        self._current: ReactionSpec | None = None
        self._host: ReactorHost | None = None
        self.name = type(self).__name__
        self.bank_index = 0
        self.bank_size = 1
        self.tag = Tag(0, 0)
        self.restarts = 0
        self.peer_change: PeerChange | None = None
        self._seed = 0
        self._run_seed = 0
        self._torch_rng: Any = None
        self.rng = np.random.default_rng(0)

    def _attach(self, host: ReactorHost, name: str, bank_index: int, bank_size: int, seed: int) -> None:
        self._host = host
        self.name = name
        self.bank_index = bank_index
        self.bank_size = bank_size
        self._seed = derive_seed(seed, name)
        self._run_seed = seed
        self.rng = np.random.default_rng(self._seed)

    @property
    def torch_rng(self) -> Any:
        if self._torch_rng is None:
            import torch

            self._torch_rng = torch.Generator().manual_seed(self._seed)
        return self._torch_rng

    @property
    def bank_seed(self) -> int:
        """A seed shared by every replica of this reactor's bank: derived from the run seed and the bank's
        name (``learner`` for ``learner[1]``), so it changes with ``--seed`` but not with the replica or
        the placement. Data-parallel replicas use it to start from the same weights."""
        return derive_seed(self._run_seed, self.name.split("[", 1)[0])

    @property
    def run_id(self) -> str:
        """The id of the current run: the same in every process of it, different for every run.

        Nodes use it to name run directories and rendezvous files.
        """
        return os.environ.get("REACTOR_RUN_ID", "local")

    @property
    def deterministic(self) -> bool:
        """Whether this run is in deterministic mode (events in tag order); False in async mode.

        Nodes use it to keep timing-dependent shortcuts (e.g. replay's shared-memory reads) out of
        deterministic runs.
        """
        return bool(getattr(self._host, "deterministic", True))

    @property
    def reproducible(self) -> bool:
        """Whether this run's events must follow from its inputs alone: deterministic mode, or an async
        run being recorded (``--record``) or replayed (``--replay``), whose replay enforces the recorded
        order of events and nothing else. Nodes keep timing-dependent shortcuts out of such runs (a
        replay shard's shared-memory rows and one-sided draws: what a draw sees depends on when it runs).
        """
        host = self._host
        return self.deterministic or getattr(host, "recorder", None) is not None or (
            getattr(host, "replayer", None) is not None)

    @property
    def stopped_by(self) -> str | None:
        """Why the run is ending, for a shutdown reaction to report: ``"stop_time"``, ``"quiescence"``
        (nothing left that can happen), ``"request"`` (a reactor's :meth:`request_stop`), ``"signal"``
        (Ctrl-C or SIGTERM at the command), ``"replay"`` (a replay reached the end of its recording),
        ``"failure"`` (a reaction, or a worker of the run, failed) or ``"terminated"`` (this process
        was told to end before the run did: a SIGTERM, a second Ctrl-C). None until the run is
        ending (a stop heard mid-run sets it as the last events run)."""
        return getattr(self._host, "stop_reason", None)

    def restart_loses(self) -> str:
        """What a new life of this reactor (a restart policy, async runs) would start without, in words
        (``"its learning: ..."``), or ``""`` when it resumes whole. Called on the graph's prototype before
        the run starts: the coordinator warns of each reactor a group's restart policy covers that would
        lose something, while there is still time to change a setting. The default: nothing to say."""
        return ""

    def links_into(self, port: str) -> int:
        """How many of the graph's links deliver to this instance's input ``port`` (0: none). A
        node whose behaviour needs a connection the graph may lack checks it at startup."""
        return sum(1 for lk in getattr(self._host, "links", ()) if lk.dst == self.name and lk.dst_port == port)

    @property
    def process_link(self) -> Any:
        """How this reactor's process is reached (:class:`reactor._scheduler.ProcessLink`): its
        endpoint's address and the run's CURVE keys. A node that opens a server of its own binds
        to ``process_link.side_bind(name)`` and secures it with ``process_link.curve``."""
        from ._scheduler import ProcessLink

        return getattr(self._host, "link", None) or ProcessLink()

    def request_stop(self) -> None:
        """Ask the runtime to end the run after the current tag (see docs/architecture.md for semantics)."""
        if self._host is None:
            raise PortError(f"{self.name}.request_stop() called before the reactor was started")
        self._host.request_stop(self)

    def _effect_error(self, spec: PortSpec, current: ReactionSpec | None) -> None:
        kind = "output" if isinstance(spec, Output) else "action"
        if current is None:
            raise PortError(
                f"{self.name}.{spec.name}: {kind} written outside a reaction; write ports only from a "
                f"reaction that declares them in effects=[...]"
            )
        raise PortError(
            f"{self.name}.{current.name} wrote {kind} {spec.name!r}, which is not among its declared effects "
            f"({', '.join(e.name for e in current.effects) or 'none'}); add it to effects=[...]"
        )


def _rebind(p: PortSpec, ports: dict[str, PortSpec], cls: type, attr: str) -> PortSpec:
    """Resolve a port used by a reaction to this class's port of the same name.

    A subclass may override a port (say, a Timer with another period): inherited reactions then use
    the subclass's port.
    """
    if isinstance(p, _Lifecycle):
        return p
    mine = ports.get(p.name)
    if mine is None or type(mine) is not type(p) or not isinstance(p.owner, type) or not issubclass(cls, p.owner):
        raise TypeError(f"{cls.__name__}.{attr} uses {p!r}, which is not a port of {cls.__name__}")
    return mine


def derive_seed(seed: int, name: str) -> int:
    """A 63-bit seed from the run seed and a reactor's full name: the same in every process."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)
