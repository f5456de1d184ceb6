"""CURVE key material for the ZeroMQ endpoint: a key pair, its files, the ZAP check of client keys,
and which links of a job are encrypted (:func:`link_key`)."""

from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass

import zmq

from .._files import read_small

__all__ = ["CurveKeys", "link_key"]


@dataclass(frozen=True, repr=False)
class CurveKeys:
    """A CURVE key pair, both halves as 40-byte Z85 text.

    One pair per process (or one per job, shared by its processes): an endpoint uses it as server
    key pair on its ROUTER and as client key pair on its DEALERs.

    Example::

        keys = CurveKeys.generate()
        keys.save("job.key")                # public and secret, mode 0600
        keys.save_public("job.key.pub")     # what peers need
        ep = await Endpoint.open("learner", "tcp://0.0.0.0:*", curve=keys)
    """

    public: bytes
    secret: bytes

    def __post_init__(self) -> None:
        for field in ("public", "secret"):
            value = getattr(self, field)
            if not isinstance(value, bytes) or len(value) != 40:
                raise ValueError(
                    f"CurveKeys.{field} must be 40 bytes of Z85 text, got "
                    f"{type(value).__name__} of length {len(value) if hasattr(value, '__len__') else '?'}"
                )
        try:
            derived = zmq.curve_public(self.secret)
        except (zmq.ZMQError, ValueError) as exc:
            raise ValueError(f"CurveKeys.secret is not a valid Z85 CURVE secret key: {exc}") from None
        if derived != self.public:
            raise ValueError("CurveKeys.public does not belong to CurveKeys.secret; load both from one file")

    def __repr__(self) -> str:
        return f"CurveKeys(public={self.public.decode()!r}, secret=<hidden>)"

    @classmethod
    def generate(cls) -> CurveKeys:
        """Return a fresh key pair (``zmq.curve_keypair``)."""
        public, secret = zmq.curve_keypair()
        return cls(public=public, secret=secret)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write both keys to ``path`` as Z85 text (``public = ...``, ``secret = ...``), mode 0600.

        Raises:
            FileExistsError: ``path`` exists (a secret is never overwritten silently).
        """
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"public = {self.public.decode()}\nsecret = {self.secret.decode()}\n")

    def save_public(self, path: str | os.PathLike[str]) -> None:
        """Write only the public key to ``path`` (``public = ...``); this is what peers are given."""
        write_public(path, self.public)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CurveKeys:
        """Read a key pair written by :meth:`save`.

        Raises:
            ValueError: the file lacks a ``public`` or ``secret`` line, or the keys are invalid.
        """
        fields = _read_key_file(path)
        if "public" not in fields or "secret" not in fields:
            raise ValueError(f"{path}: a key pair file needs 'public = ...' and 'secret = ...' lines")
        try:
            return cls(public=fields["public"], secret=fields["secret"])
        except ValueError as e:  # (which file: a truncated or mismatched pair was the keys' words alone)
            raise ValueError(f"{os.fspath(path)}: {e}") from None

    @staticmethod
    def load_public(path: str | os.PathLike[str]) -> bytes:
        """Read the public key from a file written by :meth:`save_public`.

        Raises:
            ValueError: the file lacks a valid ``public = ...`` line, or it holds a secret too (a key
                pair is not a peer's key: named as one, it was shipped with a submitted job).
        """
        fields = _read_key_file(path)
        if "secret" in fields:  # (named as a peer's key, it would travel: a submitted job ships such files)
            raise ValueError(f"{os.fspath(path)} holds a secret key (it is a key pair): give its public half, the "
                             f"key.pub beside it, which is what peers are given")
        key = fields.get("public")
        if key is None or len(key) != 40:
            raise ValueError(f"{path}: expected a line 'public = <40 characters of Z85>'")
        return key

    @staticmethod
    def holds_secret(path: str | os.PathLike[str]) -> bool:
        """Whether the key file at ``path`` has a ``secret = ...`` line (False if it cannot be read:
        its reader says why)."""
        try:
            return "secret" in _read_key_file(path)
        except (OSError, ValueError):
            return False


def write_public(path: str | os.PathLike[str], public: bytes) -> None:
    """Write a public key to ``path`` as :meth:`CurveKeys.save_public` does: mode 0644 whatever the umask
    (a daemon ignores an authorized key others could write: a umask of 0002 made it 0664), never
    through a link."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o644)
        f.write(f"public = {public.decode()}\n")


def _read_key_file(path: str | os.PathLike[str]) -> dict[str, bytes]:
    fields: dict[str, bytes] = {}
    try:
        text = read_small(path, 1 << 16).decode()  # (a FIFO among the authorized keys hung every handshake)
    except UnicodeDecodeError:
        raise ValueError(f"{os.fspath(path)}: not a text file") from None
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise ValueError(f"{path}:{lineno}: expected 'name = value', got {line!r:.60}")
        fields[key.strip()] = value.strip().encode()
    return fields


class _AllowedKeys:
    """ZAP credentials provider: admits exactly the given client public keys (Z85)."""

    def __init__(self, keys: Collection[bytes]) -> None:
        self.keys = frozenset(keys)

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


def _is_local(address: str) -> bool:
    return address.startswith(("ipc://", "inproc://"))


def link_key(keys: CurveKeys | None, address: str) -> bytes | None:
    """The ``server_public_key`` for a link to a job's endpoint at ``address``: the job's public key
    when the address is tcp (those endpoints are CURVE servers), None for a local one (``ipc://``,
    ``inproc://``: opened with ``curve_local=False``, plain) or a job without keys."""
    return None if keys is None or _is_local(address) else keys.public
