"""The graph: a fixed topology of reactors (nodes and banks) and connections.

A graph says *what* runs and how data flows; it never says *where* (that is the placement, chosen
at launch). ``validate()`` checks the whole topology before anything starts, and every error names
the reactor, the port and the app-file line that made the offending node or connection.
"""

from __future__ import annotations

import re
import sys
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

from ._errors import GraphError
from ._reactor import Input, Output, Reactor
from ._tag import seconds_to_ns

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")
MODES = ("broadcast", "round_robin", "one_to_one", "keyed")
#: The most replicas a bank may have: ``--set actors=100000000000`` (a typo of a few zeros) built a list of
#: that many names and held the host's memory until the OOM killer came, the run never starting.
MAX_REPLICAS = 65_536
#: The most replica-level links a graph may have (a bank of N broadcast or round-robin to a bank of M makes
#: N * M): every run expands them all (``Graph.links``), a million in ~10 s and ~300 MB.
MAX_LINKS = 1 << 20


def _caller_site() -> str:
    """``file:line`` of the first frame outside this package (the app line that made a node)."""
    frame = sys._getframe(1)
    here = __name__.rsplit(".", 1)[0]
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not (module == here or module.startswith(here + ".")) or module.startswith(here + ".tests"):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "<unknown>"


@dataclass(frozen=True)
class PortRef:
    """A port of a node (or of one replica of a bank), as used in ``Graph.connect``."""

    node: Node
    port: str
    replica: int | None = None

    def __repr__(self) -> str:
        idx = "" if self.replica is None else f"[{self.replica}]"
        return f"{self.node.name}{idx}.{self.port}"


class _ReplicaView:
    def __init__(self, node: Node, replica: int) -> None:
        self._node = node
        self._replica = replica

    def __getattr__(self, port: str) -> PortRef:
        ref = self._node.__getattr__(port)
        return PortRef(ref.node, ref.port, self._replica)


class Node:
    """A reactor (or bank of replicas) in a graph. Attribute access gives its ports: ``node.out``."""

    def __init__(self, graph: Graph, prototype: Reactor, name: str, replicas: int, site: str) -> None:
        self._graph = graph
        self.prototype = prototype
        self.name = name
        self.replicas = replicas
        self.site = site

    @property
    def reactor_type(self) -> type[Reactor]:
        return type(self.prototype)

    def instance_names(self) -> list[str]:
        if self.replicas == 1:
            return [self.name]
        return [f"{self.name}[{i}]" for i in range(self.replicas)]

    def make_instance(self, replica: int) -> Reactor:
        """A fresh reactor for replica ``replica``, built from the prototype's constructor arguments.

        Every run gets fresh instances, so state never leaks from one run of a graph into the next.
        """
        args, kwargs = self.prototype._init_args
        return type(self.prototype)(*args, **kwargs)

    def __getattr__(self, port: str) -> PortRef:
        if port.startswith("_"):
            raise AttributeError(port)
        specs = self.reactor_type._port_specs
        if port not in specs or not isinstance(specs[port], (Input, Output)):
            ports = ", ".join(n for n, s in specs.items() if isinstance(s, (Input, Output)))
            raise GraphError(f"{self.name} ({self.reactor_type.__name__}) has no port {port!r}; its ports: {ports}")
        return PortRef(self, port)

    def __getitem__(self, replica: int) -> _ReplicaView:
        if not 0 <= replica < self.replicas:
            raise GraphError(f"{self.name} has {self.replicas} replicas; replica {replica} does not exist")
        return _ReplicaView(self, replica)

    def __repr__(self) -> str:
        return f"Node({self.name}, {self.reactor_type.__name__}, replicas={self.replicas})"


@dataclass(frozen=True)
class Connection:
    """A declared connection between two node ports (before bank expansion)."""

    src: PortRef
    dst: PortRef
    mode: str
    delay_ns: int
    key: Callable[[Any], int] | None
    site: str


@dataclass(frozen=True, order=True)
class Link:
    """One expanded replica-to-replica link. ``index`` is its rank in the canonical order."""

    src: str
    src_port: str
    dst: str
    dst_port: str
    delay_ns: int
    index: int = field(default=0, compare=False)
    connection: int = field(default=0, compare=False)


