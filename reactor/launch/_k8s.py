"""Kubernetes manifests for a reactor job: ``reactor k8s render APP --replicas N``.

Kubernetes places and restarts the daemons (a StatefulSet of ``reactor daemon`` pods behind a
headless Service, so each has a stable name); reactor places the reactors on them (a distribution
policy over a hosts file that names those pods). The templates are ``reactor/launch/kubernetes/``
(``daemons.yaml``, ``secret.yaml``, ``job.yaml``); :func:`render` fills them in:

- a Secret with a CURVE key pair made for this rendering (a cluster key: the daemons and the job
  admit each other and nothing else), mounted at ``/etc/reactor/keys`` (``authorized/self.pub``
  included);
- a ConfigMap holding the app file, the files it names (``--with``; one that is not UTF-8 text under
  ``binaryData``) and ``hosts.toml``:
  ``NAME-daemon-I = "tcp://NAME-daemon-I.NAME-daemons.NAMESPACE.svc:7000"`` for each replica;
- a Job whose init container waits until every daemon answers on its port, then runs
  ``reactor run /app/APP --hosts /app/hosts.toml`` with the run options given.

Every value is written as a JSON scalar or flow collection (JSON is YAML), so no value can break
the document's structure, and one a YAML reader would refuse or alter (DEL, a C1 control, U+2028)
is escaped (:func:`_q`); a placeholder left unfilled is an error. The schemas check no names, image
references or quantities, so :func:`render` does, as Kubernetes would on the cluster. The output was validated against
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
# An RFC 1035 label (a letter first: the Service NAME-daemons must be one), short enough for "-daemons";
# a StatefulSet's pods take NAME-daemon-I as their host name and a revision-hash label of the set's name.
_NAME_RE = re.compile(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?")
_NAMESPACE_RE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # an RFC 1123 label
_KEY_RE = re.compile(r"[-._a-zA-Z0-9]{1,253}")  # a ConfigMap key
# An image reference as container runtimes parse it (distribution/reference): [DOMAIN[:PORT]/]PATH[:TAG][@DIGEST].
_PATH_PART = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN_PART = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_IMAGE_RE = re.compile(
    rf"(?:{_DOMAIN_PART}(?:\.{_DOMAIN_PART})*(?::[0-9]+)?/)?{_PATH_PART}(?:/{_PATH_PART})*"
    r"(?::[\w][\w.-]{0,127})?(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?")
# A resource quantity (Kubernetes' resource.Quantity), not negative: 500m, 2, 1.5, 2Gi, 512M, 1e3.
_QUANTITY_RE = re.compile(r"\+?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[KMGTPE]i|[numkMGTPE]|[eE][-+]?[0-9]+)?")
CONFIGMAP_MAX_NBYTES = 1_000_000  # Kubernetes' limit is 1 MiB for the whole object
_SUFFIX = {**{f"{p}i": 2 ** (10 * (i + 1)) for i, p in enumerate("KMGTPE")},
           **{p: 10 ** (3 * (i + 1)) for i, p in enumerate("kMGTPE")}, "n": 1e-9, "u": 1e-6, "m": 1e-3}

__all__ = ["render"]


def _quantity(value: str) -> float:
    """The size of a quantity :data:`_QUANTITY_RE` took (inf past a float's range)."""
    suffix = next((x for x in sorted(_SUFFIX, key=len, reverse=True) if value.endswith(x)), "")
    number = value[:len(value) - len(suffix)] if suffix else value
    return float(number) * _SUFFIX.get(suffix, 1)


# What a YAML reader would not give back as written: DEL and every other character of the Basic
# Multilingual Plane past ASCII. YAML refuses a raw DEL, C1 control or U+FFFE, and folds a raw NEL,
# U+2028 or U+2029 in a quoted string; the rest is escaped too, as json's ensure_ascii does.
_YAML_ESCAPED = re.compile(r"[\x7f-\uffff]")


def _q(value: object) -> str:
    """``value`` as JSON that every YAML reader takes back exactly: DEL and a character past ASCII become
    a ``\\uXXXX`` escape, but one past U+FFFF stays as it is (UTF-8), since json would write it as a
    surrogate pair, which PyYAML reads as two lone surrogates and go-yaml (Kubernetes') refuses."""
    return _YAML_ESCAPED.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(value, ensure_ascii=False))


