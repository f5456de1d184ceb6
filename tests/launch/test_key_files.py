"""Key directories, key files and the tables of hosts and placement files, as a careless user and a
local attacker leave them (a probe, session 75): modes other users could write, a key pair named as a
peer's public key, a link where `keys init` writes, a misspelt table. Real `reactor` commands and a
real daemon on loopback with CURVE."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from reactor.launch._daemon import DaemonError
from reactor.launch._keys import AuthorizedKeys, init_keys
from reactor.transport import CurveKeys

from .test_daemon import Daemon

ROOT = Path(__file__).resolve().parents[2]


def _reactor(*args: str, cwd: Path = ROOT, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "reactor.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _daemon_start(keys: Path, state: Path) -> tuple[int, str]:
    """``reactor daemon`` with ``keys``: (0, "") once it serves (then stopped), else its status and stderr."""
    p = subprocess.Popen([sys.executable, "-m", "reactor.cli", "daemon", "--keys", str(keys), "--no-fork-server",
                          "--name", "h1", "--listen", "tcp://127.0.0.1:0", "--state-dir", str(state)], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        line = p.stdout.readline()  # (its address, once it serves; nothing if it refused)
        if line:
            assert "address" in json.loads(line)
            p.send_signal(signal.SIGTERM)
            p.communicate(timeout=60)
            return 0, ""
        _, err = p.communicate(timeout=60)
        return p.returncode, err
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate(timeout=30)


@pytest.mark.parametrize(("what", "mode", "said"), [
    ("key", 0o644, "the key pair {p} is readable or writable by other users (mode 0644): chmod 600 {p}"),
    ("", 0o777, "the key directory {p} is writable by other users (mode 0777): chmod go-w {p}"),
    ("authorized", 0o777, "the authorized keys' directory {p} is writable by other users (mode 0777): chmod go-w {p}"),
    ("authorized", 0o775, "the authorized keys' directory {p} is writable by other users (mode 0775): chmod go-w {p}"),
])
def test_a_daemon_refuses_keys_that_other_users_could_read_or_change_in_one_line(tmp_path, what, mode, said):
    """As ssh's StrictModes: a 0644 secret, or a key directory or ``authorized/`` others can write (any
    local user could add a key there and run jobs as the daemon's user) was used without a word. The
    daemon refuses to start, naming the path, its mode and the chmod; fixed, it starts."""
    keys = tmp_path / "keys"
    init_keys(keys)
    path = keys / what if what else keys
    os.chmod(path, mode)
    if mode == 0o775:  # (group-writable by a group of others: the owner's private group may write, as OpenSSH has it)
        import grp

        os.chown(path, -1, grp.getgrnam("daemon").gr_gid)
    rc, err = _daemon_start(keys, tmp_path / "state")
    assert rc == 2 and err == f"reactor: {said.format(p=path.resolve() if what != 'key' else path)}\n", err
    assert not (tmp_path / "state").exists()
    os.chmod(path, 0o600 if what == "key" else 0o700)
    assert _daemon_start(keys, tmp_path / "state") == (0, "")


def test_a_key_directory_with_the_sticky_bit_may_be_writable_by_all(tmp_path):
    """A Kubernetes secret's mount is such a directory (no one else can replace what is in it): the
    daemon starts; its secret and authorized/ are still checked."""
    keys = tmp_path / "keys"
    init_keys(keys)
    os.chmod(keys, 0o1777)
    assert _daemon_start(keys, tmp_path / "state") == (0, "")
    os.chmod(keys / "authorized", 0o1777)  # (sticky is not enough where keys are admitted: anyone could add one)
    rc, err = _daemon_start(keys, tmp_path / "state")
    assert rc == 2 and "the authorized keys' directory" in err and "mode 1777" in err, err


def test_a_running_daemon_admits_no_one_while_its_authorized_keys_are_writable_by_others(tmp_path, caplog):
    """Made loose after the start, ``authorized/`` admits no key at the next handshake (logged once, with
    the chmod), and a key file others can write is ignored; set right, they are admitted again."""
    d = Daemon(tmp_path, extra=("--no-fork-server",))
    try:
        with d.client(timeout_s=10) as c:
            assert c.request("ping")["name"] == "h1"
        os.chmod(d.keys_dir / "authorized", 0o777)
        for _ in range(2):
            with d.client(timeout_s=10) as c, pytest.raises(DaemonError, match="refused our key"):
                c.request("ping")
        os.chmod(d.keys_dir / "authorized", 0o700)
        os.chmod(d.keys_dir / "authorized" / "alice.pub", 0o666)
        with d.client(timeout_s=10) as c, pytest.raises(DaemonError, match="refused our key"):
            c.request("ping")
        os.chmod(d.keys_dir / "authorized" / "alice.pub", 0o644)
        with d.client(timeout_s=10) as c:
            assert c.request("ping")["name"] == "h1"
    finally:
        err = d.stop()
    where = d.keys_dir / "authorized"
    assert err.count(f"admitting no client: the authorized keys' directory {where} is writable by other users "
                     f"(mode 0777): chmod go-w {where}") == 1, err
    assert f"ignored the authorized key file {where / 'alice.pub'}: the authorized key {where / 'alice.pub'} is " \
           f"writable by other users (mode 0666)" in err, err

    keys = AuthorizedKeys(where)  # (in process too: what the ZAP handler asks at each handshake)
    with caplog.at_level(logging.WARNING, logger="reactor.keys"):
        assert len(keys.keys()) == 2


def test_keys_init_writes_through_no_link_and_names_keys_already_admitted(tmp_path):
    """``keys init DIR`` wrote key.pub through a link it found there (the file it pointed at replaced), and
    kept a stranger's key in an existing ``authorized/`` without a word."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / "k").mkdir()
    (tmp_path / "k" / "key.pub").symlink_to(victim)
    p = _reactor("keys", "init", str(tmp_path / "k"))
    assert p.returncode == 2 and p.stderr == (f"reactor: {tmp_path / 'k' / 'key.pub'} is a symbolic link: remove it (a "
                                              f"new key pair's files are not written through links)\n"), p.stderr
    assert victim.read_text() == "precious\n" and not (tmp_path / "k" / "key").exists()

    init_keys(tmp_path / "stranger")
    (tmp_path / "k2" / "authorized").mkdir(parents=True)
    (tmp_path / "k2" / "authorized" / "stranger.pub").write_bytes((tmp_path / "stranger" / "key.pub").read_bytes())
    p = _reactor("keys", "init", str(tmp_path / "k2"))
    assert p.returncode == 0, p.stderr
    assert f"{tmp_path / 'k2' / 'authorized'} already admits 1 keys: stranger.pub; remove those you do not know" \
        in p.stderr, p.stderr


