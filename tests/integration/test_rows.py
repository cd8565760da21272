"""A replica's devices split a step's rows, and each computes and keeps its own rows only
(`constrain_rows`, ftjax/program/sharding.py; docs/design/model.md, "Rows"). Left to itself XLA split the
built-in models' residual stream along the width like their `embed`-sharded parameters: a 4-device
replica then computed the whole batch's logits on every device and summed them, and a scanned
Llama ran its layers on every row everywhere (1.7x the FLOPs, 3x the temporaries)."""

import functools

import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import ftjax
from ftjax.config import load_config
from ftjax.program.plan import compiled_flops, compiled_grads
from ftjax.program.sharding import constrain_rows, rows_split
from ftjax.program.step import build_program

COMMON = ("data.batch_size=16", "model.seq_len=128", "model.d_model=128")


@functools.lru_cache
def compiled_step(name: str, *overrides: str):
    """(XLA's FLOPs per device, temporaries) of the config's compiled gradient step, 16 rows of 128
    positions, d 128 (compiled once per config: the 1-device steps serve several tests)."""
    program = build_program(load_config(name, [*COMMON, *overrides]))
    compiled = compiled_grads(program)
    return program, compiled_flops(compiled), compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize(
    "name, overrides",
    [("tiny", []), ("llama_tiny", []), ("llama_tiny", ["model.remat=save_dots", "model.scan_layers=true"])],
    ids=["gpt", "llama", "llama-scanned"],
)
def test_each_device_computes_and_keeps_a_quarter_of_the_batch(name, overrides):
    """The same 16 rows on a 1-device and a 4-device replica: each of the 4 devices does a quarter
    of the compiled step's FLOPs (not more: measured before, 1.006x and 1.7x) and holds at most
    ~a quarter of its temporaries (before: 1.3x to 3x a quarter)."""
    _, flops_1, temp_1 = compiled_step(name, "mesh.devices_per_host=1", *overrides)
    _, flops_4, temp_4 = compiled_step(name, "mesh.devices_per_host=4", *overrides)
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


@pytest.mark.parametrize("name", ["tiny", "llama_tiny"], ids=["gpt", "llama"])
def test_a_tensor_group_splits_the_vocabulary_and_so_the_logits(name):
    """On a 2 x 2 (fsdp x tensor) replica the embedding, the output projection and so the logits
    are split over the tensor axis (Megatron's vocabulary-parallel layers): each device does a
    quarter of the 1-device replica's FLOPs within 2% (when every device of a tensor group computed
    the whole vocabulary's logits: 6.5-7% over at 2, 27-30% at 4)."""
    _, flops_1, _ = compiled_step(name, "mesh.devices_per_host=1")
    program, flops_4, _ = compiled_step(name, "mesh.devices_per_host=4", "mesh.tensor=2")
    params = program.state_shardings["params"]
    embedding = params["wte"]["embedding"] if name == "tiny" else params["embed"]
    assert embedding.spec == P("tensor", "fsdp")
    assert 4 * flops_4 <= 1.02 * flops_1


def test_a_vocabulary_that_the_tensor_axis_does_not_divide_stays_whole():
    """Split where the tensor axis divides it, whole where it does not (257 on 2), and the replica
    builds and computes either way: the tensor size is every degree's, so the layout is too."""
    split = build_program(load_config("llama_tiny", ["mesh.devices_per_host=4", "mesh.tensor=2"]))
    assert split.state_shardings["params"]["embed"].spec == P("tensor", "fsdp")
    whole = build_program(
        load_config("llama_tiny", ["mesh.devices_per_host=4", "mesh.tensor=2", "model.vocab_size=257"])
    )
    assert whole.state_shardings["params"]["embed"].spec == P(None, "fsdp")
    assert compiled_flops(compiled_grads(whole)) > 0
