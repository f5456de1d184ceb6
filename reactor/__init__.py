"""reactor: a runtime for distributed reinforcement learning.

Layer map (imports point only downwards; tests/test_layers.py enforces it):

    apps/*.py              user app files: build(config) -> Graph, nothing else
    reactor/cli/           the `reactor` command (run, graph, trace, plot, eval; keys, daemon, submit, ...)
    reactor/nodes/         ready-made reactors (Replay, EnvActor, Learner, ...)
    reactor/algos/         RL algorithms as plain functions over tensors
    reactor/launch/        placement, policies, run(), coordinator, workers, their protocol
    reactor/replay/        replay engine, no networking, no runtime
    reactor/transport/     how bytes move (codec, ZeroMQ endpoint, bulk regions); knows no RL
    core                   _errors, _tag, _reactor, _graph, _scheduler, _trace, _native, _files, _floodlog, _runclaim

This module is the public API: every public name is re-exported here exactly once.
"""

from __future__ import annotations

from ._errors import FrameTooLargeError as FrameTooLargeError
from ._errors import GraphError as GraphError
from ._errors import LinkStateError as LinkStateError
from ._errors import MalformedFrameError as MalformedFrameError
from ._errors import PeerLostError as PeerLostError
from ._errors import PortClosedError as PortClosedError
from ._errors import PortError as PortError
from ._errors import ReactorError as ReactorError
from ._errors import ReactorInternalError as ReactorInternalError
from ._errors import TraceMismatchError as TraceMismatchError
from ._errors import WorkerFailedError as WorkerFailedError
from ._errors import WouldBlock as WouldBlock
from ._graph import Graph as Graph
from ._graph import Node as Node
from ._graph import graph_builder as graph_builder
from ._reactor import Action as Action
from ._reactor import Input as Input
from ._reactor import Output as Output
from ._reactor import PeerChange as PeerChange
from ._reactor import Reactor as Reactor
from ._reactor import Timer as Timer
from ._reactor import peer_lost as peer_lost
from ._reactor import peer_restarted as peer_restarted
from ._reactor import reaction as reaction
from ._reactor import shutdown as shutdown
from ._reactor import startup as startup
from ._tag import Tag as Tag
from .launch._result import RunResult as RunResult
from .launch._runtime import current_run_id as current_run_id
from .launch._runtime import run as run
from .launch._runtime import run_async as run_async
from .nodes._policy import load_policy as load_policy

__version__ = "0.1.0"
