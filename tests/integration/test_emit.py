"""The files of `ftjax launch --emit slurm|k8s` checked without a cluster: the Slurm scripts pass
shellcheck; every Kubernetes manifest validates strictly against the Kubernetes API schema (the
`kubernetes-validate` package's) and the JobSet CRD's (tests/data/jobset), and an injected typo
fails; names derive from the job; the Dockerfile installs the package as the README says. The
emitted Slurm job runs on a real cluster in tests/cluster/test_slurm.py (`make slurm-test`)."""

import ast
import copy
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from importlib import resources
from pathlib import Path

import jsonschema
import pytest
import yaml
from conftest import REPO
from kubernetes_validate import utils as kv
from referencing import Registry, Resource

from ftjax.launch.cli import main
from ftjax.launch.cluster.options import COORDINATOR_PORT
from ftjax.launch.emit import EmitError, EmitOptions, emit

TINY = f"{REPO}/configs/tiny.yaml"
CI = os.environ.get("CI") == "true"
JOB = ["ft.replicas=3", "mesh.hosts=2", "steps=77"]
# the oldest Kubernetes the manifests need (gRPC probes, podFailurePolicy with containerName) and
# the newest the installed kubernetes-validate knows
K8S_VERSIONS = ("1.29", kv.major_minor(kv.latest_version()))
JOBSET_SCHEMA = Path(REPO, "tests", "data", "jobset", "jobset.x-k8s.io_v1alpha2.v0.12.0.json")

SLURM_VARIANTS = {
    "plain": EmitOptions(name="plain"),
    "all-options": EmitOptions(
        name="big-job",
        gpus_per_host=8,
        cpus_per_host=32,
        mem_per_host_gib=480,
        time="2-00:00:00",
        partition="gpu,gpu-long",
        account="ml",
        exclusive=True,
        max_restarts=0,
        restart_delay_s=30,
    ),
}
K8S_VARIANTS = {
    "plain": EmitOptions(name="plain"),
    "pvc": EmitOptions(name="with-claim", pvc="shared-runs"),
    "all-options": EmitOptions(
        name="big-job",
        image="registry.example/ftjax:0.1.0",
        gpus_per_host=8,
        cpus_per_host=32,
        mem_per_host_gib=480,
        pvc="big-job-runs",
        pvc_size="1Ti",
        storage_class="fast-rwx",
        max_restarts=7,
        idle_exit_s=1800,
    ),
}


# --- Slurm ------------------------------------------------------------------------------------------
REDUCE = ["ft.global_batch=constant", "ft.on_host_loss=reduce"]
SHELLCHECK_CASES = [(v, h, []) for v in SLURM_VARIANTS for h in (1, 2)] + [
    ("plain", 4, REDUCE),
    ("all-options", 2, REDUCE),
]