class Graph:
    """A fixed topology of reactors and connections.

    Example:
        >>> g = Graph()
        >>> src = g.add(Source(), name="src", replicas=2)
        >>> sink = g.add(Sink(), name="sink")
        >>> g.connect(src.out, sink.inp)
    """

    def __init__(self, *, stop_s: float | None = None) -> None:
        """Args:
        stop_s: logical time at which the run ends (None: when nothing is left to do, or on
            request_stop / signal). The CLI's ``--stop-s`` overrides it.
        """
        self.nodes: dict[str, Node] = {}
        self.connections: list[Connection] = []
        self.stop_ns: int | None = None if stop_s is None else seconds_to_ns(stop_s, "Graph stop_s")
        self._duplicate_errors: list[str] = []
        self._nlinks = 0  # (the replica-level links of ``connections``, bounded by MAX_LINKS)
        #: ``("module:qualname", arguments)`` of the :func:`graph_builder` that made this graph (None:
        #: built by hand): what the workers of a multi-process run without an app file rebuild it from.
        self.built_by: tuple[str, dict[str, Any]] | None = None
        #: (reactors, links) when the builder returned it: a graph changed after cannot be rebuilt from it.
        self.built_shape: tuple[int, int] | None = None

    def add(self, reactor: Reactor, *, name: str | None = None, replicas: int = 1) -> Node:
        """Add a reactor, or a bank of ``replicas`` copies built from its constructor arguments.

        Raises:
            GraphError: ``reactor`` is not a Reactor instance, the name is malformed, or
                ``replicas`` is not in [1, ``MAX_REPLICAS``]. A duplicate name is reported by ``validate()``.
        """
        site = _caller_site()
        if not isinstance(reactor, Reactor):
            raise GraphError(f"Graph.add expects a Reactor instance, got {type(reactor).__name__} ({site})")
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise GraphError(f"replicas must be an int >= 1, got {replicas!r} ({site})")
        if replicas > MAX_REPLICAS:
            raise GraphError(f"replicas must be at most {MAX_REPLICAS:,}, got {replicas!r} ({site})")
        name = name or type(reactor).__name__.lower()
        if not isinstance(name, str):
            raise GraphError(f"reactor name must be a str, got {type(name).__name__} {name!r:.100} ({site})")
        if not _NAME_RE.match(name):
            raise GraphError(f"reactor name {name!r} must match {_NAME_RE.pattern} ({site})")
        node = Node(self, reactor, name, replicas, site)
        if name in self.nodes:
            self._duplicate_errors.append(
                f"duplicate reactor name {name!r}: added at {self.nodes[name].site} and again at {site}"
            )
            return node
        self.nodes[name] = node
        return node

    def connect(
        self,
        src: PortRef,
        dst: PortRef,
        *,
        mode: str | None = None,
        delay_s: float = 0.0,
        key: Callable[[Any], int] | None = None,
    ) -> None:
        """Connect an output to an input.

        Banks: ``mode`` says how messages from ``src`` replicas reach ``dst`` replicas:
        ``broadcast`` (every message to every replica; the default), ``round_robin`` (message k of
        source replica i goes to replica (i + k) % M), ``one_to_one`` (replica i to replica i; sizes
        must match) or ``keyed`` (to replica ``key(message) % M``). Several connections into one
        input fan in; one output may fan out to several inputs.

        Args:
            delay_s: logical delay; 0 delivers at the next microstep of the sender's tag.

        Raises:
            GraphError: either side is not a port reference of this graph, the direction is wrong,
                the mode is unknown or inconsistent with its arguments, or the graph would have more
                than ``MAX_LINKS`` replica-level links.
        """
        site = _caller_site()
        for ref, what in ((src, "source"), (dst, "destination")):
            if not isinstance(ref, PortRef):
                raise GraphError(f"connect {what} must be a node port like node.out, got {ref!r} ({site})")
            if ref.node._graph is not self:
                raise GraphError(f"connect {what} {ref!r} belongs to another graph ({site})")
        if not isinstance(src.node.reactor_type._port_specs[src.port], Output):
            raise GraphError(f"connect source {src!r} is an input; connect an output to an input ({site})")
        if not isinstance(dst.node.reactor_type._port_specs[dst.port], Input):
            raise GraphError(f"connect destination {dst!r} is an output; connect an output to an input ({site})")
        mode = mode or ("keyed" if key is not None else "broadcast")
        if mode not in MODES:
            raise GraphError(f"unknown connection mode {mode!r} for {src!r} -> {dst!r}; use one of {MODES} ({site})")
        if (mode == "keyed") != (key is not None):
            raise GraphError(f"mode 'keyed' and key=... go together ({src!r} -> {dst!r}, {site})")
        src_n = 1 if src.replica is not None else src.node.replicas
        dst_n = 1 if dst.replica is not None else dst.node.replicas
        if mode == "one_to_one" and src_n != dst_n:
            raise GraphError(
                f"one_to_one needs equal bank sizes: {src!r} has {src_n}, {dst!r} has {dst_n} ({site})"
            )
        delay_ns = seconds_to_ns(delay_s, f"delay_s of {src!r} -> {dst!r}")
        n = src_n if mode == "one_to_one" else src_n * dst_n
        if self._nlinks + n > MAX_LINKS:
            raise GraphError(
                f"{src!r} -> {dst!r} ({mode}) makes {n:,} replica-level links ({src_n:,} x {dst_n:,}), the graph "
                f"{self._nlinks + n:,} in all, past the {MAX_LINKS:,} a graph may have ({site})"
            )
        self._nlinks += n
        self.connections.append(Connection(src, dst, mode, delay_ns, key, site))

    # ----------------------------------------------------------------------------------------
    # expansion and validation

    def instances(self) -> Iterator[tuple[Node, int, str]]:
        """Every reactor instance: (node, replica index, full name), in insertion order."""
        for node in self.nodes.values():
            for i, n in enumerate(node.instance_names()):
                yield node, i, n

    def links(self) -> list[Link]:
        """Every replica-level link, sorted in the canonical order that ranks simultaneous messages."""
        out: list[Link] = []
        for ci, c in enumerate(self.connections):
            srcs = _names(c.src)
            dsts = _names(c.dst)
            if c.mode == "one_to_one":
                pairs = list(zip(srcs, dsts))
            else:
                pairs = [(s, d) for s in srcs for d in dsts]
            for s, d in pairs:
                out.append(Link(s, c.src.port, d, c.dst.port, c.delay_ns, connection=ci))
        out.sort()
        return [Link(lk.src, lk.src_port, lk.dst, lk.dst_port, lk.delay_ns, i, lk.connection) for i, lk in enumerate(out)]

    def validate(self) -> None:
        """Check the topology. Raises ``GraphError`` listing every problem found, each with its site.

        Checks: duplicate names; unconnected required inputs; payload type mismatches between an
        output and the inputs it feeds; cycles made only of zero-delay connections (they would
        never let logical time advance, and make the order of events ill-defined).
        """
        problems = list(self._duplicate_errors)
        # Two instances with one plain name (``w[1]`` of a bank and a reactor named ``w-1``) would share
        # a process group, their files in the run directory, shared-memory regions and metric tags.
        plain: dict[str, str] = {}
        for node in self.nodes.values():
            for inst in node.instance_names():
                other = plain.setdefault(plain_name(inst), inst)
                if other != inst:
                    problems.append(f"reactors {other!r} and {inst!r} have one plain name {plain_name(inst)!r} (the "
                                    f"name of their process, run-directory files and metric tags); rename "
                                    f"{node.name!r} ({node.site})")
        if not self.nodes:
            problems.append("the graph has no reactors; add some with graph.add(...)")
        connected: set[tuple[str, str]] = set()
        for c in self.connections:
            connected.add((c.dst.node.name, c.dst.port))
            out_t = c.src.node.reactor_type._port_specs[c.src.port].type  # type: ignore[attr-defined]
            in_t = c.dst.node.reactor_type._port_specs[c.dst.port].type  # type: ignore[attr-defined]
            if not _type_compatible(out_t, in_t):
                problems.append(
                    f"{c.dst.node.name}.{c.dst.port} expects {_tname(in_t)}, got {_tname(out_t)} from "
                    f"{c.src.node.name}.{c.src.port} ({c.site})"
                )
        for node in self.nodes.values():
            for pname, spec in node.reactor_type._port_specs.items():
                if isinstance(spec, Input) and spec.required and (node.name, pname) not in connected:
                    problems.append(
                        f"{node.name}.{pname} is a required input of {node.reactor_type.__name__} but nothing "
                        f"is connected to it ({node.site})"
                    )
        cycle = self._zero_delay_cycle()
        if cycle:
            hops = " -> ".join(f"{c.src.node.name}.{c.src.port}" for c in cycle)
            problems.append(
                f"zero-delay cycle: {hops} -> {cycle[0].src.node.name}; give one connection a delay_s > 0 "
                f"({cycle[0].site})"
            )
        if problems:
            raise GraphError("invalid graph:\n  " + "\n  ".join(problems))

    def _zero_delay_cycle(self) -> list[Connection] | None:
        """A cycle of zero-delay connections at node level, if any (conservative for banks)."""
        adj: dict[str, list[Connection]] = {n: [] for n in self.nodes}
        for c in self.connections:
            if c.delay_ns == 0:
                adj[c.src.node.name].append(c)
        color: dict[str, int] = dict.fromkeys(self.nodes, 0)
        stack: list[Connection] = []

        def visit(n: str) -> list[Connection] | None:
            color[n] = 1
            for c in adj[n]:
                m = c.dst.node.name
                stack.append(c)
                if color[m] == 1:
                    start = next(i for i, s in enumerate(stack) if s.src.node.name == m)
                    return stack[start:]
                if color[m] == 0:
                    found = visit(m)
                    if found:
                        return found
                stack.pop()
            color[n] = 2
            return None

        for n in self.nodes:
            if color[n] == 0:
                found = visit(n)
                if found:
                    return found
        return None

    # ----------------------------------------------------------------------------------------
    # rendering

    def describe(self) -> str:
        """The topology as plain text: nodes with their ports, then connections."""
        lines = ["reactors:"]
        for node in self.nodes.values():
            specs = node.reactor_type._port_specs
            ins = ", ".join(f"{n}: {_tname(s.type)}" for n, s in specs.items() if isinstance(s, Input))
            outs = ", ".join(f"{n}: {_tname(s.type)}" for n, s in specs.items() if isinstance(s, Output))
            bank = f" x{node.replicas}" if node.replicas > 1 else ""
            lines.append(f"  {node.name}{bank} ({node.reactor_type.__name__})  in[{ins}]  out[{outs}]")
        lines.append("connections:")
        for c in self.connections:
            extra = [c.mode] + ([f"delay {c.delay_ns / 1e9:g}s"] if c.delay_ns else [])
            lines.append(f"  {c.src!r} -> {c.dst!r}  ({', '.join(extra)})")
        return "\n".join(lines)

    def mermaid(self) -> str:
        """The topology as a Mermaid flowchart."""
        lines = ["flowchart LR"]
        for node in self.nodes.values():
            bank = f" x{node.replicas}" if node.replicas > 1 else ""
            lines.append(f'  {_mid(node.name)}["{node.name}{bank}<br/>{node.reactor_type.__name__}"]')
        for c in self.connections:
            label = f"{c.src.port} → {c.dst.port}"
            if c.mode != "broadcast":
                label += f" ({c.mode})"
            if c.delay_ns:
                label += f" +{c.delay_ns / 1e9:g}s"
            lines.append(f'  {_mid(c.src.node.name)} -->|"{label}"| {_mid(c.dst.node.name)}')
        return "\n".join(lines)


