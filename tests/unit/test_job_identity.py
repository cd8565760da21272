"""The job identity (ftjax/runtime/checkpoint.py): what a checkpoint records (`job_identity`) and what
the live replicas of one job must share to be admitted together (`replica_identity`, the `job ...`
lines of a member's layout text): every setting that changes the math or FTAR's frames, defaults
resolved, named when it differs; a custom task's identity holds what it reads, not the built-in model's."""

import pytest

from ftjax.config import load_config
from ftjax.program.task import TaskError, config_setting
from ftjax.runtime.checkpoint import job_identity, recorded_identity, replica_identity

CUSTOM = ["task=linen_batchnorm:task", "task_args={d_model: 32}"]


def differing(a: dict, b: dict) -> set[str]:
    return {k for k in a.keys() | b.keys() if a.get(k, "absent") != b.get(k, "absent")}


def replicas(*overrides: str, base: tuple[str, ...] = ()) -> dict:
    return replica_identity(load_config("tiny", [*base, *overrides]), "fp")


@pytest.mark.parametrize(
    "override, named",
    [
        # the learning-rate schedule's length: decay_steps defaults to the job's optimizer steps
        ("steps=43", {"steps", "optim.decay_steps"}),
        ("ft.wire_dtype=bfloat16", {"ft.wire_dtype"}),
        ("ft.grad_dtype=bfloat16", {"ft.grad_dtype"}),
        ("ft.commit_decision=coordinator", {"ft.commit_decision"}),
        ("ft.link_streams=2", {"ft.link_streams"}),
        ("ft.global_batch=constant", {"ft.global_batch", "ft.micro_batch_rows"}),
        ("optim.lr=0.1", {"optim.lr"}),
        ("seed=1", {"seed"}),
    ],
)
def test_replicas_that_would_train_other_math_or_frames_differ_by_the_setting(override, named):
    assert differing(replicas(), replicas(override)) == named


def test_defaults_are_resolved_before_they_are_compared():
    # the same schedule, said two ways: the same job
    assert replicas("optim.decay_steps=30") == replicas()  # (tiny: steps 30)
    explicit = replicas("steps=43", base=("optim.decay_steps=30",))
    assert differing(replicas(base=("optim.decay_steps=30",)), explicit) == {"steps"}
    constant = ("ft.global_batch=constant",)
    assert replicas("ft.micro_batch_rows=2", base=constant) == replicas(base=constant)  # (tiny: 8 rows / 4)
    assert differing(replicas(base=constant), replicas("ft.micro_batch_rows=4", base=constant)) == {
        "ft.micro_batch_rows"
    }


def test_diloco_outer_optimizer_is_shared():
    diloco = ("ft.sync=diloco", "ft.inner_steps=4")
    assert differing(replicas(base=diloco), replicas("ft.outer_lr=0.5", base=diloco)) == {"ft.outer_lr"}
    assert differing(replicas(base=diloco), replicas("ft.outer_optimizer=sgd", base=diloco)) == {"ft.outer_optimizer"}


@pytest.mark.parametrize(
    "override",
    [
        "ft.ftar_timeout_s=2",
        "ft.progress_timeout_s=30",
        "ft.quorum_timeout_s=5",
        "ft.grad_path=serial",
        "ft.ftar_shared_memory=false",
        "ft.digest_every=0",
        "ft.catchup_streams=1",
        "ft.drain_timeout_s=1",
        "ft.micro_batch_rows=2",  # (elastic: nobody computes another's rows)
        "data.micro_batches=2",
        "checkpoint.every=5",
        "checkpoint.init_from=/elsewhere/w",  # (its init_opt stays: the starting optimizer state is math)
        "eval.every=5",
        "log.tensorboard=false",
        "net.bind_host=127.0.0.1",
        "coordinator.join_timeout_s=2",
        "platform=cpu",
    ],
)
def test_what_one_replica_may_set_for_itself_is_not_compared(override):
    a, b = replicas(), replicas(override)
    b.pop("checkpoint.init_opt", None)
    assert a == b


def test_a_checkpoint_still_leaves_out_what_a_restart_may_change():
    # a run may be extended (steps), and the transport may change between restarts
    cfg, other = load_config("tiny", []), load_config("tiny", ["steps=60", "ft.wire_dtype=bfloat16"])
    assert job_identity(cfg, "fp") == job_identity(other, "fp")
    assert "steps" not in job_identity(cfg, "fp") and job_identity(cfg, "fp")["optim.decay_steps"] is None


def test_a_custom_task_identity_has_what_it_reads_not_the_builtin_model():
    ours = job_identity(load_config("tiny", CUSTOM), "fp")
    assert not any(k.startswith("model.") for k in ours) and "data.source" not in ours
    assert ours["task"] == "linen_batchnorm:task" and ours["task_args"] == '{"d_model": 32}'
    assert job_identity(load_config("tiny", [*CUSTOM, "model.d_model=128", "data.source=synthetic"]), "fp") == ours
    assert differing(ours, job_identity(load_config("tiny", [*CUSTOM, "task_args={d_model: 64}"]), "fp")) == {
        "task_args"
    }
    # what it declares it reads (Task.reads) is in, with its value
    reads = ("model.seq_len",)
    declared = job_identity(load_config("tiny", CUSTOM), "fp", reads=reads)
    assert declared["model.seq_len"] == 64
    longer = job_identity(load_config("tiny", [*CUSTOM, "model.seq_len=32"]), "fp", reads=reads)
    assert differing(declared, longer) == {"model.seq_len"}
    # a whole section reads as its fields
    assert job_identity(load_config("tiny", CUSTOM), "fp", reads=("model",))["model"]["d_model"] == 64


def test_a_builtin_task_keeps_its_model_and_source():
    for task in ([], ["task=ftjax.program.tasks:language_model"]):
        ident = job_identity(load_config("tiny", task), "fp")
        assert ident["model.d_model"] == 64 and ident["data.source"] == "stdlib" and ident["model.kind"] == "gpt"
    bigger = job_identity(load_config("tiny", ["model.d_model=128"]), "fp")
    assert differing(job_identity(load_config("tiny", []), "fp"), bigger) == {"model.d_model"}


def test_a_custom_task_checkpoint_that_recorded_the_builtin_model_compares_without_it():
    ours = job_identity(load_config("tiny", [*CUSTOM, "model.d_model=128"]), "fp", reads=("model.seq_len",))
    recorded = {**ours, "model.kind": "gpt", "model.d_model": 64, "model.seq_len": 64, "data.source": "stdlib"}
    assert recorded_identity(recorded, ours, ()) == ours  # (what it declares it reads is still compared)
    assert recorded_identity({**recorded, "model.seq_len": 32}, ours, ())["model.seq_len"] == 32
    builtin = job_identity(load_config("tiny", []), "fp")  # a built-in task's keeps them
    assert recorded_identity({**builtin, "model.d_model": 32}, builtin, ())["model.d_model"] == 32


def test_a_setting_a_task_reads_must_exist():
    cfg = load_config("tiny", [])
    assert config_setting(cfg, "optim.lr") == 3e-3
    for key in ("model.nope", "nope", "model.d_model.x", ""):
        with pytest.raises(TaskError, match=f"Task.reads: '{key}'"):
            config_setting(cfg, key)