@pytest.mark.parametrize(
    "variant,hosts,policy",
    SHELLCHECK_CASES,
    ids=[f"{v}-{h}-{'reduce' if p else 'restart'}" for v, h, p in SHELLCHECK_CASES],
)
def test_emitted_slurm_scripts_pass_shellcheck(tmp_path, variant, hosts, policy):
    _shellcheck_or_skip()
    files = emit(
        "slurm", tmp_path / "job", TINY, [*JOB, f"mesh.hosts={hosts}", *policy], options=SLURM_VARIANTS[variant]
    )
    scripts = [str(p) for p in files if p.suffix in (".sbatch", ".sh")]
    assert len(scripts) == 6  # coordinator, 3 replicas, finish, submit
    r = subprocess.run(
        ["shellcheck", "--severity=style", "--shell=bash", *scripts, str(Path(REPO, "scripts", "local_slurm.sh"))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def _shellcheck_or_skip() -> None:
    if shutil.which("shellcheck") is None:
        if CI:
            pytest.fail("shellcheck is not installed (apt-get install shellcheck; .ci/run does)")
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")


def test_the_script_templates_pass_shellcheck():
    """The bash of the Slurm files lives in package-data templates, checked as they are: their
    placeholders are shell parameters (`${TPL_X}`), and templates/.shellcheckrc leaves out only what
    a placeholder or a variable of another template triggers (the emitted scripts are checked in full,
    above)."""
    _shellcheck_or_skip()
    folder = resources.files("ftjax.launch.cluster").joinpath("templates")
    templates = sorted(str(t) for t in folder.iterdir() if t.name.endswith((".sh", ".sbatch")))
    assert len(templates) == 10  # 4 scripts and 6 fragments
    r = subprocess.run(
        ["shellcheck", "--severity=style", "--shell=bash", *templates], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr


def _bash_in_strings(path: Path) -> list[str]:
    """The string literals of a module (docstrings aside; an f-string's fields as `{}`) that hold a
    script: a shebang, or 3 lines or more of shell (lines neither blank nor comments)."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            text = node.value
        else:
            continue
        shell = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        if text.lstrip().startswith("#!") or len(shell) >= 3:
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: {text[:60]!r}")
    return found


def test_no_bash_script_lives_in_a_python_string():
    """ftjax/launch keeps its bash in templates/ (shellcheck reads them, an editor highlights them)."""
    found = [hit for path in sorted(Path(REPO, "ftjax", "launch").rglob("*.py")) for hit in _bash_in_strings(path)]
    assert not found, "bash in Python strings:\n" + "\n".join(found)


def test_the_bash_check_sees_a_script_in_a_string(tmp_path):
    """The check itself: a script in a string, plain or formatted, is found; prose and comments are not."""
    module = tmp_path / "m.py"
    module.write_text(
        '"""A docstring\nof three\nlines."""\n'
        'A = "#!/bin/bash\\nexit 0\\n"\n'
        'B = f"set -e\\ncd {A}\\necho hi\\n"\n'
        'C = "# one\\n# two\\n# three\\n"\n'
    )
    with pytest.MonkeyPatch.context() as m:
        m.setattr(sys.modules[__name__], "REPO", str(tmp_path))
        assert [hit.split(":")[1] for hit in _bash_in_strings(module)] == ["4", "5"]


def test_slurm_scripts_ask_for_what_the_options_say(tmp_path):
    emit("slurm", tmp_path / "job", TINY, JOB, options=SLURM_VARIANTS["all-options"])
    replica = (tmp_path / "job" / "replica-2.sbatch").read_text()
    directives = re.findall(r"^#SBATCH (\S+)", replica, re.M)
    assert directives == [
        "--job-name=big-job-replica-2",
        "--nodes=2",
        "--ntasks-per-node=1",
        "--cpus-per-task=32",
        "--mem=491520M",
        "--gpus-per-node=8",
        "--exclusive",
        "--time=2-00:00:00",
        "--partition=gpu,gpu-long",
        "--account=ml",
        "--requeue",
        "--open-mode=append",
        "--output=slurm-%x-%j.out",
    ]
    assert "--cpus-per-task=32 \\" in replica  # srun does not inherit it
    assert 'while [ "$(restarts)" -le 0 ]' in replica and "sleep 30" in replica
    coordinator = (tmp_path / "job" / "coordinator.sbatch").read_text()
    assert "--job-name=big-job-coordinator" in coordinator and "--gpus" not in coordinator
    assert "--expected-replicas 3 --final-step 77" in coordinator
    for fixed in ("29400", "29401", "29500"):  # no fixed port: every job may share a node
        assert fixed not in replica + coordinator
    submit = (tmp_path / "job" / "submit.sh").read_text()
    assert '--dependency="after:$coordinator"' in submit and '--dependency="afterany$replicas"' in submit


def test_a_missing_or_empty_token_stops_a_replica_script(tmp_path):
    """SC2155 (`export X=$(cat f)`) hid a missing token file: the replica started without one."""
    emit("slurm", tmp_path / "job", TINY, JOB, options=EmitOptions(name="tok"))
    job = tmp_path / "job"
    for state in ("missing", "empty"):
        (job / "token").unlink(missing_ok=True)
        if state == "empty":
            (job / "token").write_text("")
        r = subprocess.run(
            ["bash", str(job / "replica-0.sbatch")],
            env={**os.environ, "FTJAX_JOB_DIR": str(job)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2 and f"no job token in {job}/token" in r.stderr, (state, r.stderr)
        r = subprocess.run(
            ["bash", str(job / "coordinator.sbatch")],
            env={**os.environ, "FTJAX_JOB_DIR": str(job)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2 and "no job token" in r.stderr, (state, r.stderr)


# The Slurm commands a replica script calls, faked: a cluster of nodes n1..nH that the test
# drains and resumes (files under STUB), and an srun that plays each step from STUB/steps.
_FAKE_SLURM = {
    "scontrol": """case "$1 $2" in
  "show hostnames") echo "$3" | tr ',' '\\n' ;;
  "show job") echo "JobId=$3 Restarts=${FAKE_RESTARTS:-0}" ;;
  *) echo "$*" >> "$STUB/scontrol.log" ;;
