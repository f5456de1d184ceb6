"""What ``reactor slurm`` and ``reactor k8s render`` take from a careless user (session 75): a value that
would change the batch script is refused naming it, one an #SBATCH line can carry quoted is read back by
sbatch as given, a node list scontrol cannot expand is refused naming it, a daemon task's bad Slurm
variable is one line naming it, and every character of the manifests comes back from a YAML reader as
written. No Slurm is needed: a fake ``scontrol``, ``srun`` or ``sbatch`` on PATH stands in where one is
run, the tests of the real ``scontrol`` skip where there is none, and those of the real ``sbatch`` use the
local Slurm cluster (scripts/slurm_local.sh, as root), skipping where it cannot be set up."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from reactor.launch._slurm import SlurmError, _sbatch_quote, node_names, sbatch_script, submit

ROOT = Path(__file__).resolve().parents[2]
DQN = str(ROOT / "apps" / "dqn.py")
_CONTROL = "is a control character, which cannot go into the batch script (a newline starts a shell command)"


def _fake(bin_dir: Path, name: str, body: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / name).write_text("#!/bin/bash\n" + body)
    (bin_dir / name).chmod(0o755)


# ------------------------------------------------------------------------------ the batch script


def test_a_legitimate_batch_script_renders_as_before(tmp_path, monkeypatch):
    """The checks change no script they take: the directives, the ``cd`` and the quoted ``exec`` line, byte
    for byte as before session 75."""
    monkeypatch.chdir(tmp_path)
    text = sbatch_script("/apps/my-app_v2.py", ["--set", "note=it's a b", "--with", "/data/x.bin"],
                         tmp_path / "job", nodes=3, tasks_per_node=2, partition="gpu,cpu", time_limit="1-00:00:00",
                         sbatch_args=["--mem=8G", "--gres=gpu:1", "--exclusive"])
    assert text == (
        "#!/bin/bash\n"
        "#SBATCH --job-name=reactor-my-app_v2\n"
        "#SBATCH --nodes=3\n"
        "#SBATCH --ntasks-per-node=2\n"
        f"#SBATCH --output={tmp_path}/job/slurm-%j.out\n"
        "#SBATCH --partition=gpu,cpu\n"
        "#SBATCH --time=1-00:00:00\n"
        "#SBATCH --mem=8G\n"
        "#SBATCH --gres=gpu:1\n"
        "#SBATCH --exclusive\n"
        f"cd {tmp_path}\n"
        f"exec {sys.executable} -m reactor.cli slurm --here /apps/my-app_v2.py --out {tmp_path}/job "
        "--tasks-per-node 2 --set 'note=it'\"'\"'s a b' --with /data/x.bin\n")


@pytest.mark.parametrize(("app", "out", "kw", "message"), [
    # A newline: a shell command of the batch script (the probe's `touch PWNED_*` ran), and every directive
    # after it dropped (sbatch reads none past the first command).
    ("/a/evil\ntouch PWNED_NAME\n#.py", "/j", {}, f"app file '/a/evil\\ntouch PWNED_NAME\\n#.py': '\\n' {_CONTROL}"),
    ("/a/app.py", "/j", {"partition": "cpu\ntouch PWNED_PART"}, f"--partition 'cpu\\ntouch PWNED_PART': '\\n' {_CONTROL}"),
    ("/a/app.py", "/j", {"time_limit": "1:00\rdate"}, f"--time '1:00\\rdate': '\\r' {_CONTROL}"),
    ("/a/app.py", "/j", {"sbatch_args": ["--mem=8G\nid"]}, f"--sbatch-arg '--mem=8G\\nid': '\\n' {_CONTROL}"),
    ("/a/app.py", "/j\n/x", {}, f"--out '/j\\n/x': '\\n' {_CONTROL}"),
    ("/a/app.py", "/j", {"run_args": ["--set", "note=a\x85b"]}, f"--set 'note=a\\x85b': '\\x85' {_CONTROL}"),
    ("/a/app.py", "/j", {"run_args": ["x\x7f", "--async"]}, f"run option 'x\\x7f': '\\x7f' {_CONTROL}"),
    # An --sbatch-arg that is not one option (whitespace, '#', quotes and backslashes elsewhere are carried,
    # quoted: test_sbatch_reads_back_each_value_as_given).
    ("/a/app.py", "/j", {"sbatch_args": ["--mem 8G"]},
     "--sbatch-arg '--mem 8G': ' ' in the option's name: give one option each, its value after '=', as "
     "--sbatch-arg=--mem=8G"),
    ("/a/app.py", "/j", {"sbatch_args": ["mem=8G"]},
     "--sbatch-arg 'mem=8G': not an sbatch option (one option each: --sbatch-arg=--mem=8G)"),
    # '%' in the output path: sbatch expands it (%j, %x, %%), so the output went elsewhere; a backslash there
    # Slurm drops, and then expands no '%' (seen: an output path /d/b\sl/slurm-%j.out wrote /d/bsl/slurm-%j.out).
    ("/a/app.py", "/runs/100%x", {}, "--out '/runs/100%x': '%' cannot go into the job's output path (sbatch "
                                     "expands '%' there: %j is the job id)"),
    ("/a/app.py", "/runs/a\\b", {}, "--out '/runs/a\\\\b': '\\\\' cannot go into the job's output path (Slurm drops "
                                    "a backslash there and then expands no '%': the output went to another file)"),
])
def test_a_value_that_would_change_the_batch_script_is_refused_naming_it(app, out, kw, message):
    """Regression (session 75, a careless user's probe): the #SBATCH lines were written unquoted, so a
    newline in the app's file name, ``--partition``, ``--time`` or an ``--sbatch-arg`` ran a shell command
    in the job (and silently dropped the directives after it); '%' or a backslash in ``--out`` sent the
    job's output elsewhere. Each is refused in one line naming the option and the character."""
    kw = {"nodes": 2, "tasks_per_node": 1, **kw}
    run_args = kw.pop("run_args", [])
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        sbatch_script(app, run_args, Path(out), **kw)


def test_a_refused_value_writes_and_submits_nothing(tmp_path, monkeypatch):
    """The probe's app file named ``evil\\ntouch PWNED_NAME\\n#.py`` (a fake sbatch on PATH): refused before
    the job directory is made or sbatch runs, so no script holding the command is left behind either."""
    _fake(tmp_path / "bin", "sbatch", f"echo called >> {tmp_path}/sbatch.calls\necho 4242\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)
    evil = tmp_path / "evil\ntouch PWNED_NAME\n#.py"
    evil.write_text(Path(DQN).read_text())
    with pytest.raises(ValueError, match=r"^app file '.*evil\\ntouch PWNED_NAME\\n#\.py': '\\n' is a control "):
        submit(str(evil), [], tmp_path / "job", nodes=2, tasks_per_node=1)
    with pytest.raises(ValueError, match=r"^--partition 'cpu\\ntouch PWNED_PART': '\\n' is a control "):
        submit(DQN, [], tmp_path / "job", nodes=2, tasks_per_node=1, partition="cpu\ntouch PWNED_PART")
    assert not (tmp_path / "job").exists() and not (tmp_path / "sbatch.calls").exists()
    assert not list(tmp_path.glob("PWNED*"))


_C_SPACE = " \t\n\v\f\r"  # C's isspace in the C locale


def _sbatch_reads(line: str) -> list[str]:
    """The arguments sbatch 22.05 reads in what follows ``#SBATCH``: its get_argument (src/sbatch/opt.c),
    step for step. The whitespace test comes before the backslash's, so a backslash escapes no whitespace;
    an unquoted, unescaped '#' ends the line; an argument of nothing (``""``) ends it too."""
    args, i = [], 0
    while True:
        while i < len(line) and line[i] in _C_SPACE:
            i += 1
        arg, escape, quote = None, False, ""
        while i < len(line) and (quote or line[i] not in _C_SPACE) and line[i] != "\n":
            c = line[i]
            if escape:
                escape = False
            elif c == "\\":
                escape, i = True, i + 1
                continue
            elif quote:
                if c == quote:
                    quote, i = "", i + 1
                    continue
            elif c in "'\"":
                quote, i = c, i + 1
                continue
            elif c == "#":
                break
            arg, i = (arg or "") + c, i + 1
        assert not quote, f"sbatch: Unmatched `{quote}` in [{line}]"
        if arg is None:
            return args
        args.append(arg)


_AWKWARD = ["my experiment #3", "it's", 'say "hi"', "C:\\dir\\", "a\\'b", "  lead 'x' \"y\" \\z #w # \\",
            "#", "'", '"', "\\", "a\xa0b\u3000c"]


def test_an_sbatch_lines_value_is_quoted_only_where_sbatch_would_read_it_otherwise():
    """A value with whitespace, '#', a quote or a backslash is double-quoted (its value alone, after the
    option's '='), its backslashes and double quotes escaped; any other is written as it is. sbatch's
    reading (its get_argument, as :func:`_sbatch_reads` steps through it) gives back the value exactly:
    one argument, nothing dropped as a comment. (The real sbatch reads them alike:
    test_sbatch_reads_back_each_value_as_given.)"""
    assert _sbatch_quote("--mem=8G") == "--mem=8G"
    assert _sbatch_quote("--comment=my experiment #3") == '--comment="my experiment #3"'
    assert _sbatch_quote("--comment=say \"hi\" C:\\x") == '--comment="say \\"hi\\" C:\\\\x"'
    assert _sbatch_quote("--comment=it's") == '--comment="it\'s"'
    assert _sbatch_quote("-Jmy job") == '"-Jmy job"'  # (no '=': the whole argument)
    assert _sbatch_quote("--com'ment=x y") == '"--com\'ment=x y"'  # (the name itself needs it: the whole)
    for value in _AWKWARD:
        for arg in (f"--comment={value}", f"-J{value}", f"--output=/jobs/{value}/slurm-%j.out"):
            assert _sbatch_reads(_sbatch_quote(arg)) == [arg], arg
    text = sbatch_script("/a/app.py", [], Path("/jobs/my run #3"), nodes=1, tasks_per_node=1, partition="gpu #2",
                         time_limit="1:00 '\\", sbatch_args=["--comment=it's \"x\"", "--exclusive"])
    directives = [line.removeprefix("#SBATCH") for line in text.splitlines() if line.startswith("#SBATCH")]
    assert directives == [' --job-name=reactor-app', ' --nodes=1', ' --ntasks-per-node=1',
                          ' --output="/jobs/my run #3/slurm-%j.out"', ' --partition="gpu #2"',
                          ' --time="1:00 \'\\\\"', ' --comment="it\'s \\"x\\""', ' --exclusive']
    assert [a for d in directives for a in _sbatch_reads(d)] == [
        "--job-name=reactor-app", "--nodes=1", "--ntasks-per-node=1", "--output=/jobs/my run #3/slurm-%j.out",
        "--partition=gpu #2", "--time=1:00 '\\", "--comment=it's \"x\"", "--exclusive"]


@pytest.fixture(scope="module")
def local_slurm() -> None:
    """The local Slurm cluster of tests/launch/test_slurm.py (scripts/slurm_local.sh, as root; the test
    session stops it at its end if it started it: tests/conftest.py), or a skip saying why there is none."""
    if os.geteuid() != 0:
        pytest.skip("a local Slurm needs root")
    got = subprocess.run(["bash", str(ROOT / "scripts" / "slurm_local.sh")], capture_output=True, text=True,
                         timeout=600)
    if got.returncode != 0:
        pytest.skip(f"no local Slurm here: {got.stderr.strip()[-500:]}")
    if shutil.which("sbatch") is None or shutil.which("scontrol") is None:
        pytest.skip("the local Slurm has no sbatch or scontrol on PATH")


def _sbatch(script: Path, *options: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """``sbatch --parsable -v OPTIONS SCRIPT`` from the script's directory: its answer, and the job's id ("" if
    it made none)."""
    got = subprocess.run(["sbatch", "--parsable", "-v", *options, str(script)], capture_output=True, text=True,
                         cwd=script.parent, timeout=60)
    job = got.stdout.strip().split(";")[0]
    return got, job if got.returncode == 0 and job.isdigit() else ""


@pytest.mark.parametrize("value", _AWKWARD)
def test_sbatch_reads_back_each_value_as_given(local_slurm, value, tmp_path, monkeypatch):
    """What the user needs an #SBATCH line to hold (``--sbatch-arg='--comment=my experiment #3'``, a job
    directory with a space, a quote or a '#') was refused: it is now quoted, and the real sbatch reads it
    back exactly. The job is submitted held and cancelled at once: Slurm's record of it says the comment
    (``squeue %k``) and the job directory (``scontrol show job``'s StdOut, the output path with %j
    expanded) as given. (A backslash cannot go into the job directory: Slurm reads it in an output path.)"""
    monkeypatch.chdir(tmp_path)
    job_dir = tmp_path / f"job{value.replace(chr(92), '')}"
    script = tmp_path / "job.sbatch"
    script.write_text(sbatch_script(DQN, [], job_dir, nodes=1, tasks_per_node=1, time_limit="5",
                                    sbatch_args=[f"--comment={value}"]))
    got, job = _sbatch(script, "--hold")
    try:
        assert job, f"sbatch refused it: {got.stderr.strip()[-2000:]}\n{script.read_text()}"
        comment = subprocess.run(["squeue", "-h", "-j", job, "-o", "%k"], capture_output=True, text=True,
                                 timeout=30).stdout
        shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30).stdout
    finally:
        if job:
            subprocess.run(["scancel", job], capture_output=True, timeout=30)
    assert comment == f"{value}\n"
    assert f"\n   StdOut={job_dir}/slurm-{job}.out\n" in shown, shown


def test_sbatch_reads_back_a_partition_as_given(local_slurm, tmp_path, monkeypatch):
    """``--partition`` is quoted alike: sbatch reads the name as given (its ``-v`` list of the options it
    read) and Slurm refuses it as no partition of the cluster, as it would any other."""
    monkeypatch.chdir(tmp_path)
    value = "gpu #2 'a' \"b\" \\c"
    script = tmp_path / "job.sbatch"
    script.write_text(sbatch_script(DQN, [], tmp_path / "job", nodes=1, tasks_per_node=1, partition=value))
    got, job = _sbatch(script, "--hold")
    if job:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
    assert got.returncode != 0 and f"sbatch: {'partition':<20}: {value}" in got.stderr.splitlines(), got.stderr


# ------------------------------------------------------------------------------ the node list


def _working_scontrol() -> str | None:
    """Why the real ``scontrol show hostnames`` cannot be used here, or None (it expands a list: it needs
    a Slurm configuration to read, and without one retries for a minute)."""
    if shutil.which("scontrol") is None:
        return "no scontrol on PATH"
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", "n[1-2]"], capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired:
        return "scontrol show hostnames did not answer within 15 s (no Slurm configuration?)"
    return None if out.stdout.split() == ["n1", "n2"] else f"scontrol show hostnames: {out.stderr.strip()[-300:]}"


@pytest.mark.parametrize(("nodelist", "message"), [
    ("node[1-3,x]", "scontrol show hostnames cannot expand it (scontrol: error: _parse_single_range: Invalid range: "
                    "`x'; Invalid hostlist: node[1-3,x])"),
    ("node[]", "scontrol show hostnames cannot expand it (scontrol: error: _parse_single_range: Invalid range: `'; "
               "Invalid hostlist: node[])"),
    ("node[3-1]", "scontrol show hostnames cannot expand it (scontrol: error: _parse_single_range: Invalid range: "
                  "`3-1'; Invalid hostlist: node[3-1])"),
    ("node[0-99999999]", "scontrol show hostnames cannot expand it (scontrol: error: _parse_single_range: Too many "
                         "hosts in range `0-99999999'; Invalid hostlist: node[0-99999999])"),
    ("node[1-3", "scontrol expanded it to 'node]', not a node's name (letters, digits, '_', '.' and '-'): is a "
                 "bracket unclosed?"),
    ("a,b,a", "names node a twice"),
])
def test_a_node_list_the_real_scontrol_cannot_expand_is_refused_naming_it(nodelist, message, monkeypatch):
    """Regression (session 75, a careless user's probe): ``scontrol show hostnames`` exits 0 on a list it
    cannot expand (it says "Invalid hostlist" on stderr, prints no name), so ``node_names`` gave ``[]``
    (``['node]']`` for ``node[1-3``) and ``reactor slurm --here`` went on to "0 daemons on 0 nodes" and
    ``srun --nodes=0``. Slurm's own scontrol: skipped where there is none that works."""
    if why := _working_scontrol():
        pytest.skip(why)
    monkeypatch.setenv("SLURM_JOB_NODELIST", nodelist)
    monkeypatch.delenv("SLURM_JOB_NUM_NODES", raising=False)
    with pytest.raises(SlurmError, match=f"^{re.escape(f'SLURM_JOB_NODELIST {nodelist!r}: {message}')}$"):
        node_names()


def test_a_node_list_the_real_scontrol_expands_is_taken(monkeypatch):
    if why := _working_scontrol():
        pytest.skip(why)
    monkeypatch.setenv("SLURM_JOB_NODELIST", "rx[0-2],gpu07")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "4")
    assert node_names() == ["rx0", "rx1", "rx2", "gpu07"]
    assert node_names("node[01-02]") == ["node01", "node02"]  # (a list given: SLURM_JOB_NUM_NODES is not its count)


def test_an_app_file_name_that_an_sbatch_line_cannot_hold_names_the_job_with_underscores(tmp_path, monkeypatch):
    """The job's name is a label: ``my app#2.py`` is ``reactor-my_app_2``, not a refusal."""
    monkeypatch.chdir(tmp_path)
    text = sbatch_script("/a/my app#2.py", [], tmp_path / "job", nodes=1, tasks_per_node=1)
    assert "#SBATCH --job-name=reactor-my_app_2\n" in text and "'/a/my app#2.py'" in text


def test_a_site_warning_on_scontrols_stderr_is_not_a_refusal(tmp_path, monkeypatch):
    """Only what says the list is invalid, an error or fatal refuses it."""
    _fake(tmp_path / "bin", "scontrol", "echo n1; echo n2; echo 'scontrol: warning: slurm.conf is old' >&2\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    assert node_names("n[1-2]") == ["n1", "n2"]


@pytest.mark.parametrize(("stdout", "stderr", "rc", "message"), [
    ("", "Invalid hostlist: n[1-3,x]\n", 0, "scontrol show hostnames cannot expand it (Invalid hostlist: n[1-3,x])"),
    ("n1\n", "scontrol: error: something\n", 0, "scontrol show hostnames cannot expand it (scontrol: error: something)"),
    ("", "", 0, "scontrol show hostnames cannot expand it (exit status 0, no node named)"),
    ("", "scontrol: fatal: Unable to process configuration file\n", 1,
     "scontrol show hostnames cannot expand it (scontrol: fatal: Unable to process configuration file)"),
    ("n]\n", "", 0, "scontrol expanded it to 'n]', not a node's name (letters, digits, '_', '.' and '-'): is a "
                    "bracket unclosed?"),
])
def test_node_names_reads_scontrols_stderr_and_names_not_its_exit_status_alone(stdout, stderr, rc, message, tmp_path,
                                                                             monkeypatch):
    """The same, wherever Slurm is: a stand-in scontrol that answers as Slurm 22.05's does."""
    (tmp_path / "out").write_text(stdout)
    (tmp_path / "err").write_text(stderr)
    _fake(tmp_path / "bin", "scontrol", f"cat {tmp_path}/out\ncat {tmp_path}/err >&2\nexit {rc}\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(SlurmError, match=f"^{re.escape(f'node list {chr(39)}n[1-3,x]{chr(39)}: {message}')}$"):
        node_names("n[1-3,x]")


def test_a_node_list_of_another_count_than_slurm_job_num_nodes_is_refused(tmp_path, monkeypatch):
    """Slurm gives both: a list that expands to another count of nodes was cut or mangled on its way."""
    _fake(tmp_path / "bin", "scontrol", "echo n1; echo n2\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-2]")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "3")
    with pytest.raises(SlurmError, match=r"^SLURM_JOB_NODELIST 'n\[1-2\]' names 2 nodes, but SLURM_JOB_NUM_NODES "
                                         r"is '3'$"):
        node_names()
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    assert node_names() == ["n1", "n2"]


def test_here_with_a_node_list_scontrol_cannot_expand_starts_no_step(tmp_path):
    """``reactor slurm --here`` under ``SLURM_JOB_NODELIST='node[1-3,x]'``: one line naming the list, exit
    status 1, and no ``srun`` (it ran ``srun --nodes=0`` and failed naming the daemons' step)."""
    _fake(tmp_path / "bin", "scontrol", "echo \"Invalid hostlist: $3\" >&2\n")
    _fake(tmp_path / "bin", "srun", f"echo \"$*\" >> {tmp_path}/srun.calls\nexit 1\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_NODELIST="node[1-3,x]",
               PYTHONPATH=str(ROOT))
    got = subprocess.run([sys.executable, "-m", "reactor.cli", "slurm", "--here", DQN, "--out", str(tmp_path / "job")],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120, env=env)
    assert (got.returncode, got.stderr) == (1, "reactor: SlurmError: SLURM_JOB_NODELIST 'node[1-3,x]': scontrol show "
                                               "hostnames cannot expand it (Invalid hostlist: node[1-3,x])\n")
    assert not (tmp_path / "srun.calls").exists() and not (tmp_path / "job").exists()


# ------------------------------------------------------------------------------ a daemon task's variables


@pytest.mark.parametrize(("env", "message"), [
    ({"SLURM_LOCALID": "x"}, "SLURM_LOCALID 'x': not the index of a task on this node (0 to 1 for 2 per node; Slurm "
                             "sets it for each task)"),
    ({"SLURM_LOCALID": "2"}, "SLURM_LOCALID '2': not the index of a task on this node (0 to 1 for 2 per node; Slurm "
                             "sets it for each task)"),
    ({"SLURM_LOCALID": "0", "SLURM_LAUNCH_NODE_IPADDR": "no-such-host.invalid"},
     "SLURM_LAUNCH_NODE_IPADDR 'no-such-host.invalid': not an IP address (Slurm sets it to the address of the node "
     "srun ran on)"),
    ({"SLURM_LOCALID": "1", "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.1:6817"},
     "SLURM_LAUNCH_NODE_IPADDR '10.0.0.1:6817': not an IP address (Slurm sets it to the address of the node srun "
     "ran on)"),
])
def test_a_daemon_tasks_bad_slurm_variable_is_one_line_naming_it(env, message, tmp_path):
    """Regression (session 75): a bad ``SLURM_LOCALID`` was a ValueError traceback in daemons.log, and a bad
    ``SLURM_LAUNCH_NODE_IPADDR`` a GraphError traceback saying "check the hosts file" (there is none). Now
    one line naming the variable, exit status 1, and no daemon started. (JOB_DIR holds no keys: a daemon
    started by mistake, as the unchecked SLURM_LOCALID=2 did, refuses at once, leaving nothing running.)"""
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    got = subprocess.run([sys.executable, "-m", "reactor.launch._slurm", "daemon-task", str(tmp_path / "job"), "2"],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path,
                         env={**base, "SLURMD_NODENAME": "n1", "PYTHONPATH": str(ROOT), **env})
    assert (got.returncode, got.stdout, got.stderr) == (1, "", f"reactor slurm daemon-task: {message}\n")
    assert not (tmp_path / "job").exists()


# ------------------------------------------------------------------------------ Kubernetes manifests


def test_every_character_of_the_manifests_comes_back_from_yaml_as_written(tmp_path):
    """Regression (session 75, a careless user's probe): the values were JSON with ``ensure_ascii=False``,
    so an app file holding DEL, a C1 control or U+FFFE rendered with exit status 0 and PyYAML (and
    go-yaml, Kubernetes') refused the output, and NEL, U+2028 and U+2029 came back as other characters.
    A character past U+FFFF stays as it is: json's surrogate-pair escape for it is two lone surrogates to
    PyYAML and refused by go-yaml."""
    yaml = pytest.importorskip("yaml")
    from reactor.launch._k8s import render

    hostile = "".join(["# DEL \x7f C1 \x80\x9f NEL \x85 LS \u2028 PS \u2029 \ufffe \uffff BOM \ufeff NBSP \xa0\n",
                       "S = 'caf\xe9 \u6f22\u5b57 \U0001f600 \U0001d7d9 \\u00e9 \"q\" \\\\ \t'\n"])
    app = tmp_path / "odd_app.py"
    app.write_text(Path(DQN).read_text() + hostile)
    note = "note=a\x7fb\x85c\u2028d\U0001f600"
    text = render(str(app), ["--set", note], replicas=2, image="x")
    docs = {d["kind"]: d for d in yaml.safe_load_all(text)}
    assert docs["ConfigMap"]["data"]["odd_app.py"] == app.read_text()
    assert docs["Job"]["spec"]["template"]["spec"]["containers"][0]["command"][-1] == note
    assert "\\ud83d" not in text and "\U0001f600" in text  # (no surrogate-pair escape: go-yaml refuses one)
    assert not re.search("[\x7f-\x9f\u2028\u2029\ufffe\uffff]", text)


@pytest.mark.parametrize(("args", "said"), [
    (["--address", "garbage"], "reactor: RayError: --address 'garbage': not a Ray cluster's address (auto, local, "
                               "ray://HOST:PORT, or HOST:PORT)"),
    (["--address", "ray://h:99999"], "reactor: RayError: --address 'ray://h:99999': not a Ray cluster's address"),
    (["--address", "127.0.0.1:{port}"], "reactor: RayError: --address 127.0.0.1:{port}: nothing accepts a connection "
                                        "there (Connection refused)"),
    (["--cpus-per-daemon", "nan"], "reactor: RayError: --cpus-per-daemon nan: a positive number of CPUs expected"),
    (["--cpus-per-daemon", "-1"], "reactor: RayError: --cpus-per-daemon -1.0: a positive number of CPUs expected"),
    (["--max-restarts", "-7"], "reactor: RayError: --max-restarts -7: a count >= 0 expected"),
])
def test_reactor_ray_refuses_an_address_or_a_number_it_cannot_use_in_one_line_before_ray_starts(args, said, tmp_path):
    """``--address garbage`` was Ray's ``ValueError`` in a traceback; ``--address 127.0.0.1:1`` left Ray
    retrying its connect for minutes with only its warnings; NaN or negative CPUs and restarts went to Ray."""
    import socket

    with socket.socket() as s:  # (a port nothing listens on: bound, then freed)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [a.format(port=port) for a in args]
    app = Path(__file__).resolve().parents[1] / "apps" / "gated.py"
    p = subprocess.run([sys.executable, "-m", "reactor.cli", "ray", str(app), *args], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path)
    assert p.returncode == 1 and p.stderr.startswith(said.format(port=port)) and len(p.stderr.splitlines()) == 1, \
        p.stderr
