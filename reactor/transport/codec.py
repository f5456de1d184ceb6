"""The one framing core: objects to zmq frames and back, with msgpack and zero-copy array frames.

A message is a list of frames. Frame 0 is msgpack. Every other frame is the raw bytes of one array.
msgpack carries the plain types natively (``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``,
``list``, ``dict``) and the rest as extension types:

======  ===================  ==========================================================================
code    Python type          payload (msgpack)
======  ===================  ==========================================================================
1       ``numpy.ndarray``    ``[dtype, shape, data]``: ``data`` is a frame index (int) or, for arrays
                             under :data:`INLINE_MAX_NBYTES`, the bytes themselves (one frame per tiny
                             array would cost more than the copy)
2       ``torch.Tensor``     same as 1; CPU tensors only, ``bfloat16`` included
3       ``tuple``            the items, as a msgpack array (so ``(time, microstep)`` tags stay tuples)
4       registered message   ``[type name, [field values in declaration order]]``
5       numpy scalar         ``[dtype, bytes]``
======  ===================  ==========================================================================

Arrays are little-endian C-contiguous on the wire; non-contiguous or byte-swapped arrays are made so
(one copy), contiguous ones travel as a ``memoryview`` of their own buffer (no copy). Nothing is ever
pickled: decoding builds only the types above and classes registered with :func:`register_message`.

A *batch* carries several frame-less messages (messages that encoded to frame 0 alone) in one frame:
the byte :data:`BATCH_MARKER` (``0xc1``, the one byte msgpack never uses, so no single message starts
with it), then a msgpack array whose items are the messages' frame-0 bytes, verbatim (an array header
followed by complete msgpack objects is itself one msgpack array). :func:`encode_batch` builds one
from frame-0 payloads without re-encoding them; :func:`decode_batch` decodes all of it in one
``unpackb``. Messages with array frames are never batched: their frames stay zero-copy.

Example::

    frames = encode({"tag": (10, 0), "obs": np.zeros((4, 84), np.uint8)})
    obj = decode(frames, max_nbytes=2**20)
"""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import math
import operator
import struct
import sys
import threading
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgpack
import numpy as np

from reactor._errors import FrameTooLargeError, MalformedFrameError

__all__ = [
    "BATCH_MARKER",
    "INLINE_MAX_NBYTES",
    "MAX_EXT_DEPTH",
    "MAX_NDIM",
    "batch_header",
    "decode",
    "decode_batch",
    "encode",
    "encode_batch",
    "frames_nbytes",
    "register_message",
    "registered_messages",
]

EXT_NDARRAY = 1
EXT_TENSOR = 2
EXT_TUPLE = 3
EXT_MESSAGE = 4
EXT_NPSCALAR = 5

#: Arrays smaller than this travel inside frame 0 instead of in a frame of their own. A message in
#: one frame can join the transport's per-tick batch, and below a few KiB the decode-side copy costs
#: less than a frame (4 KiB: a replay shard's plan of 64 windows is one frame; ~60 us a 4-shard round
#: less than with 1 KiB, measured with tests-like ping rounds through the runtime).
INLINE_MAX_NBYTES = 4096
#: The most dimensions a decoded array may have (numpy's own limit is 64).
MAX_NDIM = 32
#: The deepest nesting of extension types (tuples, messages) encoded or decoded.
MAX_EXT_DEPTH = 100
#: First byte of a batch frame (see the module docstring): msgpack's one never-used byte.
BATCH_MARKER = 0xC1

# dtype allow-list, by wire name. Only fixed-size numeric types: no object, string, void or datetime.
_NUMPY_DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(name)
    for name in (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    )
}
_TORCH_DTYPE_NAMES = (
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
)
_torch_by_name: dict[str, Any] = {}  # wire name -> torch.dtype, filled on first torch use
_torch_name_of: dict[Any, str] = {}  # torch.dtype -> wire name

_MESSAGES_BY_NAME: dict[str, tuple[type, tuple[str, ...]]] = {}
_MESSAGES_BY_TYPE: dict[type, tuple[str, tuple[str, ...]]] = {}

T = TypeVar("T", bound=type)


def _torch_tables() -> Any:
    """Import torch on first use (the transport must not pay torch's import time unless tensors flow)."""
    import torch

    if not _torch_by_name:
        for name in _TORCH_DTYPE_NAMES:
            dtype = getattr(torch, name, None)
            if dtype is not None:
                _torch_by_name[name] = dtype
                _torch_name_of[dtype] = name
    return torch