def test_a_key_pair_named_as_a_hosts_key_is_refused_and_never_leaves_with_a_job(tmp_path):
    """A hosts file whose ``key`` named a key pair (``keys/key``, not ``keys/key.pub``) was taken (its public
    line read), and ``reactor submit`` shipped the file, secret included, to the daemon's job directory.
    The pair is refused where it is named, by ``run`` and by ``submit`` before anything is sent."""
    init_keys(tmp_path / "keys")
    with pytest.raises(ValueError, match="holds a secret key"):
        CurveKeys.load_public(tmp_path / "keys" / "key")
    assert CurveKeys.load_public(tmp_path / "keys" / "key.pub")  # (its public half is what a peer is given)
    (tmp_path / "hosts.toml").write_text('[hosts]\nh1 = {address = "tcp://127.0.0.1:9", key = "keys/key"}\n')
    app = str(ROOT / "tests" / "apps" / "gated.py")
    said = ("reactor: hosts file hosts.toml: host 'h1': its key keys/key holds a secret key (it is a key pair): name "
            "its public half, the key.pub beside it\n")
    p = _reactor("submit", app, "--hosts", "hosts.toml", "--placement", "processes", "--keys", str(tmp_path / "keys"),
                 cwd=tmp_path)
    assert p.returncode == 2 and p.stderr == said, p.stderr
    p = _reactor("run", app, "--hosts", "hosts.toml", "--placement", "processes", "--keys", str(tmp_path / "keys"),
                 cwd=tmp_path)
    assert p.returncode == 2 and "holds a secret key (it is a key pair)" in p.stderr, p.stderr


@pytest.mark.parametrize(("name", "text", "said"), [
    ("hosts.toml", '[hosts]\nh1 = "tcp://127.0.0.1:9"\n[groups.x]\nreactors = ["*"]\nhost = "h1"\n',
     "hosts file hosts.toml: a hosts file has no [groups]: it takes [hosts], [cluster], [restart]"),
    ("hosts.toml", '[hosts]\nh1 = "tcp://127.0.0.1:9"\n[restarts]\nrestart = "on-failure"\n',
     "hosts file hosts.toml: a hosts file has no [restarts] (did you mean [restart]?): it takes [hosts], [cluster], "
     "[restart]"),
    ("place.toml", '[groups.a]\nreactors = ["*"]\n[grups.b]\nreactors = ["x"]\n',
     "placement file place.toml: a placement file has no [grups] (did you mean [groups]?): it takes [groups], "
     "[hosts], [cluster], [restart]"),
])
def test_a_table_a_hosts_or_placement_file_does_not_take_is_refused_naming_the_closest(tmp_path, name, text, said):
    """A misspelt or misplaced table (``[grups.b]``, ``[restarts]``, a hosts file's ``[groups.x]``) was
    ignored and the run went on without what it said (exit 0)."""
    (tmp_path / name).write_text(text)
    flag = ["--hosts", name, "--placement", "processes"] if name == "hosts.toml" else ["--placement", name]
    p = _reactor("run", str(ROOT / "tests" / "apps" / "gated.py"), *flag, cwd=tmp_path)
    assert p.returncode == 2 and p.stderr == f"reactor: {said}\n", p.stderr


@pytest.mark.parametrize("args", [["keys", "init", ""], ["daemon", "--state-dir", "", "--listen", "tcp://127.0.0.1:0",
                                                          "--name", "h1"], ["status", "--keys", ""]])
