"""A task's arguments (`task_args`) that its factory cannot take are named as the config's fields,
before the factory runs."""

import pytest

from ftjax.config import ConfigError, load_config
from ftjax.program.task import TaskError, load_task

TOKEN_LM = "ftjax.program.tasks:token_lm"


@pytest.mark.parametrize(
    "args, says",
    [
        ({"dir": "/nowhere", "dirr": "x"}, "task_args.dirr: not an argument of token_lm(cfg, dir, split, packing)"),
        ({"split": "train"}, "task_args.dir: required by token_lm(cfg, dir, split, packing)"),
    ],
)
def test_an_argument_the_factory_does_not_take_or_needs_is_named(args, says):
    cfg = load_config("llama_tiny", [f"task={TOKEN_LM}"])
    with pytest.raises(TaskError) as e:
        load_task(TOKEN_LM, cfg, args)
    assert str(e.value) == f"task {TOKEN_LM!r}: {says}"


def test_a_factory_that_takes_any_keyword_gets_them():
    def factory(cfg, **anything):
        raise RuntimeError(f"called with {sorted(anything)}")

    import sys
    import types

    sys.modules["_any_kw_task"] = types.SimpleNamespace(factory=factory)
    try:
        with pytest.raises(
            TaskError, match=r"factory\(cfg, \*\*task_args\) failed: RuntimeError: called with \['a', 'b'\]"
        ):
            load_task("_any_kw_task:factory", None, {"a": 1, "b": 2})
    finally:
        del sys.modules["_any_kw_task"]


def test_a_task_that_is_not_an_import_path_says_what_it_got_once():
    with pytest.raises(ConfigError) as e:
        load_config("tiny", ["task=token_lm"])
    assert str(e.value).count("'token_lm'") == 1, str(e.value)


def test_job_members_started_by_hand_without_out_get_a_directory_each():
    """Two `ftjax train --coordinator` members of one config, no --out: each its own run directory
    (they shared runs/<config>/, its metrics.jsonl and checkpoints/, and a whole job restarted by hand
    resumed each other's state or none); standalone and an explicit --out are as before."""
    from ftjax.cli.train import default_out
    from ftjax.runtime.args import build_parser

    def out(*argv):
        return str(default_out(build_parser().parse_intermixed_args(["configs/tiny.yaml", *argv])))

    members = {out("--coordinator", "h:1", "--replica-id", str(r)) for r in (0, 1)}
    assert members == {"runs/tiny/replica-0", "runs/tiny/replica-1"}
    assert out() == "runs/tiny"
    assert out("--coordinator", "h:1", "--out", "x") == "x"