def register_message(cls: T) -> T:
    """Class decorator: let a frozen dataclass (or a ``NamedTuple``) cross the wire as itself.

    The class is registered under its qualified name ``module.QualName``; an instance encodes as that
    name and its field values in declaration order, and decodes by calling the class with those fields
    as keywords (so ``__post_init__`` validation runs on the receiving side too). Both processes must
    import the module that registers the class. Field values may be anything :func:`encode` accepts.

    Args:
        cls: a ``@dataclass(frozen=True)`` class, or a ``typing.NamedTuple`` subclass.

    Returns:
        ``cls`` itself, unchanged.

    Raises:
        TypeError: ``cls`` is not a frozen dataclass nor a NamedTuple.
        ValueError: another class is already registered under the same name.

    Example::

        @register_message
        @dataclass(frozen=True)
        class Weights:
            version: int
            params: dict[str, torch.Tensor]
    """
    if dataclasses.is_dataclass(cls) and isinstance(cls, type):
        params = getattr(cls, "__dataclass_params__", None)
        if params is None or not params.frozen:
            raise TypeError(
                f"register_message({cls.__qualname__}): the dataclass must be frozen; "
                f"declare it with @dataclass(frozen=True)"
            )
        fields = tuple(f.name for f in dataclasses.fields(cls) if f.init)
        if len(fields) != len(dataclasses.fields(cls)):
            raise TypeError(
                f"register_message({cls.__qualname__}): every field must be an __init__ field "
                f"(field(init=False) cannot be rebuilt on the receiving side)"
            )
    elif isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields"):
        fields = tuple(cls._fields)
    else:
        raise TypeError(
            f"register_message expects a frozen dataclass or a NamedTuple class, got {cls!r}"
        )
    name = f"{cls.__module__}.{cls.__qualname__}"
    known = _MESSAGES_BY_NAME.get(name)
    if known is not None and known[0] is not cls:
        raise ValueError(
            f"register_message: the name {name!r} is already registered for another class "
            f"({known[0]!r}); give one of them another name or module"
        )
    _MESSAGES_BY_NAME[name] = (cls, fields)
    _MESSAGES_BY_TYPE[cls] = (name, fields)
    return cls


def registered_messages() -> dict[str, type]:
    """Return a copy of the registry: wire name -> class."""
    return {name: entry[0] for name, entry in _MESSAGES_BY_NAME.items()}


# ------------------------------------------------------------------------------------------ encoding


def _array_payload(
    dtype_name: str, shape: tuple[int, ...], flat: np.ndarray, frames: list[bytes | memoryview]
) -> list[Any]:
    """Header for one contiguous array viewed as uint8 ``flat``; appends its bytes as a frame if large."""
    if flat.nbytes < INLINE_MAX_NBYTES:
        return [dtype_name, list(shape), flat.tobytes()]
    frames.append(memoryview(flat))
    return [dtype_name, list(shape), len(frames) - 1]


def _ext(code: int, data: bytes) -> msgpack.ExtType:
    """``msgpack.ExtType(code, data)`` without its argument checks, which are Python code costing
    about as much as packing a small message (ours are always an int code and bytes)."""
    return tuple.__new__(msgpack.ExtType, (code, data))


_ENCODABLE = (
    "None, bool, int, float, str, bytes, list, tuple, dict, numpy arrays and scalars, CPU torch "
    "tensors, and classes decorated with @register_message"
)