def test_an_empty_path_is_refused_not_taken_for_the_default(args, tmp_path):
    """``keys init ""`` made keys in ~/.reactor/keys, ``--state-dir ""`` took the current directory, ``--keys ""``
    the default key directory, each without a word."""
    p = _reactor(*args, cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.splitlines()[-1].endswith("a path expected, got ''"), p.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_truncated_key_pair_is_refused_naming_its_file(tmp_path):
    init_keys(tmp_path / "keys")
    text = (tmp_path / "keys" / "key").read_text()
    (tmp_path / "keys" / "key").write_text(text[:-10] + "\n")
    p = _reactor("status", "--keys", str(tmp_path / "keys"), "--daemon", "tcp://127.0.0.1:9")
    assert p.returncode == 2 and p.stderr.startswith(f"reactor: {tmp_path / 'keys' / 'key'}: CurveKeys.secret"), p.stderr


def test_a_daemon_listening_on_an_interface_by_name_advertises_its_address(tmp_path):
    """``--listen tcp://lo:0`` printed ``"advertised": "tcp://lo:PORT"``, what a hosts file takes and no other
    host resolves: the interface's IPv4 address is advertised."""
    init_keys(tmp_path / "keys")
    p = subprocess.Popen([sys.executable, "-m", "reactor.cli", "daemon", "--keys", str(tmp_path / "keys"),
                          "--no-fork-server", "--name", "h1", "--listen", "tcp://lo:0", "--state-dir",
                          str(tmp_path / "state")], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        line = json.loads(p.stdout.readline())
        assert line["advertised"].startswith("tcp://127.0.0.1:") and line["advertised"].rsplit(":", 1)[1].isdigit(), line
    finally:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=60)


def test_keys_made_under_a_umask_of_0002_are_admitted(tmp_path):
    """A umask of 0002 (a user-private group's default) made ``authorized/self.pub`` 0664, which the mode
    check then ignored: the daemon admitted no one. Public keys are written 0644 whatever the umask,
    and ``keys init`` takes group write off the directories it makes or finds."""
    old = os.umask(0o002)
    try:
        (tmp_path / "keys").mkdir(mode=0o775)
        init_keys(tmp_path / "keys")
    finally:
        os.umask(old)
    assert {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "keys").rglob("*")} == {
        "key": 0o600, "key.pub": 0o644, "authorized": 0o700, "self.pub": 0o644}
    assert (tmp_path / "keys").stat().st_mode & 0o777 == 0o755
    assert len(AuthorizedKeys(tmp_path / "keys" / "authorized").keys()) == 1


def test_a_secret_owned_by_root_may_be_read_by_its_group_as_a_kubernetes_fsgroup_mount_has_it():
    """A pod that runs as another user than root reads its Secret's files, owned by root and 0440 under an
    fsGroup: refused by the strict rule, which holds for a secret of this user's own."""
    import pwd
    import shutil
    import tempfile

    from reactor.launch._keys import check_mode

    if os.geteuid() != 0:
        pytest.skip("needs root: a file of root's, read by another user")
    where = Path(tempfile.mkdtemp(prefix="rx-keys-"))  # (under /tmp: a path another user can walk)
    try:
        os.chmod(where, 0o755)
        init_keys(where / "keys")
        os.chmod(where / "keys", 0o755)
        key = where / "keys" / "key"
        os.chmod(key, 0o440)
        with pytest.raises(PermissionError, match="readable or writable by other users"):
            check_mode(key, "the key pair", secret=True)  # (root's own secret: the strict rule)
        pid = os.fork()
        if pid == 0:  # (as another user, reading root's file)
            try:
                os.setuid(pwd.getpwnam("nobody").pw_uid)
                check_mode(key, "the key pair", secret=True)
                os._exit(0)
            except BaseException:  # noqa: BLE001 - told by the status
                os._exit(1)
        assert os.waitpid(pid, 0)[1] == 0
        os.chmod(key, 0o462)  # (writable by others: refused whoever owns it)
        with pytest.raises(PermissionError, match="writable by other users"):
            check_mode(key, "the key pair", secret=True)
    finally:
        shutil.rmtree(where)


def test_a_job_whose_files_a_daemon_would_refuse_is_refused_before_it_is_sent(tmp_path):
    """An app file named ``my app.py`` was sent, and the daemon's refusal came back ("bad request: 'submit'
    field 1: files: ..."), after a connection: the same check runs before anything is sent."""
    app = tmp_path / "my app.py"
    app.write_text((ROOT / "tests" / "apps" / "gated.py").read_text())
    init_keys(tmp_path / "keys")
    p = _reactor("submit", str(app), "--keys", str(tmp_path / "keys"), "--daemon", "tcp://127.0.0.1:9")
    assert p.returncode == 2 and p.stderr == ("reactor: the job's files cannot be sent as they are: files: str 'my "
                                              "app.py' is not a relative path of [A-Za-z0-9_.-] parts\n"), p.stderr
