"""A replica's devices split a step's rows, and each computes and keeps its own rows only
(`constrain_rows`, ftjax/program/sharding.py; docs/design.md, "Rows"). Left to itself XLA split the
built-in models' residual stream along the width like their `embed`-sharded parameters: a 4-device
replica then computed the whole batch's logits on every device and summed them, and a scanned
Llama ran its layers on every row everywhere (1.7x the FLOPs, 3x the temporaries)."""

import jax.numpy as jnp
import pytest

import ftjax
from ftjax.config import load_config
from ftjax.program.plan import compiled_flops, compiled_grads
from ftjax.program.sharding import constrain_rows, rows_split
from ftjax.program.step import build_program


@pytest.mark.parametrize(
    "name, overrides",
    [("tiny", []), ("llama_tiny", []), ("llama_tiny", ["model.remat=save_dots", "model.scan_layers=true"])],
    ids=["gpt", "llama", "llama-scanned"],
)
def test_each_device_computes_and_keeps_a_quarter_of_the_batch(name, overrides):
    """The same 16 rows on a 1-device and a 4-device replica: each of the 4 devices does a quarter
    of the compiled step's FLOPs (not more: measured before, 1.006x and 1.7x) and holds at most
    ~a quarter of its temporaries (before: 1.4x to 3x a quarter)."""
    figures = {}
    for devices in (1, 4):
        cfg = load_config(
            name,
            [
                f"mesh.devices_per_host={devices}",
                "data.batch_size=16",
                "model.seq_len=128",
                "model.d_model=128",
                *overrides,
            ],
        )
        compiled = compiled_grads(build_program(cfg))
        figures[devices] = compiled_flops(compiled), compiled.memory_analysis().temp_size_in_bytes
    (flops_1, temp_1), (flops_4, temp_4) = figures[1], figures[4]
    assert 4 * flops_4 <= 1.003 * flops_1
    assert temp_4 <= 1.1 * temp_1 / 4


def test_outside_a_step_an_activation_is_left_as_it_is():
    """A model called outside ftjax's step (a user's own jit, a test) is not constrained; inside
    `rows_split` it is, and the context ends with its block."""
    x = jnp.ones((4, 3))
    assert constrain_rows(x) is x and ftjax.constrain_rows is constrain_rows
    program = build_program(load_config("tiny", ["mesh.devices_per_host=4"]))
    with rows_split(program.batch_sharding):
        y = constrain_rows(x)
    assert y is not x and y.sharding.spec[0] == program.batch_sharding.spec[0]
    assert constrain_rows(x) is x