class _Encoder:
    """Reusable msgpack packers (building a Packer per call costs more than packing a small message).

    One packer per nesting depth of extension payloads, because a Packer is not re-entrant. Instances
    are per thread (see :func:`encode`).
    """

    __slots__ = ("busy", "depth", "frames", "packers")

    def __init__(self) -> None:
        self.frames: list[bytes | memoryview] = []
        self.depth = 0
        self.busy = False
        self.packers: list[msgpack.Packer] = [msgpack.Packer(default=self.default, use_bin_type=True, strict_types=True)]

    def pack(self, obj: Any) -> bytes:
        """Pack ``obj`` with the packer of the current depth."""
        depth = self.depth
        packers = self.packers
        if depth >= len(packers):
            if depth > MAX_EXT_DEPTH:
                raise ValueError(f"cannot encode: tuples/messages nested deeper than {MAX_EXT_DEPTH} levels")
            packers.append(msgpack.Packer(default=self.default, use_bin_type=True, strict_types=True))
        self.depth = depth + 1
        try:
            return packers[depth].pack(obj)
        finally:
            self.depth = depth

    def default(self, obj: Any) -> Any:
        cls = type(obj)
        if cls is tuple:
            return _ext(EXT_TUPLE, self.pack(list(obj)))
        entry = _MESSAGES_BY_TYPE.get(cls)
        if entry is not None:
            name, fields = entry
            return _ext(EXT_MESSAGE, self.pack([name, [getattr(obj, f) for f in fields]]))
        if isinstance(obj, np.ndarray):
            return self.ndarray(obj)
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            return self.tensor(obj)
        if isinstance(obj, np.generic):
            arr = np.asarray(obj)
            if arr.dtype.name not in _NUMPY_DTYPES:
                raise TypeError(f"cannot encode a numpy scalar of dtype {arr.dtype!s}: the codec carries {_ENCODABLE}")
            return _ext(EXT_NPSCALAR, self.pack([arr.dtype.name, arr.astype(arr.dtype.newbyteorder("<")).tobytes()]))
        # Subclasses of the native types (strict_types sends them here) encode as their base type.
        for base in (bool, int, float, str, dict, list):
            if isinstance(obj, base):
                return base(obj)
        if isinstance(obj, (bytes, bytearray, memoryview)):
            return bytes(obj)
        if isinstance(obj, tuple):  # a NamedTuple that was not registered travels as a plain tuple
            return _ext(EXT_TUPLE, self.pack(list(obj)))
        raise TypeError(f"cannot encode an object of type {cls.__module__}.{cls.__qualname__}: the codec carries {_ENCODABLE}")

    def ndarray(self, arr: np.ndarray) -> msgpack.ExtType:
        name = arr.dtype.name
        if name not in _NUMPY_DTYPES or arr.dtype.byteorder == ">":
            if arr.dtype.kind in "biufc" and arr.dtype.newbyteorder("=").name in _NUMPY_DTYPES:
                arr = arr.astype(arr.dtype.newbyteorder("<"))
                name = arr.dtype.name
            else:
                raise TypeError(
                    f"cannot encode a numpy array of dtype {arr.dtype!s}: allowed dtypes are "
                    f"{', '.join(_NUMPY_DTYPES)}"
                )
        if not arr.flags.c_contiguous:
            arr = arr.copy(order="C")  # (np.ascontiguousarray would turn a 0-d array into 1-d)
        flat = arr.reshape(-1).view(np.uint8)
        return _ext(EXT_NDARRAY, self.pack(_array_payload(name, arr.shape, flat, self.frames)))

    def tensor(self, t: Any) -> msgpack.ExtType:
        torch = _torch_tables()
        if t.device.type != "cpu":
            raise TypeError(
                f"cannot encode a tensor on device {t.device}: the control transport carries CPU "
                f"tensors only; call .cpu() first (or use the bulk transport)"
            )
        name = _torch_name_of.get(t.dtype)
        if name is None:
            raise TypeError(
                f"cannot encode a tensor of dtype {t.dtype}: allowed dtypes are {', '.join(_torch_by_name)}"
            )
        if t.layout != torch.strided:
            raise TypeError(f"cannot encode a tensor with layout {t.layout}: call .to_dense() first")
        t = t.detach()
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        t = t.contiguous()
        flat = t.reshape(-1).view(torch.uint8).numpy()
        return _ext(EXT_TENSOR, self.pack(_array_payload(name, tuple(t.shape), flat, self.frames)))


_local = threading.local()


def encode(obj: Any) -> list[bytes | memoryview]:
    """Encode ``obj`` into zmq frames: msgpack in frame 0, then one frame per large array.

    Contiguous arrays and tensors are not copied: their frame is a ``memoryview`` of the object's
    own buffer, which therefore must not be modified until the frames have been sent (zmq reads a
    zero-copy frame when it writes to the socket, possibly after ``send`` returned). Thread-safe.

    Args:
        obj: any nesting of the types in the module docstring. Dict keys may be any encodable
            hashable value. ``bytearray``/``memoryview`` encode as ``bytes``; other subclasses of
            the native types as their base type; an unregistered ``NamedTuple`` as a plain tuple.

    Returns:
        The frames; ``frames[0]`` is ``bytes``, the others ``memoryview``.

    Raises:
        TypeError: an object (or array dtype, or tensor device) the codec does not carry, named.
        ValueError: nesting too deep, or an int outside the 64-bit range.
    """
    enc: _Encoder | None = getattr(_local, "encoder", None)
    if enc is None or enc.busy:  # busy: re-entered from a field getter; use a fresh one
        enc = _Encoder()
        if getattr(_local, "encoder", None) is None:
            _local.encoder = enc
    frames: list[bytes | memoryview] = [b""]
    enc.frames = frames
    enc.busy = True
    enc.depth = 1  # what pack() does, inlined: the top level is packed by packers[0]
    try:
        frames[0] = enc.packers[0].pack(obj)
    except OverflowError as exc:
        raise ValueError(f"cannot encode an int outside the 64-bit range: {exc}") from None
    except RecursionError:
        raise ValueError("cannot encode: the object is nested too deeply") from None
    except ValueError as exc:
        if "recursion limit" in str(exc):
            raise ValueError("cannot encode: the object is nested too deeply") from None
        raise
    finally:
        enc.busy = False
        enc.frames = []
        enc.depth = 0
    return frames


