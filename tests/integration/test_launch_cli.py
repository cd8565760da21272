"""`ftjax launch` without processes: fault flags, option checks, log tailing, --emit files (the hang
rule: test_supervisor_rules.py)."""

import json
import shlex
import subprocess

import pytest
import yaml
from conftest import REPO

from ftjax.cli.train import build_parser, parse_config
from ftjax.launch.cli import main
from ftjax.launch.fault_plan import FaultPlan, Hang, Injection, parse_hang, parse_kill, parse_kill_host
from ftjax.launch.supervisor import MetricsTail

TINY = f"{REPO}/configs/tiny.yaml"


def test_parse_kill():
    assert parse_kill("1@10") == Injection(1, 10, "forward")
    assert parse_kill("0@3:ftar") == Injection(0, 3, "ftar")
    assert parse_kill("2@7:catchup").die_at == "7:forward"  # killed at 7, then again while catching up
    assert parse_kill_host("1@5:1") == Injection(1, 5, "forward", host=1, kind="kill_host")
    assert parse_hang("0@2.5") == Hang(0, 2.5)


@pytest.mark.parametrize(
    "parse,text",
    [
        (parse_kill, "1"),
        (parse_kill, "x@10"),
        (parse_kill, "1@0"),
        (parse_kill, "1@10:bogus"),
        (parse_kill, "1@"),
        (parse_kill_host, "1@5"),
        (parse_kill_host, "1@5:h"),
        (parse_hang, "0@-1"),
        (parse_hang, "0@soon"),
    ],
)
def test_bad_fault_flags_name_the_flag(parse, text):
    flag = "--" + parse.__name__.removeprefix("parse_").replace("_", "-")
    with pytest.raises(ValueError, match=flag):
        parse(text)


@pytest.mark.parametrize(
    "plan,problem",
    [
        (FaultPlan(injections=(Injection(2, 5),)), "--kill: replica 2 is not in"),
        (FaultPlan(injections=(Injection(0, 31),)), "--kill: step 31 is not in"),
        (FaultPlan(injections=(Injection(0, 5, host=1, kind="kill_host"),)), "--kill-host: host 1 is not in"),
        (FaultPlan(hangs=(Hang(3, 1.0),)), "--hang: replica 3"),
    ],
)
def test_fault_plan_must_fit_the_job(plan, problem):
    with pytest.raises(ValueError, match=problem):
        plan.validate(replicas=2, hosts=1, steps=30)
    with pytest.raises(ValueError, match="at least 2 replicas"):
        FaultPlan(mtbf_s=5).validate(replicas=1, hosts=1, steps=30)


@pytest.mark.parametrize(
    "args,problem",
    [
        (["--replicas", "2", "--kill", "5@3"], "--kill: replica 5"),
        (["--replicas", "0"], "--replicas"),
        (["--replicas", "2", "model.d_model=abc"], "model.d_model"),
        (["--replicas", "2", "coordinator.min_replicas=3"], "coordinator.min_replicas"),
        (["--replicas", "2", "--hosts-per-replica", "3"], "mesh"),  # batch 8 does not split over 3 hosts
        (["--replicas", "2", "--mtbf-s", "0"], "--mtbf-s"),
        (["--replicas", "2", "--restart-delay-s", "-1"], "--restart-delay-s"),
        (["--replicas", "2", "--kill-coordinator-at", "x"], "--kill-coordinator-at"),
        (["--replicas", "2", "--bogus"], "--bogus"),
    ],
)
def test_bad_options_start_nothing(tmp_path, capsys, args, problem):
    out = tmp_path / "run"
    assert main([TINY, "--out", str(out), *args]) == 2
    assert problem in capsys.readouterr().err
    assert not out.exists()


