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