def plain_name(instance: str) -> str:
    """An instance's name with its replica index as ``-i`` (``actor[3]`` -> ``actor-3``): the name of its
    process group, its files and directories in a run directory, its TensorBoard tags."""
    return instance.replace("[", "-").replace("]", "")


def _names(ref: PortRef) -> list[str]:
    names = ref.node.instance_names()
    return names if ref.replica is None else [names[ref.replica]]


def _mid(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


def _tname(t: Any) -> str:
    return getattr(t, "__name__", None) or repr(t)


def _type_compatible(out_t: Any, in_t: Any) -> bool:
    if in_t is object or in_t is Any or out_t is Any:
        return True
    if out_t is object:
        return False
    in_o, out_o = typing.get_origin(in_t) or in_t, typing.get_origin(out_t) or out_t
    if isinstance(in_o, type) and isinstance(out_o, type):
        try:
            sub = issubclass(out_o, in_o)
        except TypeError:  # (a Protocol that is not runtime_checkable: only itself fits)
            return out_t is in_t
        return sub and (typing.get_origin(in_t) is None or typing.get_args(in_t) == typing.get_args(out_t) or not typing.get_args(out_t))
    return bool(in_t == out_t)


F = typing.TypeVar("F", bound=Callable[..., Any])


def plain_scalars(value: Any, depth: int = 0) -> Any:
    """``value`` with each numpy scalar of a number, a bool or a string as the Python value it holds
    (a sweep's ``np.linspace`` gives ``np.float64``, a seed from ``rng.integers`` ``np.int64``), inside
    lists, tuples and dicts too; a ``pathlib`` path (a ``run_dir``) as its string, the workers' data; anything
    else as is (a numpy array too: what takes it checks it)."""
    if isinstance(value, PurePath):  # (it ran under "single", and was refused under "actors": not plain data)
        return str(value)
    np = sys.modules.get("numpy")
    if np is None:  # (no numpy imported: no numpy scalar exists, and core imports none)
        return value
    if isinstance(value, np.generic) and value.dtype.kind in "biufU":
        return value.item()
    if depth > 16:
        return value
    if type(value) in (list, tuple):
        return type(value)(plain_scalars(x, depth + 1) for x in value)
    if type(value) is dict:
        return {k: plain_scalars(x, depth + 1) for k, x in value.items()}
    return value


def graph_builder(fn: F) -> F:
    """Mark a function that returns a :class:`Graph` as a builder: the graph remembers the function
    and its arguments (``Graph.built_by``), so ``reactor.run(graph, placement="actors")`` can start
    workers in other processes (or on other hosts) that rebuild the same graph, with no app file.

    The function must be importable by its module and name (not defined in ``__main__``, a script or
    a notebook), and its arguments plain values (numbers, strings, booleans, None, lists, tuples and
    dicts of them; tuples arrive as lists): they cross to the workers as data, never pickled. Both are
    checked when a multi-process run starts, and so is that the graph was not changed after. A numpy
    scalar argument (a sweep's ``np.int64``), alone or inside a list, tuple or dict, reaches the
    function as the Python value it holds (:func:`plain_scalars`), here as in every worker; so does a
    ``pathlib`` path, as its string.

    Example:
        >>> @graph_builder
        ... def pipeline(*, producers: int = 2) -> Graph: ...
    """
    import functools
    import inspect

    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def build(*args: Any, **kwargs: Any) -> Any:
        # (a builder's own checks, "an int >= 1", refused np.int64(2), which its workers get as 2)
        args = tuple(plain_scalars(a) for a in args)
        kwargs = {k: plain_scalars(v) for k, v in kwargs.items()}
        graph = fn(*args, **kwargs)
        if isinstance(graph, Graph):
            bound = signature.bind(*args, **kwargs)
            named: dict[str, Any] = {}
            rebuildable = True
            for key, value in bound.arguments.items():
                kind = signature.parameters[key].kind
                if kind is inspect.Parameter.VAR_KEYWORD:
                    named.update(value)
                elif kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.POSITIONAL_ONLY):
                    rebuildable = False  # workers call the builder with keywords only
                else:
                    named[key] = value
            graph.built_by = (f"{fn.__module__}:{fn.__qualname__}", named) if rebuildable else None
            graph.built_shape = (len(graph.nodes), len(graph.connections))
        return graph

    return typing.cast(F, build)
