"""How bytes move between processes and hosts. Knows nothing of RL.

- :mod:`reactor.transport.codec`: the one framing core (msgpack + zero-copy array frames).
- :class:`Endpoint`: the ZeroMQ control transport (one ROUTER per process, a DEALER per peer),
  with credit-based flow control, CURVE authentication and peer-failure detection.
"""

from __future__ import annotations

from ._zmq import CurveKeys as CurveKeys
from ._zmq import Endpoint as Endpoint
from ._zmq import EndpointStatistics as EndpointStatistics
from .codec import decode as decode
from .codec import encode as encode
from .codec import register_message as register_message

__all__ = ["CurveKeys", "Endpoint", "EndpointStatistics", "decode", "encode", "register_message"]
