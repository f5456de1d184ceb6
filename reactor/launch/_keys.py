"""CURVE keys for daemons and their clients, in the ssh model.

``reactor keys init DIR`` makes a key directory::

    DIR/key           this side's key pair (public and secret, mode 0600)
    DIR/key.pub       its public half: what the other side is given
    DIR/authorized/   public keys (``*.pub``) of the clients a daemon using DIR admits; ``self.pub``
                      first (one directory shared by a cluster's daemons and clients admits them all)

A daemon admits a client only if the client's public key is in its ``authorized/`` directory, read
at each handshake (adding or removing a file takes effect for the next connection, no restart). A
client needs the daemon's ``key.pub`` to connect (as ssh's known hosts).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ..transport import CurveKeys

__all__ = ["AuthorizedKeys", "default_keys_dir", "init_keys", "load_keys"]

log = logging.getLogger("reactor.keys")


def default_keys_dir() -> Path:
    """``$REACTOR_KEYS``, else ``~/.reactor/keys``."""
    return Path(os.environ.get("REACTOR_KEYS") or Path.home() / ".reactor" / "keys")


def init_keys(directory: str | os.PathLike[str]) -> CurveKeys:
    """Make a key directory (see the module docstring) and return its key pair.

    Raises:
        FileExistsError: the directory already holds a key (a secret is never overwritten).
        ValueError: the directory is inside another key directory's ``authorized/``.
    """
    d = Path(directory)
    for up in d.resolve().parents:  # (its secret would sit among the public keys a daemon admits)
        if up.name == "authorized" and (up.parent / "key").exists():
            raise ValueError(f"{d} is inside {up}, the authorized keys of key directory {up.parent}: make the key "
                             f"pair elsewhere, and copy its key.pub there")
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    if (d / "key").exists():
        raise FileExistsError(f"{d / 'key'} exists: this directory already has a key pair")
    keys = CurveKeys.generate()
    keys.save(d / "key")
    keys.save_public(d / "key.pub")
    (d / "authorized").mkdir(mode=0o700, exist_ok=True)
    # The pair admits itself: daemons and clients sharing one key directory (a cluster key) trust
    # each other, and a job's coordinator on a daemon reaches the daemons of its hosts with it.
    keys.save_public(d / "authorized" / "self.pub")
    return keys


def load_keys(directory: str | os.PathLike[str]) -> CurveKeys:
    """The key pair of a key directory.

    Raises:
        FileNotFoundError: no key there (naming ``reactor keys init``).
    """
    path = Path(directory) / "key"
    if not path.exists():
        where = ""
        if not os.environ.get("REACTOR_KEYS") and Path(directory) == Path.home() / ".reactor" / "keys":
            # (the default: a key directory made elsewhere, the cluster's, was most likely meant, and a new
            # pair here would be admitted by no daemon)
            where = " (the default key directory: name the one you made with --keys DIR or REACTOR_KEYS=DIR)"
        raise FileNotFoundError(f"no key pair at {path}{where}: make one with `reactor keys init {directory}`")
    return CurveKeys.load(path)


class AuthorizedKeys:
    """A ZAP credentials provider: admits the public keys in ``directory/*.pub``, read at each
    handshake; a rejected key is logged (once per key) with the directory to add it to."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self._logged: set[bytes] = set()
        self._bad_files: dict[str, str] = {}  # a file that would not load -> why, logged once until that changes

    def keys(self) -> set[bytes]:
        out = set()
        for path in sorted(self.directory.glob("*.pub")):
            try:
                out.add(CurveKeys.load_public(path))
            except (OSError, ValueError) as exc:
                # Once per file and reason, not at every handshake (a stranger's too).
                if self._bad_files.get(str(path)) != str(exc) and len(self._bad_files) < 1024:
                    self._bad_files[str(path)] = str(exc)
                    log.warning("ignored the authorized key file %s: %s", path, exc)
            else:
                self._bad_files.pop(str(path), None)
        return out

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys():
            return True
        if key not in self._logged and len(self._logged) < 1024:
            self._logged.add(key)
            log.warning("rejected a client whose key %s is not in %s", key.decode(errors="replace"), self.directory)
        return False