def encode_batch(payloads: Sequence[bytes]) -> bytes:
    """Join the frame-0 bytes of frame-less messages into one batch frame (no re-encoding).

    Args:
        payloads: ``encode(obj)[0]`` of each message, in order; each message must have encoded to
            that one frame (a batch cannot carry array frames).

    Returns:
        ``BATCH_MARKER``, a msgpack array header for ``len(payloads)`` items, then the payloads
        verbatim: at most 6 bytes more than the payloads together.

    Raises:
        ValueError: ``payloads`` is empty.

    Example::

        frame = encode_batch([encode(m)[0] for m in ("a", {"b": 1})])
        assert decode_batch(frame, max_nbytes=2**20) == ["a", {"b": 1}]
    """
    n = len(payloads)
    if n < 16:
        if n == 0:
            raise ValueError("encode_batch: a batch holds at least one message, got none")
        head = bytes((BATCH_MARKER, 0x90 | n))  # fixarray
    elif n < 1 << 16:
        head = struct.pack(">BBH", BATCH_MARKER, 0xDC, n)  # array 16
    else:
        head = struct.pack(">BBI", BATCH_MARKER, 0xDD, n)  # array 32
    return b"".join((head, *payloads))


def frames_nbytes(frames: Sequence[Any]) -> int:
    """Total size in bytes of a list of frames (bytes, memoryviews, zmq.Frames or other buffers)."""
    total = 0
    for f in frames:
        total += f.nbytes if isinstance(f, memoryview) else len(f)
    return total


# ------------------------------------------------------------------------------------------ decoding


def _check_shape(shape: Any, where: str) -> tuple[int, ...]:
    if type(shape) is not list or len(shape) > MAX_NDIM:
        raise MalformedFrameError(f"{where}: shape must be a list of at most {MAX_NDIM} ints, got {shape!r:.200}")
    for d in shape:
        if type(d) is not int or d < 0:
            raise MalformedFrameError(f"{where}: shape entries must be ints >= 0, got {shape!r:.200}")
    return tuple(shape)


def _unpack_payload(data: bytes, where: str) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, use_list=True)
    except Exception as exc:
        raise MalformedFrameError(f"{where}: undecodable header ({type(exc).__name__}: {exc})") from None


