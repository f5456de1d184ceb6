"""Kubernetes manifests for a reactor job: ``reactor k8s render APP --replicas N``.

Kubernetes places and restarts the daemons (a StatefulSet of ``reactor daemon`` pods behind a
headless Service, so each has a stable name); reactor places the reactors on them (a distribution
policy over a hosts file that names those pods). The templates are ``reactor/launch/kubernetes/``
(``daemons.yaml``, ``secret.yaml``, ``job.yaml``); :func:`render` fills them in:

- a Secret with a CURVE key pair made for this rendering (a cluster key: the daemons and the job
  admit each other and nothing else), mounted at ``/etc/reactor/keys`` (``authorized/self.pub``
  included);
- a ConfigMap holding the app file, the files it names (``--with``) and ``hosts.toml``:
  ``NAME-daemon-I = "tcp://NAME-daemon-I.NAME-daemons.NAMESPACE.svc:7000"`` for each replica;
- a Job whose init container waits until every daemon answers on its port, then runs
  ``reactor run /app/APP --hosts /app/hosts.toml`` with the run options given.

Every value is written as a JSON scalar or flow collection (JSON is YAML), so no value can break
the document's structure; a placeholder left unfilled is an error. The output was validated against
Kubernetes' OpenAPI schemas in the tests (``kubernetes-validate``); it has not run on a live
cluster here.
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Sequence
from pathlib import Path

from .._errors import GraphError

TEMPLATES = Path(__file__).with_name("kubernetes")
_NAME_RE = re.compile(r"[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?")  # an RFC 1123 label, short enough for "-daemons"
_KEY_RE = re.compile(r"[-._a-zA-Z0-9]{1,253}")  # a ConfigMap key
CONFIGMAP_MAX_NBYTES = 1_000_000  # Kubernetes' limit is 1 MiB for the whole object

__all__ = ["render"]


def _q(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)


def render(app: str, run_args: Sequence[str], *, replicas: int, image: str, name: str = "reactor",
           namespace: str = "default", files: Sequence[str] = (), cpu: str = "1", memory: str = "2Gi",
           shm_size: str = "1Gi") -> str:
    """The manifests (one YAML stream) for ``replicas`` daemons and a Job running ``app`` over them.

    Raises:
        GraphError: a name that is not an RFC 1123 label, a bad replica count, a file name a
            ConfigMap cannot hold, or files past its size limit.
        FileNotFoundError: the app or a ``--with`` file is missing.
    """
    from ..transport import CurveKeys

    if not _NAME_RE.fullmatch(name):
        raise GraphError(f"--name {name!r}: lower-case letters, digits and '-' (at most 40), as Kubernetes names need")
    if not _NAME_RE.fullmatch(namespace):
        raise GraphError(f"--namespace {namespace!r}: lower-case letters, digits and '-', as Kubernetes names need")
    if not 1 <= replicas <= 1000:
        raise GraphError(f"--replicas must be in [1, 1000], got {replicas}")
    service, statefulset = f"{name}-daemons", f"{name}-daemon"
    shipped: dict[str, str] = {}
    for path in (app, *files):
        p = Path(path)
        if not _KEY_RE.fullmatch(p.name) or p.name == "hosts.toml":
            raise GraphError(f"{p.name!r} cannot be a ConfigMap key: rename it ([-._a-zA-Z0-9], not hosts.toml)")
        shipped[p.name] = p.read_text()
    hosts = {f"{statefulset}-{i}": f"tcp://{statefulset}-{i}.{service}.{namespace}.svc:7000" for i in range(replicas)}
    shipped["hosts.toml"] = "[hosts]\n" + "".join(f'"{h}" = "{a}"\n' for h, a in hosts.items())
    if sum(len(v.encode()) for v in shipped.values()) > CONFIGMAP_MAX_NBYTES:
        raise GraphError(f"the app and its files exceed a ConfigMap's {CONFIGMAP_MAX_NBYTES} bytes: build them "
                         f"into the image instead")
    keys = CurveKeys.generate()
    wait = ("import socket, sys, time\n"
            "for a in sys.argv[1:]:\n"
            "    h, p = a.rsplit(':', 1)\n"
            "    while True:\n"
            "        try:\n"
            "            socket.create_connection((h, int(p)), 2).close(); break\n"
            "        except OSError:\n"
            "            print('waiting for daemon', a, flush=True); time.sleep(2)\n")
    labels = {"app.kubernetes.io/name": "reactor", "app.kubernetes.io/instance": name}
    values = {
        "NAMESPACE": _q(namespace), "SERVICE": _q(service), "STATEFULSET": _q(statefulset),
        "SECRET": _q(f"{name}-keys"), "CONFIGMAP": _q(f"{name}-app"), "JOB": _q(f"{name}-run"),
        "LABELS": _q(labels), "DAEMON_LABELS": _q({**labels, "app.kubernetes.io/component": "daemon"}),
        "REPLICAS": _q(replicas), "IMAGE": _q(image), "CPU": _q(cpu), "MEMORY": _q(memory), "SHM_SIZE": _q(shm_size),
        "KEY": _q(f"public = {keys.public.decode()}\nsecret = {keys.secret.decode()}\n"),
        "KEY_PUB": _q(f"public = {keys.public.decode()}\n"),
        "APP_FILES": _q(shipped),
        "WAIT_COMMAND": _q(["python", "-c", wait, *(a[len("tcp://"):] for a in hosts.values())]),
        "RUN_COMMAND": _q(["reactor", "run", f"/app/{Path(app).name}", "--hosts", "/app/hosts.toml",
                           *(f"/app/{Path(a).name}" if i and run_args[i - 1] == "--with" else a
                             for i, a in enumerate(run_args))]),
    }
    docs = []
    for part in ("secret.yaml", "daemons.yaml", "job.yaml"):
        template = string.Template((TEMPLATES / part).read_text())
        if left := set(template.get_identifiers()) - set(values):
            raise AssertionError(f"{part}: placeholders without a value: {sorted(left)}")
        docs.append(template.safe_substitute(values).strip() + "\n")
    return "---\n".join(docs)