# Every option of `ftjax launch`, out of range. "{file}" is an existing regular file.
REDUCE = ["ft.on_host_loss=reduce", "ft.global_batch=constant"]
BAD_OPTIONS = [
    *[(["--mtbf-s", v], "--mtbf-s") for v in ("inf", "nan", "-3", "0")],
    *[(["--restart-delay-s", v], "--restart-delay-s") for v in ("nan", "inf", "-1")],
    *[(["--hang-timeout-s", v], "--hang-timeout-s") for v in ("nan", "inf", "0", "-1")],
    *[(["--startup-timeout-s", v], "--startup-timeout-s") for v in ("nan", "inf", "0")],
    *[(["--timeout-s", v], "--timeout-s") for v in ("nan", "inf", "-5")],
    *[(["--hang", v], "--hang") for v in ("0@inf", "0@nan", "0@-1")],
    *[(["--kill-coordinator-at", v], "--kill-coordinator-at") for v in ("inf", "nan", "-1")],
    (["--max-restarts", "-1"], "--max-restarts"),
    (["--host-repair-steps", "0", *REDUCE], "--host-repair-steps: must be >= 1"),
    (["--host-repair-steps", "ten"], "--host-repair-steps"),
    (["--host-repair-steps", "10"], "--host-repair-steps: needs ft.on_host_loss=reduce"),  # tiny: restart
    (["--host-repair-steps", "9", "--host-repair-s", "5", *REDUCE], "and not --host-repair-s with it"),
    (["--replicas", "-2"], "--replicas"),
    (["--replicas", "two"], "--replicas"),
    (["--hosts-per-replica", "0"], "--hosts-per-replica"),
    (["--hosts-per-replica", "-1"], "--hosts-per-replica"),
    (["--devices-per-host", "0"], "--devices-per-host"),
    (["--entry", "python own.py", "--hosts-per-replica", "2"], "--entry: FaultTolerance.join runs"),
    (["--entry", "python own.py", "mesh.hosts=2"], "not mesh.hosts=2"),
    (["--entry", "no-such-trainer --fast"], "--entry: no-such-trainer: no such command"),
    (["--entry", "{file} x"], "not an executable file"),
    (["--entry", " "], "--entry: empty command"),
    (["--seed", "x"], "--seed"),
    (["--out", "{file}"], "--out"),
    (["--out", "{file}/run"], "--out"),
    (["--out", ""], "--out"),
    (["--compile-cache", "{file}"], "--compile-cache"),
    (["--compile-cache", ""], "--compile-cache"),
    (["--emit", "k8s", "{file}"], "--emit"),
    (["--emit", "k8s", ""], "--emit"),
    (["--image", ""], "--image"),
    (["--tls-cert", "{file}", "--tls-ca", "{file}"], "--tls-key"),
    (["--tls-cert", "{file}", "--tls-key", "{file}", "--tls-ca", "{file}"], "--tls-cert"),  # not PEM
]