esac""",
    "squeue": 'case "$*" in *%N*) cat "$STUB/allocation" ;; *) echo "$*" >> "$STUB/squeue.log" ;; esac',
    "sinfo": 'for a in "$@"; do case $prev in -n) cat "$STUB/state-$a" 2>/dev/null || echo alloc ;; esac; prev=$a; done',
    "scancel": 'echo "$*" >> "$STUB/scancel.log"; kill -TERM "$(cat "$STUB/srun.pid")"',
    "srun": """n=$(($(cat "$STUB/calls" 2>/dev/null || echo 0) + 1))
echo "$n" > "$STUB/calls"
printf '%s\\n' "$@" > "$STUB/srun-$n.args"
echo $$ > "$STUB/srun.pid"
step=$(sed -n "${n}p" "$STUB/steps")
case $step in
  lose\\ *) echo drng > "$STUB/state-${step#lose }"; exit 137 ;;  # a node fails: its process dies
  "back "*) trap 'exit 76' TERM  # the node is back: run until asked to leave
    echo idle > "$STUB/state-${step#back }"
    for _ in $(seq 300); do sleep 0.1; done; exit 1 ;;  # at most ~30 s: never outlives a failed test
  *) exit "$step" ;;
esac""",
}


def _run_replica_script(
    tmp_path,
    overrides: list[str],
    steps: list[str],
    *,
    restarts: int = 0,
    events: str = "",
    attempts: int = 0,
    hosts: int = 2,
) -> tuple[list[dict], list[list[str]], str]:
    """Replica 0's script of a job of `hosts`-host replicas, run against the fake Slurm: its events,
    each srun's arguments, and its stderr."""
    job, stub = tmp_path / "job", tmp_path / "stub"
    nodes = ",".join(f"n{k}" for k in range(1, hosts + 1))
    emit(
        "slurm",
        job,
        TINY,
        ["ft.replicas=2", f"mesh.hosts={hosts}", "data.batch_size=16", *overrides],
        options=EmitOptions(name="fake", restart_delay_s=0),
    )
    stub.mkdir()
    for command, body in _FAKE_SLURM.items():
        (stub / command).write_text("#!/bin/bash\n" + body + "\n")
        (stub / command).chmod(0o755)
    (stub / "allocation").write_text(nodes + "\n")
    (stub / "steps").write_text("\n".join(steps) + "\n")
    out = job / "run" / "replica-0"
    out.mkdir(parents=True)
    (job / "run" / "coordinator.address").write_text("127.0.0.1:1\n")
    (out / "slurm-events.jsonl").write_text(events)
    if attempts:
        (out / "slurm-attempts").write_text(f"{attempts}\n")
    env = {
        **os.environ,
        "PATH": f"{stub}:{os.environ['PATH']}",
        "STUB": str(stub),
        "FTJAX_JOB_DIR": str(job),
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": nodes,
        "SLURM_RESTART_COUNT": str(restarts),
    }
    r = subprocess.run(["bash", str(job / "replica-0.sbatch")], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    calls = int((stub / "calls").read_text())
    args = [(stub / f"srun-{n}.args").read_text().splitlines() for n in range(1, calls + 1)]
    return [json.loads(line) for line in (out / "slurm-events.jsonl").read_text().splitlines()], args, r.stderr


def _srun_places(args: list[str]) -> tuple[str, list[str]]:
    """(--nodelist, the overrides after the config) of one srun."""
    nodelist = next(a.split("=", 1)[1] for a in args if a.startswith("--nodelist="))
    config = next(i for i, a in enumerate(args) if a.endswith("config.yaml"))
    return nodelist, args[config + 1 : args.index("--out")]


def test_a_slurm_replica_that_loses_a_node_goes_on_at_reduced_degree_then_whole(tmp_path):
    """ft.on_host_loss: reduce. Host 1's node fails (Slurm reports it draining) and its process dies:
    the replica restarts at once on host 0 alone, with mesh.live_hosts=1 (the local launcher's
    reduced args); once the node is up again it is asked to leave (SIGTERM to the steps, not the
    script), leaves (exit 76) and starts whole; every decision is a record of launcher.jsonl."""
    events, sruns, _ = _run_replica_script(tmp_path, REDUCE, ["lose n2", "back n2", "0"])
    assert [_srun_places(a) for a in sruns] == [("n1,n2", []), ("n1", ["mesh.live_hosts=1"]), ("n1,n2", [])]
    assert "--nodes=1" in sruns[1] and "--ntasks=1" in sruns[1] and "--nodes=2" in sruns[2]
    assert [(e["event"], e.get("cause"), e.get("hosts"), e.get("reduced")) for e in events] == [
        ("replica_started", None, [0, 1], False),
        ("replica_down", "exit", None, None),
        ("replica_started", None, [0], True),
        ("back_to_full_degree", None, [0], None),
        ("replica_down", "left", None, None),
        ("replica_started", None, [0, 1], False),
        ("replica_done", None, None, None),
    ]
    assert events[1]["host"] == 1 and events[4]["codes"] == [76]
    assert [e["incarnation"] for e in events if e["event"] == "replica_started"] == [1, 2, 3]
    assert (tmp_path / "stub" / "scancel.log").read_text() == "--signal=TERM 7\n"
    script = (tmp_path / "job" / "replica-0.sbatch").read_text()
    assert "#SBATCH --no-kill" in script and "DEGREE=(0 1 2)" in script


@pytest.mark.parametrize("fraction,second", [("0.5", ("n1,n3", ["mesh.live_hosts=2"])), ("0.75", ("n1,n2,n3,n4", []))])
def test_a_4_host_slurm_replica_runs_on_the_first_hosts_up_of_the_reduced_degree(tmp_path, fraction, second):
    """Host 1 of 4 lost: 3 up, the largest divisor of 4 they cover is 2 (hosts 0 and 2); with
    ft.reduced_min_fraction 0.75 that is too few, and the replica restarts whole, as with restart."""
    events, sruns, _ = _run_replica_script(
        tmp_path, [*REDUCE, f"ft.reduced_min_fraction={fraction}"], ["lose n2", "0"], hosts=4
    )
    assert [_srun_places(a) for a in sruns] == [("n1,n2,n3,n4", []), second]
    assert events[1]["host"] == 1 and events[2]["reduced"] is (second[1] != [])


def test_the_reduced_degree_table_follows_the_launcher_rule(tmp_path):
    """The script's DEGREE table is `reduced_degree` (the local launcher's rule) at emit time; with
    too few up and a node gone from the (--no-kill) allocation the job requeues itself."""
    job = tmp_path / "job"
    emit(
        "slurm",
        job,
        TINY,
        ["ft.replicas=2", "mesh.hosts=4", *REDUCE, "ft.reduced_min_fraction=0.75", "data.batch_size=16"],
        options=EmitOptions(name="few"),
    )
    script = (job / "replica-0.sbatch").read_text()
    assert "DEGREE=(0 0 0 0 4)" in script  # 3 of 4 up: 2 hosts, under 0.75 of 4
    emit(
        "slurm",
        tmp_path / "half",
        TINY,
        ["ft.replicas=2", "mesh.hosts=4", *REDUCE, "data.batch_size=16"],
        options=EmitOptions(name="half"),
    )
    assert "DEGREE=(0 0 2 2 4)" in (tmp_path / "half" / "replica-0.sbatch").read_text()
    assert 'if [ "$(allocated | wc -l)" -lt 4 ]' in script and 'scontrol requeue "$SLURM_JOB_ID"' in script


def test_with_ft_on_host_loss_restart_a_slurm_replica_restarts_whole(tmp_path):
    events, sruns, _ = _run_replica_script(tmp_path, [], ["lose n2", "0"])
    assert [_srun_places(a) for a in sruns] == [("n1,n2", []), ("n1,n2", [])]
    assert [(e["event"], e.get("reduced")) for e in events] == [
        ("replica_started", False),
        ("replica_down", None),
        ("replica_started", False),
        ("replica_done", None),
    ]
    assert "--no-kill" not in (tmp_path / "job" / "replica-0.sbatch").read_text()


def test_a_requeued_slurm_replica_records_the_requeue_as_a_failure(tmp_path):
    """Its node died while it ran (nobody recorded the end): the requeued job (SLURM_RESTART_COUNT
    1) records replica_down with cause requeue before it starts again, so the summary lists it."""
    events, _, _ = _run_replica_script(
        tmp_path,
        [],
        ["0"],
        restarts=1,
        attempts=1,
        events='{"time": 1.0, "event": "replica_started", "replica": 0, "incarnation": 1}\n',
    )
    assert [(e["event"], e.get("cause")) for e in events] == [
        ("replica_started", None),
        ("replica_down", "requeue"),
        ("replica_started", None),
        ("replica_done", None),
    ]
    assert events[2]["incarnation"] == 2


# --- Kubernetes: strict validation ------------------------------------------------------------------
def _strict(schema):
    """A CRD's structural schema made strict: an object that lists its properties takes no other
    (what the API server prunes, `kubectl --validate=strict` refuses)."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) if k not in ("enum", "required", "default", "example") else v for k, v in schema.items()}
    if (
        "properties" in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
        and "additionalProperties" not in schema
    ):
        out["additionalProperties"] = False
    return out


def _directory(version: str) -> str:
    full = [v for v in kv.all_versions() if kv.major_minor(v) == version][-1]
    return f"kubernetes-json-schema/v{full}-local-strict"


@functools.cache
def _definitions(version: str) -> Registry:
    return Resource.from_contents(kv.schema_contents(f"{_directory(version)}/_definitions.json", version)) @ Registry()


@functools.cache
def _k8s_validator(kind_file: str, version: str) -> jsonschema.Draft202012Validator:
    """The strict validator of one schema that kubernetes-validate ships (`job-batch-v1`,
    `jobtemplatespec-batch-v1`, ...): what `kubernetes-validate --strict` runs, loaded once."""
    try:
        schema = kv.schema_contents(f"{_directory(version)}/{kind_file}.json", version)
    except FileNotFoundError:
        raise kv.SchemaNotFoundError(kind_file, version, "") from None
    return jsonschema.Draft202012Validator(schema, registry=Resource.from_contents(schema) @ _definitions(version))


@functools.cache
def _jobset_validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(_strict(json.loads(JOBSET_SCHEMA.read_text())))


def validate(doc: dict, version: str) -> None:
    """Raise jsonschema.ValidationError unless `doc` is valid, strictly."""
    if doc.get("apiVersion") == "jobset.x-k8s.io/v1alpha2" and doc.get("kind") == "JobSet":
        _jobset_validator().validate(doc)
        # the CRD leaves metadata open, and embeds the Job template: the Kubernetes schemas check them
        _k8s_validator("objectmeta-meta-v1", version).validate(doc["metadata"])
        for job in doc["spec"]["replicatedJobs"]:
            _k8s_validator("jobtemplatespec-batch-v1", version).validate(job["template"])
        return
    # kubernetes-validate's file for the kind: rbac.authorization.k8s.io/v1 Role -> role-rbac-v1
    api = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", doc["apiVersion"])
    _k8s_validator(f"{doc['kind'].lower()}-{api}", version).validate(doc)


def _manifests(tmp_path, options: EmitOptions) -> dict[str, list[dict]]:
    files = emit("k8s", tmp_path / options.name, TINY, JOB, options=options)
    assert not [p for p in files if re.search(r"[&*]id\d", p.read_text())]  # no YAML anchors or aliases
    return {p.name: [d for d in yaml.safe_load_all(p.read_text()) if d] for p in files}


@pytest.mark.parametrize("variant", K8S_VARIANTS)
def test_every_emitted_manifest_validates_strictly(tmp_path, variant):
    manifests = _manifests(tmp_path, K8S_VARIANTS[variant])
    assert sorted(manifests) == ["coordinator.yaml", "replica-0.yaml", "replica-1.yaml", "replica-2.yaml", "token.yaml"]
    kinds = [d["kind"] for docs in manifests.values() for d in docs]
    assert kinds.count("JobSet") == 3 and {"Secret", "ConfigMap", "Job", "Service"} <= set(kinds)
    for version in K8S_VERSIONS:
        for docs in manifests.values():
            for doc in docs:
                validate(doc, version)


# (file, path to a mapping, key to misspell): a typo in a field name at each level that matters
TYPOS = [
    ("coordinator.yaml", ("Job", "spec"), "podFailurePolicy"),
    ("coordinator.yaml", ("Job", "spec", "template", "spec", "containers", 0), "readinessProbe"),
    ("coordinator.yaml", ("Job", "spec", "template", "spec", "containers", 0, "livenessProbe"), "grpc"),
    ("coordinator.yaml", ("Service", "spec"), "selector"),
    ("token.yaml", ("Secret",), "stringData"),
    ("replica-1.yaml", ("JobSet", "spec"), "failurePolicy"),
    ("replica-1.yaml", ("JobSet", "spec", "network"), "enableDNSHostnames"),
    ("replica-1.yaml", ("JobSet", "metadata"), "labels"),
    ("replica-1.yaml", ("JobSet", "spec", "replicatedJobs", 0, "template", "spec"), "completionMode"),
    (
        "replica-1.yaml",
        ("JobSet", "spec", "replicatedJobs", 0, "template", "spec", "template", "spec", "containers", 0, "resources"),
        "requests",
    ),
    (
        "replica-1.yaml",
        ("JobSet", "spec", "replicatedJobs", 0, "template", "spec", "template", "spec", "volumes", 1),
        "persistentVolumeClaim",
    ),
]


@pytest.mark.parametrize("file,where,key", TYPOS, ids=[f"{f}:{k}" for f, _, k in TYPOS])
def test_a_misspelt_field_fails_validation(tmp_path, file, where, key):
    """The negative control: the same manifests with one field name misspelt do not validate."""
    manifests = _manifests(tmp_path, K8S_VARIANTS["pvc"])
    (doc,) = [d for d in manifests[file] if d["kind"] == where[0]]
    validate(doc, K8S_VERSIONS[-1])  # valid as emitted
    bad = copy.deepcopy(doc)
    node = bad
    for step in where[1:]:
        node = node[step]
    assert key in node, (where, sorted(node))
    node[key[:-2] + key[-1] + key[-2]] = node.pop(key)  # swap the last two letters
    with pytest.raises(jsonschema.ValidationError):
        validate(bad, K8S_VERSIONS[-1])


def test_an_unknown_kind_is_not_waved_through():
    with pytest.raises(kv.SchemaNotFoundError):
        validate({"apiVersion": "v1", "kind": "Podd", "metadata": {"name": "x"}}, K8S_VERSIONS[-1])


# --- Kubernetes: what the manifests say -------------------------------------------------------------
def test_two_jobs_share_no_name_in_a_namespace(tmp_path):
    a = _manifests(tmp_path, EmitOptions(name="job-a"))
    b = _manifests(tmp_path, EmitOptions(name="job-b"))

    def names(manifests):
        return {(d["kind"], d["metadata"]["name"]) for docs in manifests.values() for d in docs}

    assert not names(a) & names(b)
    assert all(n.startswith("job-a-") for _, n in names(a))
    # the default name is the config's, with a random suffix
    c, d = (emit("k8s", tmp_path / x, TINY, JOB) for x in ("c", "d"))
    default_names = {yaml.safe_load(p.read_text())["metadata"]["name"] for p in c + d if p.name == "replica-0.yaml"}
    assert len(default_names) == 2 and all(re.fullmatch(r"ftjax-tiny-[0-9a-f]{4}-replica-0", n) for n in default_names)


def test_the_token_is_only_in_a_file_its_owner_alone_reads(tmp_path):
    """Issue 26 item 9d: it was in plain text in a world-readable coordinator.yaml."""
    files = {p.name: p for p in emit("k8s", tmp_path / "job", TINY, JOB, options=EmitOptions(name="job"))}
    (secret,) = yaml.safe_load_all(files["token.yaml"].read_text())
    token = secret["stringData"]["token"]
    assert secret["kind"] == "Secret" and len(token) == 32
    assert files["token.yaml"].stat().st_mode & 0o777 == 0o600
    for name, path in files.items():
        assert name == "token.yaml" or token not in path.read_text(), name
    # every pod takes it from the Secret
    manifests = _manifests(tmp_path, EmitOptions(name="job2"))
    (job,) = [d for d in manifests["coordinator.yaml"] if d["kind"] == "Job"]
    containers = [
        job["spec"]["template"]["spec"]["containers"][0],
        *(
            d["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
            for r in range(3)
            for d in manifests[f"replica-{r}.yaml"]
        ),
    ]
    for c in containers:
        (env,) = [e for e in c["env"] if e["name"] == "FTJAX_TOKEN"]
        assert env["valueFrom"]["secretKeyRef"] == {"name": "job2-token", "key": "token"}


def test_coordinator_probes_requests_lifetime_and_outputs(tmp_path):
    m = _manifests(tmp_path, K8S_VARIANTS["all-options"])
    docs = {d["kind"]: d for d in m["coordinator.yaml"]}
    job = docs["Job"]
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["grpc"] == container["livenessProbe"]["grpc"] == {"port": COORDINATOR_PORT}
    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
    args = container["command"]
    assert args[:2] == ["ftjax", "coordinator"]
    flags = dict(zip(args, args[1:]))
    assert (flags["--expected-replicas"], flags["--final-step"], flags["--idle-exit-s"]) == ("3", "77", "1800")
    # it ends with the job: exit 0 completes the Job; 2 and 3 fail it; an eviction is not a failure
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert rules[0] == {
        "action": "FailJob",
        "onExitCodes": {"containerName": "coordinator", "operator": "In", "values": [2, 3]},
    }
    assert docs["Service"]["spec"]["selector"] == job["spec"]["template"]["metadata"]["labels"]
    assert docs["PersistentVolumeClaim"]["metadata"]["name"] == "big-job-runs"
    assert docs["PersistentVolumeClaim"]["spec"]["storageClassName"] == "fast-rwx"

    js = yaml.safe_load((tmp_path / "big-job" / "replica-2.yaml").read_text())
    assert js["metadata"]["name"] == "big-job-replica-2" and js["spec"]["failurePolicy"] == {"maxRestarts": 7}
    pod = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    train = pod["containers"][0]
    assert train["image"] == "registry.example/ftjax:0.1.0"
    assert train["resources"] == {
        "requests": {"cpu": "32", "memory": "491520Mi"},
        "limits": {"memory": "491520Mi", "nvidia.com/gpu": "8"},
    }
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["run"] == {"name": "run", "persistentVolumeClaim": {"claimName": "big-job-runs"}}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory"}
    assert {"name": "run", "mountPath": "/ftjax-run", "subPath": "big-job"} in train["volumeMounts"]
    script = train["command"][2]
    assert "--coordinator big-job-coordinator:29400" in script
    assert "--dist-address big-job-replica-2-host-0-0.big-job-replica-2:29500" in script
    # the longest pod hostname fits in a DNS label
    assert len("big-job-replica-2-host-0-1") <= 63


def test_without_a_claim_the_outputs_go_to_an_empty_dir(tmp_path):
    js = yaml.safe_load(emit("k8s", tmp_path / "x", TINY, JOB, options=EmitOptions(name="x"))[1].read_text())
    pod = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert {"name": "run", "emptyDir": {}} in pod["volumes"]


BAD_EMIT_OPTIONS = [
    (["--name", "Bad_Name"], "--name"),
    (["--name", "a" * 31], "--name"),
    (["--name", "9lives"], "--name"),
    (["--gpus-per-host", "-1"], "--gpus-per-host"),
    (["--gpu-resource", "nvidia.com/gpu x"], "--gpu-resource"),
    (["--cpus-per-host", "0"], "--cpus-per-host"),
    (["--mem-per-host-gib", "0"], "--mem-per-host-gib"),
    (["--mem-per-host-gib", "inf"], "--mem-per-host-gib"),
    (["--slurm-time", "tomorrow"], "--slurm-time"),
    (["--slurm-partition", "gpu; rm -rf /"], "--slurm-partition"),
    (["--slurm-account", "a b"], "--slurm-account"),
    (["--pvc", "Runs"], "--pvc"),
    (["--pvc-size", "10Gi"], "--pvc-size"),  # without --pvc
    (["--pvc", "runs", "--pvc-size", "ten"], "--pvc-size"),
    (["--storage-class", "fast"], "--storage-class"),  # without --pvc-size
    (["--idle-exit-s", "0"], "--idle-exit-s"),
    (["--image", "a b"], "--image"),
]


@pytest.mark.parametrize("args,problem", BAD_EMIT_OPTIONS, ids=[" ".join(a) for a, _ in BAD_EMIT_OPTIONS])
def test_bad_emit_options_write_nothing(tmp_path, capsys, args, problem):
    out = tmp_path / "k8s"
    assert main([TINY, "--replicas", "2", "--emit", "k8s", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert problem in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_gpus_must_cover_the_devices_each_host_trains_on(tmp_path):
    with pytest.raises(EmitError, match="mesh.devices_per_host"):
        emit(
            "k8s",
            tmp_path / "x",
            TINY,
            [*JOB, "mesh.devices_per_host=4", "data.batch_size=16"],
            options=EmitOptions(name="x", gpus_per_host=2),
        )


# --- the image ------------------------------------------------------------------------------------
def test_the_dockerfile_installs_the_package_as_the_readme_says(tmp_path):
    """The Dockerfile copies the files `pip install .` needs and runs it (README: "pip install .");
    built here from exactly what it copies, the wheel has the configs and the .proto. No docker."""
    dockerfile = Path(REPO, "Dockerfile").read_text()
    lines = [ln.strip() for ln in dockerfile.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    base = next(ln for ln in lines if ln.startswith("FROM "))
    major, minor = map(int, re.search(r"python:(\d+)\.(\d+)", base).groups())
    assert (major, minor) >= (3, 11)  # pyproject: requires-python >= 3.11
    assert any(re.search(r"\bpip install \.(\s|$)", ln) for ln in lines if ln.startswith("RUN ")), lines
    assert "`pip install .`" in Path(REPO, "README.md").read_text()
    context = tmp_path / "context"
    context.mkdir()
    for ln in lines:
        if ln.startswith("COPY "):
            *sources, _ = ln.split()[1:]
            for src in sources:
                path = Path(REPO, src)
                (
                    shutil.copytree(path, context / src, ignore=shutil.ignore_patterns("__pycache__"), symlinks=True)
                    if path.is_dir()
                    else shutil.copy(path, context / src)
                )
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(context),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr
    (wheel,) = tmp_path.glob("ftjax-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for needed in (
        "ftjax/configs/tiny.yaml",
        "ftjax/coordinator/coordinator.proto",
        "ftjax/launch/emit.py",
        "ftjax/launch/cluster/templates/replica.sbatch",
        "ftjax/launch/cluster/templates/reduce.sh",
        "ftjax/coordinator/lifetime.py",
    ):
        assert needed in names
    assert "grpcio-health-checking" in Path(REPO, "pyproject.toml").read_text()


def _job_over(script: str, run: Path, me: int, events: dict[int, list[str]]) -> bool:
    """Run the replica script's `job_over` on replicas' event logs (the last event of each)."""
    for r, names in events.items():
        (run / f"replica-{r}").mkdir(parents=True, exist_ok=True)
        (run / f"replica-{r}" / "slurm-events.jsonl").write_text(
            "".join(f'{{"time": {i}, "event": "{n}", "replica": {r}}}\n' for i, n in enumerate(names))
        )
    functions = "".join(
        re.search(rf"^{name}\(\) \{{[^\n]*\n.*?^\}}\n", script, re.M | re.S).group()
        for name in ("lifecycle", "job_over")
    )
    r = subprocess.run(
        ["bash", "-c", f'{functions}\nRUN_DIR="$1"; OUT="$1/replica-{me}"; job_over', "-", str(run)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode in (0, 1), r.stderr
    return r.returncode == 0


def test_a_replica_is_not_restarted_once_its_peers_finished(tmp_path):
    """As `ftjax launch` does: with a peer finished and no other one running, nobody holds the state;
    a restart (or a requeued job) would start the job over from the seed."""
    emit("slurm", tmp_path / "job", TINY, JOB, options=EmitOptions(name="over"))
    script = (tmp_path / "job" / "replica-1.sbatch").read_text()
    started, down, done = "replica_started", "replica_down", "replica_done"
    cases = [
        ({0: [started, done], 1: [started, down]}, True),  # its one peer finished
        ({0: [started], 1: [started, down]}, False),  # the peer still trains: catch up from it
        ({0: [started, done], 1: [started, down], 2: [started, "back_to_full_degree"]}, False),  # 2 runs
        ({0: [started, done], 1: [started, down], 2: [started, down, started]}, False),  # 2 runs again
        ({0: [started, done], 1: [started, down], 2: [started, down]}, True),  # 2 is down too
        ({0: [started, down], 1: [started, down]}, False),  # nobody finished: a job restart is fine
        ({1: [started, down]}, False),  # peers still queued
    ]
    for i, (events, over) in enumerate(cases):
        assert _job_over(script, tmp_path / f"run{i}", 1, events) is over, (i, events)