class _Decoder:
    """State of one decode call: the frames, which ones were used, and the ext hook."""

    __slots__ = ("depth", "frames", "large_maps", "used")

    def __init__(self, frames: Sequence[Any], *, large_maps: bool = False) -> None:
        self.frames = frames
        self.used = 0  # the last frame index used; indices must be 1, 2, 3, ... in order
        self.depth = 0
        # Maps of up to _MAP_CHECK_FROM entries are built by msgpack itself (no hook: the common case
        # costs nothing); a larger one raises _LargeMap, and the frame is decoded again with every
        # map built by _map_of, which checks its keys first (see _decode_one).
        self.large_maps = large_maps

    def _array_bytes(self, payload: Any, kind: str) -> tuple[str, tuple[int, ...], Any, bool]:
        if type(payload) is not list or len(payload) != 3:
            raise MalformedFrameError(f"{kind} header must be [dtype, shape, data], got {payload!r:.200}")
        dtype_name, shape, data = payload
        shape_t = _check_shape(shape, f"{kind} header")
        if type(dtype_name) is not str:
            raise MalformedFrameError(f"{kind} header: dtype must be a str, got {dtype_name!r:.100}")
        if type(data) is int:
            # Frames must be referenced in order, each exactly once: 1, 2, 3, ...
            if data != self.used + 1 or data >= len(self.frames):
                raise MalformedFrameError(
                    f"{kind} header refers to frame {data}, expected frame {self.used + 1} of "
                    f"{len(self.frames)} (frames must be used once each, in order)"
                )
            self.used = data
            frame = self.frames[data]
            buf = frame if isinstance(frame, (bytes, memoryview)) else memoryview(frame)
            return dtype_name, shape_t, buf, True
        if type(data) is bytes:
            return dtype_name, shape_t, data, False
        raise MalformedFrameError(f"{kind} header: data must be a frame index or bytes, got {type(data).__name__}")

    def _ndarray(self, payload: Any) -> np.ndarray:
        dtype_name, shape, buf, in_frame = self._array_bytes(payload, "ndarray")
        dtype = _NUMPY_DTYPES.get(dtype_name)
        if dtype is None:
            raise MalformedFrameError(
                f"ndarray header: dtype {dtype_name!r:.100} is not allowed (allowed: {', '.join(_NUMPY_DTYPES)})"
            )
        expected = math.prod(shape) * dtype.itemsize
        nbytes = buf.nbytes if isinstance(buf, memoryview) else len(buf)
        if nbytes != expected:
            raise MalformedFrameError(
                f"ndarray of dtype {dtype_name} and shape {list(shape)} needs {expected} bytes, "
                f"its data has {nbytes}"
            )
        arr = np.frombuffer(buf, dtype=dtype).reshape(shape)
        if not in_frame or not arr.flags.aligned:
            arr = arr.copy()  # inline bytes are read-only and tiny; unaligned data would be slow
        return arr

    def _tensor(self, payload: Any) -> Any:
        dtype_name, shape, buf, in_frame = self._array_bytes(payload, "tensor")
        if dtype_name not in _TORCH_DTYPE_NAMES:
            raise MalformedFrameError(
                f"tensor header: dtype {dtype_name!r:.100} is not allowed (allowed: {', '.join(_TORCH_DTYPE_NAMES)})"
            )
        torch = _torch_tables()
        dtype = _torch_by_name.get(dtype_name)
        if dtype is None:
            raise MalformedFrameError(f"tensor header: dtype {dtype_name} is not supported by this torch")
        itemsize = dtype.itemsize
        expected = math.prod(shape) * itemsize
        nbytes = buf.nbytes if isinstance(buf, memoryview) else len(buf)
        if nbytes != expected:
            raise MalformedFrameError(
                f"tensor of dtype {dtype_name} and shape {list(shape)} needs {expected} bytes, "
                f"its data has {nbytes}"
            )
        raw = np.frombuffer(buf, dtype=np.uint8)
        # torch.frombuffer warns on read-only buffers, and tensors are assumed writable: copy those,
        # and unaligned ones. A received zmq frame is writable and ours alone, so it is aliased.
        if not in_frame or not raw.flags.writeable or (expected and raw.ctypes.data % itemsize):
            raw = raw.copy()
        if expected == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.from_numpy(raw).view(dtype).reshape(shape)

    def _npscalar(self, payload: Any) -> Any:
        if type(payload) is not list or len(payload) != 2 or type(payload[1]) is not bytes:
            raise MalformedFrameError(f"numpy scalar header must be [dtype, bytes], got {payload!r:.200}")
        dtype = _NUMPY_DTYPES.get(payload[0]) if type(payload[0]) is str else None
        if dtype is None:
            raise MalformedFrameError(f"numpy scalar header: dtype {payload[0]!r:.100} is not allowed")
        if len(payload[1]) != dtype.itemsize:
            raise MalformedFrameError(
                f"numpy scalar of dtype {dtype.name} needs {dtype.itemsize} bytes, got {len(payload[1])}"
            )
        return np.frombuffer(payload[1], dtype=dtype)[0]

    def _message(self, data: bytes) -> Any:
        payload = self.unpack(data)
        if type(payload) is not list or len(payload) != 2 or type(payload[0]) is not str:
            raise MalformedFrameError(f"message header must be [name, fields], got {payload!r:.200}")
        name, values = payload
        entry = _MESSAGES_BY_NAME.get(name)
        if entry is None:
            raise MalformedFrameError(
                f"message type {name!r:.200} is not registered in this process; decorate the class "
                f"with @register_message and import its module on both sides"
            )
        cls, fields = entry
        if type(values) is not list or len(values) != len(fields):
            raise MalformedFrameError(
                f"message {name} has fields {list(fields)}, the frame carries "
                f"{len(values) if type(values) is list else type(values).__name__} values"
            )
        checks = _FIELD_CHECKS.get(cls)
        if checks is None:
            checks = _FIELD_CHECKS[cls] = _field_checks(cls, fields)
        for i, check, want in checks:  # (the fields whose declared type can be checked: a few each)
            if not check(values[i]):
                raise MalformedFrameError(f"message {name}: field {fields[i]} must be {want}, got "
                                          f"{type(values[i]).__name__}")
        try:
            return cls(**dict(zip(fields, values)))
        except Exception as exc:
            raise MalformedFrameError(f"message {name} rejected its fields: {type(exc).__name__}: {exc}") from None

    def ext_hook(self, code: int, data: bytes) -> Any:
        if code == EXT_TUPLE:  # the common one (every tag): unpack() inlined, a call less per tuple
            if self.depth >= MAX_EXT_DEPTH:
                raise MalformedFrameError(f"extension types nested deeper than {MAX_EXT_DEPTH} levels")
            self.depth += 1
            try:  # (self._unpackb(data), inlined: every tag is a tuple; a map past max_map_len raises
                # ValueError through the outer unpackb, which _unpackb turns into _LargeMap)
                if self.large_maps:
                    items = msgpack.unpackb(data, ext_hook=self.ext_hook, raw=False, strict_map_key=False,
                                            use_list=True, object_pairs_hook=_map_of)
                else:
                    items = msgpack.unpackb(data, ext_hook=self.ext_hook, raw=False, strict_map_key=False,
                                            use_list=True, max_map_len=_MAP_CHECK_FROM)
            finally:
                self.depth -= 1
            if type(items) is not list:
                raise MalformedFrameError(f"tuple payload must be an array, got {type(items).__name__}")
            return tuple(items)
        if code == EXT_NDARRAY:
            return self._ndarray(_unpack_payload(data, "ndarray"))
        if code == EXT_TENSOR:
            return self._tensor(_unpack_payload(data, "tensor"))
        if code == EXT_MESSAGE:
            return self._message(data)
        if code == EXT_NPSCALAR:
            return self._npscalar(_unpack_payload(data, "numpy scalar"))
        raise MalformedFrameError(f"unknown msgpack extension type {code}")

    def unpack(self, data: Any) -> Any:
        # Each nested extension re-enters the C unpacker; bound it before the C stack overflows.
        if self.depth >= MAX_EXT_DEPTH:
            raise MalformedFrameError(f"extension types nested deeper than {MAX_EXT_DEPTH} levels")
        self.depth += 1
        try:
            return self._unpackb(data)
        finally:
            self.depth -= 1

    def _unpackb(self, data: Any) -> Any:
        # (keywords spelled out: a call with **kwargs took ~1 us more a call)
        if self.large_maps:
            return msgpack.unpackb(data, ext_hook=self.ext_hook, raw=False, strict_map_key=False, use_list=True,
                                   object_pairs_hook=_map_of)
        try:
            return msgpack.unpackb(data, ext_hook=self.ext_hook, raw=False, strict_map_key=False, use_list=True,
                                   max_map_len=_MAP_CHECK_FROM)
        except ValueError as exc:
            if "max_map_len" in str(exc):
                raise _LargeMap() from None
            raise