@pytest.mark.parametrize("args,problem", BAD_OPTIONS, ids=[" ".join(a) for a, _ in BAD_OPTIONS])
def test_every_launch_option_is_checked_before_anything_starts(tmp_path, monkeypatch, capsys, args, problem):
    """Through the `ftjax` command itself: exit code 2, one line naming the option, no traceback;
    no job run, no job files emitted, no directory created."""
    import ftjax.cli.main
    import ftjax.launch.cli
    import ftjax.launch.emit

    started = []
    monkeypatch.setattr(ftjax.launch.cli, "run", lambda *a, **k: started.append("run") or 0)
    monkeypatch.setattr(ftjax.launch.emit, "emit", lambda *a, **k: started.append("emit") or [])
    monkeypatch.chdir(tmp_path)  # the default --out, runs/..., would land here
    existing = tmp_path / "notes.txt"
    existing.write_text("keep me")
    args = [a.replace("{file}", str(existing)) for a in args]
    code = ftjax.cli.main.main(["launch", TINY, "--replicas", "2", "--out", str(tmp_path / "run"), *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert problem in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert started == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"] and existing.read_text() == "keep me"


def test_run_directory_is_never_clobbered(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    assert main([TINY, "--out", str(out), "--replicas", "2"]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main([TINY, "--out", str(out), "--replicas", "2", "--overwrite"]) == 2
    assert "refusing to delete" in capsys.readouterr().err
    assert (out / "precious.txt").read_text() == "keep me"


def test_metrics_tail_returns_complete_lines_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.read() == []  # not written yet
    with open(path, "w") as f:
        f.write('{"a": 1}\n{"b": ')
    assert tail.read() == [{"a": 1}]
    with open(path, "a") as f:
        f.write('2}\n{"c": 3}\n')
    assert tail.read() == [{"b": 2}, {"c": 3}]
    assert tail.read() == []


# --- --emit -----------------------------------------------------------------------------------------
def _emit(tmp_path, kind, *extra):
    out = tmp_path / kind
    assert (
        main([TINY, "--replicas", "3", "--hosts-per-replica", "2", "steps=77", "--emit", kind, str(out), *extra]) == 0
    )
    return out


def _check_train_args(argv, config_file, replica, hosts=2):
    """The emitted replica command must be one `ftjax train` accepts, with the job's config."""
    assert argv[:2] == ["ftjax", "train"]
    argv = [config_file if a.endswith("config.yaml") else a for a in argv[2:]]
    args = build_parser().parse_intermixed_args(argv)
    cfg = parse_config(args)
    assert (args.replica_id, cfg.mesh.hosts, cfg.ft.replicas, cfg.steps) == (replica, hosts, 3, 77)
    assert args.coordinator and args.dist_address and args.out


def test_emit_slurm(tmp_path):
    out = _emit(tmp_path, "slurm")
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "config.yaml",
        "coordinator.sbatch",
        "finish.sbatch",
        "replica-0.sbatch",
        "replica-1.sbatch",
        "replica-2.sbatch",
        "submit.sh",
        "token",
    ]
    assert (out / "token").stat().st_mode & 0o077 == 0  # the job token is private
    for name in names:
        if name.endswith((".sbatch", ".sh")):
            subprocess.run(["bash", "-n", str(out / name)], check=True)
    text = (out / "replica-1.sbatch").read_text()
    assert "#SBATCH --nodes=2" in text and "--kill-on-bad-exit=1" in text
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("ftjax train"))
    argv = shlex.split(
        line.replace('"$JOB_DIR/', '"/job/')
        .replace('"$COORDINATOR"', "node1:29400")
        .replace('"$DIST"', "node0:41234")
        .replace('"$OUT"', "/job/run/replica-1")
        .replace('"${REDUCED[@]}"', "")
        .removesuffix(" &")
    )  # a whole attempt: no reduced args
    _check_train_args(argv + ["--process-id", "1"], str(out / "config.yaml"), replica=1)
    coord = (out / "coordinator.sbatch").read_text()
    assert "ftjax coordinator --port" in coord and "--token-file" in coord and "--host " not in coord
    assert "--expected-replicas 3" in coord and "--final-step 77" in coord


def test_emit_k8s(tmp_path):
    out = _emit(tmp_path, "k8s", "--image", "registry.example/ftjax:1", "--max-restarts", "7")
    docs = list(yaml.safe_load_all((out / "coordinator.yaml").read_text()))
    assert [d["kind"] for d in docs] == ["ConfigMap", "Job", "Service"]
    assert yaml.safe_load((out / "token.yaml").read_text())["kind"] == "Secret"
    config_file = tmp_path / "config.yaml"
    config_file.write_text(docs[0]["data"]["config.yaml"])
    for r in range(3):
        js = yaml.safe_load((out / f"replica-{r}.yaml").read_text())
        assert js["kind"] == "JobSet" and js["spec"]["failurePolicy"]["maxRestarts"] == 7
        job = js["spec"]["replicatedJobs"][0]["template"]["spec"]
        assert job["completions"] == job["parallelism"] == 2 and job["backoffLimit"] == 0
        container = job["template"]["spec"]["containers"][0]
        assert container["image"] == "registry.example/ftjax:1"
        script = container["command"][2].replace('"$JOB_COMPLETION_INDEX"', "1")
        argv = shlex.split(script)
        assert argv[0] == "exec"
        _check_train_args(argv[1:], str(config_file), replica=r)
        name = js["metadata"]["name"]
        assert name.startswith("ftjax-tiny-") and name.endswith(f"-replica-{r}")
        assert f"{name}-host-0-0.{name}:" in script


def test_emit_refuses_a_non_empty_directory(tmp_path, capsys):
    out = tmp_path / "k8s"
    out.mkdir()
    (out / "x").write_text("")
    assert main([TINY, "--replicas", "2", "--emit", "k8s", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main([TINY, "--replicas", "2", "--emit", "nomad", str(tmp_path / "n")]) == 2
    assert "unknown kind" in capsys.readouterr().err
    assert json.dumps(sorted(p.name for p in out.iterdir())) == '["x"]'