def render(app: str, run_args: Sequence[str], *, replicas: int, image: str, name: str = "reactor",
           namespace: str = "default", files: Sequence[str] = (), cpu: str = "1", memory: str = "2Gi",
           shm_size: str = "1Gi") -> str:
    """The manifests (one YAML stream) for ``replicas`` daemons and a Job running ``app`` over them.

    Raises:
        GraphError: a name that Kubernetes would refuse (``name``: an RFC 1035 label of at most 40
            characters; ``namespace``: an RFC 1123 label), an image reference or a resource quantity it
            would not parse, a bad replica count, a file name a ConfigMap cannot hold or that two files
            share, or files past its size limit; each naming the option, before anything is written.
        FileNotFoundError: the app or a ``--with`` file is missing.
    """
    import base64

    from ..transport import CurveKeys

    if not _NAME_RE.fullmatch(name):
        raise GraphError(f"--name {name!r:.80}: a lower-case letter, then lower-case letters, digits and '-', ending in a "
                         f"letter or digit, at most 40 in all: every object's name starts with it, and Kubernetes "
                         f"takes a Service's name (NAME-daemons) only as an RFC 1035 label")
    if not _NAMESPACE_RE.fullmatch(namespace):
        raise GraphError(f"--namespace {namespace!r:.80}: lower-case letters, digits and '-', starting and ending in a "
                         f"letter or digit, at most 63 in all (an RFC 1123 label), as Kubernetes namespaces need")
    if not 1 <= replicas <= 1000:
        raise GraphError(f"--replicas must be in [1, 1000], got {replicas}")
    if len(image) > 512 or not _IMAGE_RE.fullmatch(image):  # (names stop at 255, tags at 128)
        raise GraphError(f"--image {image!r:.200}: not an image reference a container runtime pulls "
                         f"([REGISTRY[:PORT]/]NAME[:TAG][@DIGEST], NAME in lower case, no spaces; e.g. "
                         f"registry.example/reactor:1)")
    for option, value in (("--cpu", cpu), ("--memory", memory), ("--shm-size", shm_size)):
        if not _QUANTITY_RE.fullmatch(value):
            raise GraphError(f"{option} {value!r:.80}: not a Kubernetes quantity (a number >= 0 with an optional "
                             f"suffix: 500m or 2 for CPUs, 512Mi, 2Gi or 1G for bytes)")
        if _quantity(value) >= 2**63:  # (1e999 matched the grammar; the API server refuses past int64)
            raise GraphError(f"{option} {value!r:.80}: past what Kubernetes holds (2**63 - 1)")
    service, statefulset = f"{name}-daemons", f"{name}-daemon"
    shipped: dict[str, str] = {}
    binary: dict[str, str] = {}  # (a ConfigMap holds bytes that are not UTF-8 under binaryData, base64)
    given: dict[str, str] = {}
    for path in (app, *files):
        p = Path(path)
        if not _KEY_RE.fullmatch(p.name) or p.name == "hosts.toml":
            raise GraphError(f"{p.name!r} cannot be a ConfigMap key: rename it ([-._a-zA-Z0-9], not hosts.toml)")
        if p.name in given:  # (one key each: the later file took the earlier's place, the app's too)
            raise GraphError(f"--with {path}: {given[p.name]} has the same file name, and both land in /app/{p.name}: "
                             f"rename one")
        given[p.name] = str(path)
        data = p.read_bytes()
        try:
            shipped[p.name] = data.decode()
        except UnicodeDecodeError:
            if p.name == Path(app).name:
                raise GraphError(f"app file {app}: not UTF-8 text (is it a Python file?)") from None
            binary[p.name] = base64.b64encode(data).decode()
    hosts = {f"{statefulset}-{i}": f"tcp://{statefulset}-{i}.{service}.{namespace}.svc:7000" for i in range(replicas)}
    shipped["hosts.toml"] = "[hosts]\n" + "".join(f'"{h}" = "{a}"\n' for h, a in hosts.items())
    if sum(len(v.encode()) for v in (*shipped.values(), *binary.values())) > CONFIGMAP_MAX_NBYTES:
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
        "APP_FILES": _q(shipped), "APP_BINARY_FILES": _q(binary),
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
