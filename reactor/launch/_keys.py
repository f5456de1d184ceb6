"""CURVE keys for daemons and their clients, in the ssh model.

``reactor keys init DIR`` makes a key directory::

    DIR/key           this side's key pair (public and secret, mode 0600)
    DIR/key.pub       its public half: what the other side is given
    DIR/authorized/   public keys (``*.pub``) of the clients a daemon using DIR admits; ``self.pub``
                      first (one directory shared by a cluster's daemons and clients admits them all)

A daemon admits a client only if the client's public key is in its ``authorized/`` directory, read
at each handshake (adding or removing a file takes effect for the next connection, no restart). A
client needs the daemon's ``key.pub`` to connect (as ssh's known hosts).

Modes are checked as OpenSSH's ``StrictModes`` does (:func:`check_mode`): a key directory,
``authorized/`` or an authorized key that another user could write, or a secret of this user's another
user could read, is refused, naming the ``chmod`` (a 0777 ``authorized/`` let any local user add a key
and run jobs as the daemon's user). Each must belong to this user or root; the exceptions are
OpenSSH's and Kubernetes' (the owner's private group, a root-owned secret, a sticky key directory).
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from ..transport import CurveKeys

__all__ = ["AuthorizedKeys", "check_mode", "default_keys_dir", "init_keys", "load_keys"]

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
    (d / "authorized").mkdir(mode=0o700, exist_ok=True)
    for made in (d, d / "authorized"):  # (made under a umask of 0002, or before: no other user may write them)
        st = made.stat()
        if st.st_uid == os.geteuid() and st.st_mode & 0o022:
            made.chmod(stat.S_IMODE(st.st_mode) & ~0o022)
    if (d / "key").exists():
        raise FileExistsError(f"{d / 'key'} exists: this directory already has a key pair")
    for name in ("key.pub", "authorized/self.pub"):  # (written through a link: the file it points at replaced)
        if (d / name).is_symlink():
            raise FileExistsError(f"{d / name} is a symbolic link: remove it (a new key pair's files are not written "
                                  f"through links)")
    strangers = sorted(p.name for p in (d / "authorized").glob("*.pub") if p.name != "self.pub")
    if strangers:  # (a new pair in an old directory: the keys it admits were put there before, by someone)
        log.warning("%s already admits %d keys: %s; remove those you do not know", d / "authorized", len(strangers),
                    ", ".join(strangers[:10]) + (", ..." if len(strangers) > 10 else ""))
    keys = CurveKeys.generate()
    keys.save(d / "key")
    keys.save_public(d / "key.pub")
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
    check_mode(Path(directory), "the key directory", sticky_ok=True)
    check_mode(path, "the key pair", secret=True)
    return CurveKeys.load(path)


def check_mode(path: Path, what: str, *, secret: bool = False, sticky_ok: bool = False) -> None:
    """Refuse ``path`` (a key directory, ``authorized/``, a key file) if it belongs to another user than
    this one or root, or if others could write it, or read it when it holds a ``secret`` of this user's;
    ``sticky_ok``: a directory with the sticky bit may be writable by all. As OpenSSH: a group of the
    owner's alone (a user-private group, the default under a umask of 0002) may write, and a secret
    owned by root (a Kubernetes secret mounted for a pod's fsGroup, 0440) may be read by its group. Links
    are followed (a Kubernetes secret's files are links into its data directory).

    Raises:
        PermissionError: naming the path, its mode or owner, and the fix.
    """
    st = os.stat(path)
    if st.st_uid not in (0, os.geteuid()):
        raise PermissionError(f"{what} {path} belongs to uid {st.st_uid}, not to this user ({os.geteuid()}) or root: "
                              f"another user could change it")
    strict = secret and st.st_uid == os.geteuid()
    loose = st.st_mode & (0o077 if strict else 0o022)
    if loose == 0o020 and not strict and _private_group(st):  # (group-writable only, the owner's own group)
        loose = 0
    if loose and not (sticky_ok and st.st_mode & stat.S_ISVTX and not strict):
        how = "readable or writable by other users" if strict else "writable by other users"
        raise PermissionError(f"{what} {path} is {how} (mode {stat.S_IMODE(st.st_mode):04o}): "
                              f"chmod {'600' if strict else 'go-w'} {path}")


def _private_group(st: os.stat_result) -> bool:
    """Whether the file's group is its owner's alone: named after the owner, with no other member."""
    import grp
    import pwd

    try:
        owner, group = pwd.getpwuid(st.st_uid).pw_name, grp.getgrgid(st.st_gid)
    except KeyError:
        return False
    return group.gr_name == owner and set(group.gr_mem) <= {owner}


class AuthorizedKeys:
    """A ZAP credentials provider: admits the public keys in ``directory/*.pub``, read at each
    handshake; a rejected key is logged (once per key) with the directory to add it to."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self._logged: set[bytes] = set()
        self._bad_files: dict[str, str] = {}  # a file that would not load -> why, logged once until that changes

    def check(self) -> None:
        """Refuse an ``authorized/`` that another user could write (:func:`check_mode`).

        Raises:
            PermissionError: naming the directory and the fix.
            FileNotFoundError: there is none.
        """
        check_mode(self.directory, "the authorized keys' directory")

    def keys(self) -> set[bytes]:
        """The keys admitted now: none while ``authorized/`` could be written by another user (said
        once until that changes), and no key file another user could write."""
        try:
            self.check()
        except OSError as exc:
            if self._bad_files.get("") != str(exc):
                self._bad_files[""] = str(exc)
                log.error("admitting no client: %s", exc)
            return set()
        self._bad_files.pop("", None)
        out = set()
        for path in sorted(self.directory.glob("*.pub")):
            try:
                check_mode(path, "the authorized key")
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
