"""``reactor k8s render``: the manifests validate against Kubernetes' own OpenAPI schemas
(kubernetes-validate, strict: no field Kubernetes does not know), and say what a run needs: the
daemons' stable names in the hosts file, a working key pair, the app and its files, the run's
options. Not run on a live cluster here (docs/cluster.md says so)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from reactor._errors import GraphError
from reactor.launch._app import build_graph
from reactor.launch._cluster import load_hosts_file
from reactor.launch._k8s import render
from reactor.launch._placement import resolve_placement
from reactor.transport import CurveKeys

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[2]
DQN = str(ROOT / "apps" / "dqn.py")
K8S_VERSION = "1.30.0"


def _docs(text: str) -> dict[str, dict]:
    docs = list(yaml.safe_load_all(text))
    return {d["kind"]: d for d in docs}


def test_the_manifests_validate_against_kubernetes_schemas_and_carry_what_the_run_needs(tmp_path):
    extra = tmp_path / "my_env.py"
    extra.write_text("X = 1\n")
    text = render(DQN, ["--placement", "actors", "--async", "--with", str(extra), "--set", "target_return=475"],
                  replicas=4, image="registry.example/reactor:1", name="rl", namespace="team-a", files=[str(extra)])
    docs = _docs(text)
    assert set(docs) == {"Secret", "Service", "StatefulSet", "ConfigMap", "Job"}
    for kind, doc in docs.items():
        assert kubernetes_validate.validate(doc, K8S_VERSION, strict=True), kind
        assert doc["metadata"]["namespace"] == "team-a"
    sts, svc, job, cm = docs["StatefulSet"], docs["Service"], docs["Job"], docs["ConfigMap"]
    assert sts["spec"]["replicas"] == 4 and sts["spec"]["serviceName"] == svc["metadata"]["name"] == "rl-daemons"
    assert svc["spec"]["clusterIP"] == "None"  # headless: one stable DNS name per pod
    assert svc["spec"]["selector"] == sts["spec"]["template"]["metadata"]["labels"]
    daemon = sts["spec"]["template"]["spec"]["containers"][0]
    # A daemon's SIGTERM stops its jobs (20 + 15 + 5 s) and then its hosted workers (up to 10 s): the
    # default grace of 30 s would SIGKILL it in the middle of that.
    from reactor.launch._daemon import STOP_GRACE_S, STOP_HURRY_S

    assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= STOP_GRACE_S + STOP_HURRY_S + 15
    assert daemon["image"] == "registry.example/reactor:1"
    assert daemon["command"][:2] == ["reactor", "daemon"] and "$(POD_NAME)" in daemon["command"]

    # The hosts file names each pod by its stable name; the policy spreads DQN's groups over them.
    hosts_toml = tmp_path / "hosts.toml"
    hosts_toml.write_text(cm["data"]["hosts.toml"])
    hosts, _ = load_hosts_file(hosts_toml)
    assert [h.address for h in hosts.values()] == [f"tcp://rl-daemon-{i}.rl-daemons.team-a.svc:7000" for i in range(4)]
    plan = resolve_placement(build_graph(DQN, {"actors": 2, "shards": 2}), "actors", str(hosts_toml))
    assert {g.hosts[0] for g in plan.groups} == {f"rl-daemon-{i}" for i in range(4)}

    # The app and its file travel in the ConfigMap; the Job runs it with the options given.
    assert cm["data"]["dqn.py"] == Path(DQN).read_text() and cm["data"]["my_env.py"] == "X = 1\n"
    run = job["spec"]["template"]["spec"]["containers"][0]
    assert run["command"] == ["reactor", "run", "/app/dqn.py", "--hosts", "/app/hosts.toml", "--placement",
                              "actors", "--async", "--with", "/app/my_env.py", "--set", "target_return=475"]
    wait = job["spec"]["template"]["spec"]["initContainers"][0]["command"]
    compile(wait[2], "wait", "exec")
    assert wait[3:] == [f"rl-daemon-{i}.rl-daemons.team-a.svc:7000" for i in range(4)]

    # The Secret holds a real CURVE pair; every pod mounts it with the pair's own key authorized.
    key = tmp_path / "key"
    key.write_text(docs["Secret"]["stringData"]["key"])
    pair = CurveKeys.load(key)
    (tmp_path / "key.pub").write_text(docs["Secret"]["stringData"]["key.pub"])
    assert CurveKeys.load_public(tmp_path / "key.pub") == pair.public
    for spec in (sts["spec"]["template"]["spec"], job["spec"]["template"]["spec"]):
        (keys,) = [v for v in spec["volumes"] if v["name"] == "keys"]
        assert {i["path"] for i in keys["secret"]["items"]} == {"key", "key.pub", "authorized/self.pub"}
    # A second rendering makes a new pair.
    assert _docs(render(DQN, [], replicas=1, image="x"))["Secret"]["stringData"]["key"] != pair_text(pair)


def pair_text(pair: CurveKeys) -> str:
    return f"public = {pair.public.decode()}\nsecret = {pair.secret.decode()}\n"


def test_values_cannot_break_the_documents_structure(tmp_path):
    """A config value, or a shipped file, full of YAML syntax stays one argument of the Job's command
    (one value of the ConfigMap's data)."""
    nasty = 'note="a: b\\n- c: [d]\\n---\\nkind: Pod # ${IMAGE} $(POD_IP)"'
    extra = tmp_path / "extra.yaml"
    extra.write_text('x: "\n---\nkind: Pod\n${IMAGE}')
    text = render(DQN, ["--set", nasty], replicas=2, image="img", name="x", files=[str(extra)])
    docs = list(yaml.safe_load_all(text))
    assert [d["kind"] for d in docs] == ["Secret", "Service", "StatefulSet", "ConfigMap", "Job"]
    job = docs[-1]
    assert job["spec"]["template"]["spec"]["containers"][0]["command"][-1] == nasty
    assert docs[3]["data"]["extra.yaml"] == extra.read_text()


def test_a_file_that_is_not_text_travels_byte_for_byte_in_binary_data(tmp_path):
    """Regression (a newcomer's pass): ``--with weights.bin`` was one line, "'utf-8' codec can't decode
    byte 0x80 in position 0", naming no file. A ConfigMap holds such a file base64-encoded under
    binaryData, mounted beside the others."""
    import base64

    blob = tmp_path / "weights.bin"
    blob.write_bytes(bytes(range(256)) * 3)
    docs = _docs(render(DQN, ["--with", str(blob)], replicas=1, image="img", files=[str(blob)]))
    assert kubernetes_validate.validate(docs["ConfigMap"], K8S_VERSION, strict=True)
    assert base64.b64decode(docs["ConfigMap"]["binaryData"]["weights.bin"]) == blob.read_bytes()
    assert "weights.bin" not in docs["ConfigMap"]["data"]
    assert docs["Job"]["spec"]["template"]["spec"]["containers"][0]["command"][-1] == "/app/weights.bin"


def test_two_files_of_one_name_are_refused_not_one_shipped_in_the_others_place(tmp_path):
    """Regression (a newcomer's pass): ``--with lib/dqn.py`` beside the app ``apps/dqn.py`` took the app's
    key in the ConfigMap, and the Job would have run the other file as the app; two ``--with`` files of
    one name kept the later alone."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "dqn.py").write_text("X = 1\n")
    (tmp_path / "a.py").write_text("A = 1\n")
    (tmp_path / "lib" / "a.py").write_text("A = 2\n")
    other = str(tmp_path / "lib" / "dqn.py")
    with pytest.raises(GraphError, match=rf"^--with {re.escape(other)}: {re.escape(DQN)} has the same file name, and "
                                         rf"both land in /app/dqn.py: rename one$"):
        render(DQN, [], replicas=1, image="img", files=[other])
    with pytest.raises(GraphError, match=r"both land in /app/a.py: rename one$"):
        render(DQN, [], replicas=1, image="img", files=[str(tmp_path / "a.py"), str(tmp_path / "lib" / "a.py")])


@pytest.mark.parametrize(("kw", "message"), [
    ({"name": "Bad_Name"}, "--name 'Bad_Name': a lower-case letter, then lower-case letters"),
    # (Regression, a newcomer's pass: these were taken, and Kubernetes would have refused the Service
    # 1abc-daemons, whose name must be an RFC 1035 label, after making the Secret.)
    ({"name": "1abc"}, "--name '1abc': a lower-case letter, then"),
    ({"name": "abc-"}, "--name 'abc-': a lower-case letter, then"),
    ({"name": "a" * 41}, f"--name '{'a' * 41}': a lower-case letter, then"),
    ({"namespace": "-x"}, "--namespace '-x'"),
    ({"namespace": "n" * 64}, f"--namespace '{'n' * 64}': lower-case letters, digits and '-', starting and ending in "
                              f"a letter or digit, at most 63 in all (an RFC 1123 label)"),
    ({"replicas": 0}, "--replicas must be in [1, 1000], got 0"),
    ({"files": ["/etc/hostname", "/tmp/a b.py"]}, "'a b.py' cannot be a ConfigMap key"),
    # (Regression, a newcomer's pass: taken, to fail at the pull, or at kubectl apply, on the cluster)
    ({"image": ""}, "--image '': not an image reference a container runtime pulls"),
    ({"image": "my image"}, "--image 'my image': not an image reference"),
    ({"image": "Registry.example/Reactor:1"}, "--image 'Registry.example/Reactor:1': not an image reference"),
    ({"image": 'img"\n  evil: 1'}, "--image 'img\"\\n  evil: 1': not an image reference"),
    ({"cpu": "two"}, "--cpu 'two': not a Kubernetes quantity"),
    ({"cpu": "-1"}, "--cpu '-1': not a Kubernetes quantity"),
    ({"memory": "lots"}, "--memory 'lots': not a Kubernetes quantity"),
    ({"shm_size": "1 Gi"}, "--shm-size '1 Gi': not a Kubernetes quantity"),
    # (a careless user's pass: taken, to fail at kubectl apply)
    ({"shm_size": "1e999"}, "--shm-size '1e999': past what Kubernetes holds (2**63 - 1)"),
    ({"memory": "9Ei"}, "--memory '9Ei': past what Kubernetes holds"),
])
def test_bad_input_is_refused_naming_it(kw, message, tmp_path):
    if "files" in kw:
        (tmp_path / "a b.py").write_text("")
        kw = {"files": [str(tmp_path / "a b.py")]}
    with pytest.raises(GraphError, match="^" + re.escape(message)):
        render(DQN, [], **{"replicas": 2, "image": "x", **kw})


@pytest.mark.parametrize(("kw"), [
    {"name": "a" * 40, "namespace": "n" * 63},
    {"image": "registry.example:5000/team/re_actor.x:1.2-rc@sha256:" + "ab" * 32},
    {"image": "localhost/reactor"},
    {"cpu": "500m", "memory": "1.5G", "shm_size": "512Mi"},
    {"cpu": "0.5", "memory": "1e9", "shm_size": "2Gi"},
    {"cpu": "100", "memory": "7Ei", "shm_size": "1e18"},
])
def test_what_kubernetes_takes_is_taken_and_validates(kw):
    docs = _docs(render(DQN, [], **{"replicas": 2, "image": "x", **kw}))
    for kind, doc in docs.items():
        assert kubernetes_validate.validate(doc, K8S_VERSION, strict=True), kind
    daemon = docs["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]
    assert daemon["image"] == kw.get("image", "x")
    assert daemon["resources"]["requests"] == {"cpu": kw.get("cpu", "1"), "memory": kw.get("memory", "2Gi")}


def test_the_command_line_writes_them_and_refuses_a_placement_file(tmp_path):
    out = tmp_path / "k.yaml"
    got = subprocess.run([sys.executable, "-m", "reactor.cli", "k8s", "render", DQN, "--replicas", "2", "--out",
                          str(out)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert got.returncode == 0 and f"kubectl apply -f {out}" in got.stderr, got.stderr
    assert _docs(out.read_text())["StatefulSet"]["spec"]["replicas"] == 2
    bad = subprocess.run([sys.executable, "-m", "reactor.cli", "k8s", "render", DQN, "--placement", "p.toml"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and "a k8s job spreads its groups over its daemons" in bad.stderr, bad.stderr
    bad = subprocess.run([sys.executable, "-m", "reactor.cli", "k8s", "render", DQN, "--out",
                          str(tmp_path / "no" / "k.yaml")],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and bad.stderr == (f"reactor: --out {tmp_path / 'no' / 'k.yaml'}: cannot write the "
                                                  f"manifests there (No such file or directory)\n"), bad.stderr
    # (Regression, a newcomer's pass: a file that is not Python was rendered, to fail in the Job)
    notes = tmp_path / "notes.py"
    notes.write_text("first line\nthis is not python\n")
    bad = subprocess.run([sys.executable, "-m", "reactor.cli", "k8s", "render", str(notes)],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and bad.stdout == "", bad.stdout
    assert bad.stderr.endswith(f"reactor: {notes} line 1: SyntaxError: invalid syntax\n"), bad.stderr


@pytest.mark.parametrize("command", ["k8s render", "slurm"])
def test_a_restart_policy_the_runs_mode_cannot_hold_is_refused_before_a_cluster_job_is_made(command):
    """Regression (a review, session 52): `reactor run` refuses `--restart on-failure` without `--async`,
    and the cluster commands built that very command line for their jobs, to fail on the cluster after
    the allocation. (`never`, or `--async`, is taken.)"""
    cli = [sys.executable, "-m", "reactor.cli", *command.split(), DQN]
    bad = subprocess.run([*cli, "--restart", "on-failure"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and bad.stderr.startswith(
        "reactor: restart 'on-failure': restart policies hold in async runs (--async)"), bad.stderr
    if command == "k8s render":
        for ok in (["--restart", "never"], ["--async", "--restart", "on-failure"]):
            got = subprocess.run([*cli, *ok], capture_output=True, text=True, timeout=60, cwd=ROOT)
            assert got.returncode == 0 and ok[-1] in got.stdout, got.stderr


@pytest.mark.parametrize("command", ["k8s render", "slurm"])
def test_a_set_key_or_value_reactor_run_refuses_is_refused_before_a_cluster_job_is_made(command, tmp_path):
    """Regression: `reactor k8s render APP --set nosuch=1` rendered the manifests (and `reactor slurm` queued
    the job): the key was refused only by the run in the cluster's Job, after the daemons were up. The keys
    and values are checked here as `reactor run` checks them (the app imported, its graph not built); an app
    that does not import here (a module only the cluster's image has) is said and rendered."""
    demo = str(ROOT / "apps" / "demo_pipeline.py")
    cli = [sys.executable, "-m", "reactor.cli", *command.split()]
    for given, said in ((["nosuch=1"], "reactor: unknown config key 'nosuch'; Config has: producers, stop_s, workers\n"),
                        (["workers=many"], "reactor: config key 'workers' expects int, got 'many'\n"),
                        (["producers=0"], f"reactor: --set producers=0: replicas must be an int >= 1, got 0 ({demo}:83)\n")):
        bad = subprocess.run([*cli, demo, "--set", *given], capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert (bad.returncode, bad.stdout, bad.stderr) == (2, "", said)
    if command == "slurm":
        return  # (what it takes goes to sbatch)
    got = subprocess.run([*cli, demo, "--set", "workers=3"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert got.returncode == 0 and "workers=3" in got.stdout and got.stderr == "", got.stderr
    elsewhere = tmp_path / "cluster_only.py"
    elsewhere.write_text("import module_of_the_clusters_image\n\ndef build(config):\n    pass\n")
    got = subprocess.run([*cli, str(elsewhere), "--set", "x=1"], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)
    assert got.returncode == 0 and "x=1" in got.stdout, got.stderr
    assert got.stderr == ("reactor: the --set values were not checked here: the app does not import here "
                          "(ModuleNotFoundError: No module named 'module_of_the_clusters_image'); its run checks them "
                          "when it starts\n"), got.stderr
