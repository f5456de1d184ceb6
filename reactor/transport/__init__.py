"""How bytes move between processes and hosts. Knows nothing of RL.

- :mod:`reactor.transport.codec`: the one framing core (msgpack + zero-copy array frames).
- :class:`Endpoint`: the ZeroMQ control transport (one ROUTER per process, or a tcp and an ipc one
  over hosts; a DEALER per peer), with credit-based flow control, CURVE authentication
  (``_curve.py``) and peer-failure detection; its sending half is ``_zmqsend.py``, its receiving half
  ``_zmqreceive.py``.
- :mod:`reactor.transport.bulk`: one-sided bulk regions (:class:`BulkOwner` allocates and serves
  them, :class:`BulkReader` gathers rows from them) over shared memory, ZeroMQ or RDMA. Imported
  on first use (it needs torch and numba, which the control transport does not pay for).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._zmq import CurveKeys as CurveKeys
from ._zmq import Endpoint as Endpoint
from ._zmq import EndpointStatistics as EndpointStatistics
from ._zmq import link_key as link_key
from .codec import decode as decode
from .codec import encode as encode
from .codec import register_message as register_message

if TYPE_CHECKING:
    from .bulk import BulkOwner as BulkOwner
    from .bulk import BulkReader as BulkReader

__all__ = [
    "BulkOwner",
    "BulkReader",
    "CurveKeys",
    "Endpoint",
    "EndpointStatistics",
    "decode",
    "encode",
    "register_message",
]


def __getattr__(name: str) -> Any:
    if name in ("BulkOwner", "BulkReader"):
        from . import bulk

        return getattr(bulk, name)
    raise AttributeError(f"module 'reactor.transport' has no attribute {name!r}")