class _LargeMap(Exception):  # noqa: N818 - a signal between _Decoder and _decode_one, never seen outside
    """A map larger than a first pass builds without checking its keys."""


def _decode_one(frames: Sequence[Any], data: Any) -> tuple[Any, _Decoder]:
    """``data`` decoded with ``frames`` as its array frames, and the decoder (its frames used). Most
    frames hold no map of more than ``_MAP_CHECK_FROM`` entries: one pass, msgpack building every
    dict. One that does is decoded again, each map through :func:`_map_of`."""
    dec = _Decoder(frames)
    try:
        return dec.unpack(data), dec
    except _LargeMap:
        dec = _Decoder(frames, large_maps=True)
        return dec.unpack(data), dec


_first = operator.itemgetter(0)
#: Maps of more entries than this are checked for keys sharing a hash before a dict is built of them;
#: no hash may be shared by more keys than this.
_MAP_CHECK_FROM = 32


def _map_of(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """A decoded map (msgpack's ``object_pairs_hook``). Keys may be tuples, and tuples of -1 and -2
    all share one hash (``hash(-1) == hash(-2)``): a map of thousands of such keys costs time
    quadratic in their number to build (a 300 KB frame held a loop for 4 s). So a larger map whose
    keys put more than ``_MAP_CHECK_FROM`` on one hash (never so among distinct keys a program
    makes; a repeated key counts too) is refused before any dict is built from it. Every pass here
    is in C (``Counter`` counts in C; no Python loop over the entries)."""
    if len(pairs) > _MAP_CHECK_FROM and len(set(map(hash, map(_first, pairs)))) < len(pairs):  # (distinct: the rule)
        most = max(collections.Counter(map(hash, map(_first, pairs))).values())
        if most > _MAP_CHECK_FROM:
            raise MalformedFrameError(f"a map of {len(pairs)} entries, {most} of whose keys share one hash "
                                      f"(a collision flood, or a repeated key)")
    return dict(pairs)


_FIELD_CHECKS: dict[type, tuple[tuple[int, Callable[[Any], bool], str], ...]] = {}


def _check_of(hint: Any) -> tuple[Callable[[Any], bool], str] | None:
    """A check of a value against a field's declared type, and its name; None where the type says
    nothing checkable (``Any``, a type variable, a string annotation that did not resolve). Containers
    are checked as containers (their items are the receiver's): a dict, a list, a tuple. A numpy
    scalar is an int, a float or a bool as a Python one is (senders compute fields with numpy)."""
    if hint is Any or hint is object:  # (Any is a class since Python 3.11, which isinstance refuses)
        return None
    if hint is int:  # (a bool is an int here, as in Python: the receiver's own checks say more)
        return (lambda v: isinstance(v, (int, np.integer))), "an int"
    if hint is float:
        return (lambda v: isinstance(v, (int, float, np.floating, np.integer))), "a number"
    if hint is bool:
        return (lambda v: type(v) is bool or isinstance(v, np.bool_)), "a bool"
    if hint in (str, bytes):
        return (lambda v: type(v) is hint), hint.__name__
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        parts = [_check_of(a) if a is not type(None) else ((lambda v: v is None), "None") for a in typing.get_args(hint)]
        if any(p is None for p in parts):
            return None
        checks = [p[0] for p in parts]  # type: ignore[index]
        name = " or ".join(p[1] for p in parts)  # type: ignore[index]
        if len(checks) == 2:  # (X | None, every union here: no generator per decoded field)
            first, second = checks
            return (lambda v: first(v) or second(v)), name
        return (lambda v: any(c(v) for c in checks)), name
    if origin is not None:
        hint = origin
    if hint in (dict, list, tuple) or hint in (collections.abc.Mapping, collections.abc.Sequence):
        base = {collections.abc.Mapping: dict, collections.abc.Sequence: (list, tuple)}.get(hint, hint)
        return (lambda v: isinstance(v, base)), getattr(hint, "__name__", str(hint))
    if isinstance(hint, type):
        return (lambda v: isinstance(v, hint)), hint.__name__
    return None


def _field_checks(cls: type, fields: tuple[str, ...]) -> tuple[tuple[int, Callable[[Any], bool], str], ...]:
    """The checks of a registered message's fields, from their declared types (resolved once per class;
    a class whose annotations do not resolve here is checked by its constructor alone)."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - e.g. a name imported only for type checkers
        return ()
    out = []
    for i, f in enumerate(fields):
        got = _check_of(hints.get(f, Any))
        if got is not None:
            out.append((i, *got))
    return tuple(out)


def decode(frames: Sequence[Any], *, max_nbytes: int) -> Any:
    """Decode frames made by :func:`encode`, validating everything.

    Checks, in order: at least one frame; total size ``<= max_nbytes``; frame 0 is valid msgpack with
    no trailing bytes; every extension type is known; array headers name an allowed dtype, a shape of
    non-negative ints, and data whose length matches; array frames are each used exactly once, in
    order; message types are registered and their constructor accepts the fields.

    Decoded arrays alias the frames they came from where that is safe (zero copy): a numpy array
    decoded from a writable buffer (such as a received ``zmq.Frame``) is a writable view of it, one
    decoded from a read-only buffer (``bytes``) is a read-only view; a torch tensor aliases writable
    buffers and copies read-only ones (torch assumes tensors are writable). Arrays under
    :data:`INLINE_MAX_NBYTES` travel inside frame 0 and are decoded as fresh, writable copies.

    Args:
        frames: the frames, as ``bytes``, ``memoryview``, ``zmq.Frame`` or any buffer.
        max_nbytes: the largest total size accepted (sum of all frame lengths).

    Returns:
        The decoded object.

    Raises:
        FrameTooLargeError: the frames total more than ``max_nbytes`` bytes.
        MalformedFrameError: anything else wrong, with a message naming what.
    """
    n = len(frames)
    if n == 0:
        raise MalformedFrameError("empty message: expected at least the msgpack frame")
    total = frames_nbytes(frames)
    if total > max_nbytes:
        raise FrameTooLargeError(f"message of {total} bytes in {n} frames exceeds the limit of {max_nbytes} bytes")
    try:
        obj, dec = _decode_one(frames, frames[0])
    except (MalformedFrameError, FrameTooLargeError):
        raise
    except Exception as exc:
        raise MalformedFrameError(f"frame 0 is not valid msgpack ({type(exc).__name__}: {exc})") from None
    if dec.used != n - 1:
        raise MalformedFrameError(f"message has {n} frames but its header uses only {dec.used + 1}")
    return obj


def batch_header(frame: bytes) -> tuple[int, int]:
    """Read a batch frame's header without decoding its messages.

    Args:
        frame: a frame starting with :data:`BATCH_MARKER`.

    Returns:
        ``(count, offset)``: how many messages the batch holds (at least one), and where the first
        one starts; the messages' own bytes total ``len(frame) - offset``.

    Raises:
        MalformedFrameError: no marker, or no msgpack array header of at least one item after it.
    """
    n = len(frame)
    kind = frame[1] if n > 1 and frame[0] == BATCH_MARKER else -1
    if 0x91 <= kind <= 0x9F:
        return kind & 0x0F, 2
    if kind == 0xDC and n >= 4:
        count, offset = struct.unpack_from(">H", frame, 2)[0], 4
    elif kind == 0xDD and n >= 6:
        count, offset = struct.unpack_from(">I", frame, 2)[0], 6
    else:
        raise MalformedFrameError(
            f"batch header must be 0x{BATCH_MARKER:02x} and a msgpack array header of at least one item, "
            f"got {bytes(frame[:6])!r}"
        )
    if count == 0:
        raise MalformedFrameError("batch header announces no messages")
    return count, offset


def decode_batch(frame: bytes, *, max_nbytes: int, refused: list[str] | None = None) -> list[Any]:
    """Decode every message of a batch frame made by :func:`encode_batch`, in one pass.

    Validates as :func:`decode` does, for each message. Without ``refused`` a batch is all or nothing:
    one bad message rejects the whole batch. With it, a bad message is left out and why is appended to
    ``refused``, the others kept (a batch is the sender's transport's choice, not a unit of its data);
    then only a batch whose own structure is bad (header, array, trailing bytes) is rejected whole.

    Args:
        frame: the batch frame.
        max_nbytes: the largest frame accepted.
        refused: where to say why each message left out was (None: reject the batch instead).

    Returns:
        The messages, in order; as many as :func:`batch_header` announces, less those refused.

    Raises:
        FrameTooLargeError: the frame is over ``max_nbytes`` bytes.
        MalformedFrameError: a bad header, a bad message (named; without ``refused``), trailing
            bytes, or a message that refers to an array frame (a batch has none).
    """
    if len(frame) > max_nbytes:
        raise FrameTooLargeError(f"batch of {len(frame)} bytes exceeds the limit of {max_nbytes} bytes")
    count, _ = batch_header(frame)
    try:  # (no array frames: a reference to one fails as out of range)
        objs, _ = _decode_one((frame,), memoryview(frame)[1:])
    except Exception as exc:
        if refused is not None:  # (rare: a bad message, or a bad batch) one message at a time
            return _decode_batch_items(frame, count, refused)
        if isinstance(exc, (MalformedFrameError, FrameTooLargeError)):
            raise
        raise MalformedFrameError(f"batch is not valid msgpack ({type(exc).__name__}: {exc})") from None
    if type(objs) is not list or len(objs) != count:  # cannot happen: unpackb read the same header
        raise MalformedFrameError(f"batch announces {count} messages but does not decode to as many")
    return objs


def _decode_batch_items(frame: bytes, count: int, refused: list[str]) -> list[Any]:
    """A batch's messages decoded one by one: its structure first (skipped over, nothing decoded), then
    each message on its own, those that fail left out with why."""
    body = memoryview(frame)[1:]
    walker = msgpack.Unpacker(max_buffer_size=max(len(body), 1))
    walker.feed(body)
    try:
        if walker.read_array_header() != count:
            raise ValueError(f"the array does not hold the {count} messages its header announces")
        bounds = [walker.tell()]
        for _ in range(count):
            walker.skip()
            bounds.append(walker.tell())
    except Exception as exc:
        raise MalformedFrameError(f"batch is not valid msgpack ({type(exc).__name__}: {exc})") from None
    if bounds[-1] != len(body):
        raise MalformedFrameError(f"batch has {len(body) - bounds[-1]} bytes after its {count} messages")
    objs = []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        try:
            objs.append(_decode_one((frame,), body[a:b])[0])
        except Exception as exc:
            why = str(exc) if isinstance(exc, MalformedFrameError) else f"not valid msgpack ({type(exc).__name__}: {exc})"
            refused.append(f"message {i + 1} of {count}: {why}")
    return objs
