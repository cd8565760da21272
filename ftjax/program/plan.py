"""What a replica's program asks of each device, known before anything is allocated.

- **state bytes per device**: every leaf of the train state (parameters, optimizer state, step
  counter, model state) at its shard's shape (`sharding.shard_shape`) times its dtype's size. Exact:
  it is what the arrays will hold.
- **gradient step's buffers per device**: XLA's `memory_analysis()` of the compiled gradient step
  (the `grads` executable): its arguments besides the parameters and model state (the batch), its
  outputs (the update, in float32, and the loss and metrics), and its temporaries (the activations
  kept for the backward pass among them). Compiled for the platform it runs on: `ftjax plan`
  compiles for CPU devices standing in for the accelerators, whose compiler fuses and schedules
  differently, so these are an estimate there; `ftjax train` compiles for the device itself.
- **kept for the backward pass per device**: JAX's residuals of one micro-batch (the values its
  backward pass reads that are not the step's arguments: what `model.remat` decides), split over
  the replica's data-parallel devices. Decided by JAX before any compiler runs, so the same for
  every platform; not the peak (a compiler adds a block's working set, and may fuse cheap
  residuals away: docs/design/model.md, "What the backward pass keeps").
- **FLOPs**: XLA's `cost_analysis()` of the same executable, per device (the partitioned program),
  times the replica's devices: the model FLOPs of one step's forward and backward pass (the
  optimizer's update is not counted, as MFU conventionally leaves it out). For the built-in
  transformers, the closed form 6N + 12 L d T per token (N the parameters outside lookup tables,
  PaLM's attention term) as a cross-check.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ftjax.base.accelerators import GIB, lookup
from ftjax.base.trees import PyTree
from ftjax.config import Config
from ftjax.program.sharding import TENSOR
from ftjax.program.step import ReplicaProgram, lowered, model_state, rows_like, task_losses

LOOKUP_AXES = ("vocab", "seq")  # a matrix whose first logical axis is one of these is a table, read by index


class DoesNotFit(ValueError):
    """The per-device total exceeds the device's memory; the message has the numbers."""


@dataclass(frozen=True)
class Plan:
    """One replica's needs per device (bytes) and per step (FLOPs)."""

    task: str
    devices: int  # the replica's devices
    params: int  # parameters (elements)
    param_bytes: int  # per device, from here on
    optimizer_bytes: int
    other_state_bytes: int  # the step counter, model state
    batch_bytes: int  # the gradient step's arguments that are not state
    update_bytes: int  # its outputs: the update (float32), loss and metrics
    temp_bytes: int  # its temporaries: activations and scratch
    backward_bytes: int | None  # what a micro-batch's backward pass keeps (JAX's residuals); None: not asked
    flops_per_step: float | None  # the replica's whole gradient step (all devices); None: not reported
    rows_per_step: int
    tokens_per_step: int  # 0: not a token model
    closed_form_flops_per_token: float | None  # 6N + attention, for the built-in transformers

    @property
    def state_bytes(self) -> int:
        return self.param_bytes + self.optimizer_bytes + self.other_state_bytes

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.batch_bytes + self.update_bytes + self.temp_bytes

    @property
    def flops_per_token(self) -> float | None:
        return self.flops_per_step / self.tokens_per_step if self.flops_per_step and self.tokens_per_step else None

    @property
    def closed_form_flops_per_step(self) -> float | None:
        """The model's FLOPs of the step (6N + 12 L d T over its tokens), what MFU counts, as
        `step_flops` does: not remat's recomputation, and every trip of a loop (XLA's count takes a
        loop's body once: model.scan_layers, the chunk settings). None where there is no closed form."""
        if self.closed_form_flops_per_token and self.tokens_per_step:
            return self.closed_form_flops_per_token * self.tokens_per_step
        return None

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "state_bytes": self.state_bytes,
            "total_bytes": self.total_bytes,
            "flops_per_token": self.flops_per_token,
        }


def shard_bytes(a: jax.Array | jax.ShapeDtypeStruct) -> int:
    """Bytes one device holds of an array (a ShapeDtypeStruct with a sharding): its shard's."""
    shape = a.sharding.shard_shape(a.shape) if getattr(a, "sharding", None) is not None else a.shape
    return math.prod(shape) * a.dtype.itemsize


def tree_bytes(tree: PyTree) -> int:
    return sum(shard_bytes(a) for a in jax.tree.leaves(tree))


def compiled_grads(program: ReplicaProgram) -> jax.stages.Compiled:
    """The program's gradient step, compiled: the executable `precompile` made, else one compiled now."""
    if isinstance(program.grads, jax.stages.Compiled):
        return program.grads
    st, where, _ = program._abstract_args()
    return lowered(program.grads, st["params"], model_state(st), program.example, where).compile()


def compiled_flops(compiled: jax.stages.Compiled) -> float | None:
    """FLOPs of one run of an executable on one device, as XLA's cost analysis counts them (None: the
    backend reports none)."""
    try:
        cost = compiled.cost_analysis()
    except Exception:  # (a backend may not implement it)
        return None
    if isinstance(cost, (list, tuple)):  # (older JAX: one dict per executable)
        cost = cost[0] if cost else None
    flops = (cost or {}).get("flops")
    return float(flops) if flops is not None and flops > 0 else None


def step_flops(program: ReplicaProgram) -> float | None:
    """Model FLOPs of the replica's gradient step on a whole batch, all devices together: what MFU
    divides. For the built-in transformers the closed form (6N + 12 L d T per token: recomputation
    under remat is not model work); otherwise XLA's count of the compiled step, times the
    micro-batches (XLA counts a loop's body once)."""
    st = program.abstract_state()
    closed = closed_form_flops_per_token(program, st["params"])
    tokens = program.cfg.data.batch_size * program.task.tokens_per_example
    if closed is not None and tokens:
        return closed * tokens
    per_device = compiled_flops(compiled_grads(program))
    if per_device is None:
        return None
    return per_device * program.mesh.devices.size * getattr(program.cfg.data, "micro_batches", 1)


def closed_form_flops_per_token(program: ReplicaProgram, params_shape: PyTree) -> float | None:
    """6N + 12 L d T (training FLOPs per token: forward and backward; PaLM, appendix B) for the
    built-in transformers (a config with `model.n_layers`, `d_model`, `seq_len` whose task is
    built-in and not the MLP); N leaves out lookup tables (matrices whose first logical axis is in
    LOOKUP_AXES: token and position embeddings).
    None for other tasks."""
    cfg, task = program.cfg, program.task
    model = cfg.model
    builtin = cfg.task is None or cfg.task.startswith("ftjax.program.tasks:")
    if not builtin or getattr(model, "kind", "") == "mlp":
        return None
    try:
        layers, width, length = model.n_layers, model.d_model, model.seq_len
    except AttributeError:
        return None
    axes = task.param_axes
    if axes is None:
        dense = sum(a.size for a in jax.tree.leaves(params_shape))
    else:
        pairs = zip(jax.tree.leaves(params_shape), jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, P)))
        dense = sum(a.size for a, spec in pairs if not (a.ndim == 2 and spec[0] in LOOKUP_AXES))
    return transformer_flops_per_token(dense, layers, width, length)


def transformer_flops_per_token(dense: int, layers: int, width: int, length: int) -> float:
    """6N + 12 L d T: a decoder's training FLOPs per token, forward and backward (PaLM, appendix B),
    N its dense parameters (lookup tables left out), L layers of width d over sequences of T."""
    return 6.0 * dense + 12.0 * layers * width * length


def backward_bytes(program: ReplicaProgram) -> int:
    """Bytes per device that the gradient step keeps from a micro-batch's forward pass for its
    backward pass: the residuals of the task's loss (the pullback's closure in JAX's jaxpr, less
    the step's own arguments: parameters, model state, batch), at their global size over the
    replica's data-parallel devices (the batch axes; a tensor-parallel group shares its rows).
    Platform-independent: `model.remat`, `scan_layers` and the chunk settings decide it in JAX,
    where XLA:CPU's temporaries blur it (docs/design/model.md, "What the backward pass keeps")."""
    cfg = program.cfg
    rows = cfg.data.batch_size // cfg.data.micro_batches
    where = jnp.zeros(3, jnp.int32)

    def pullback(params, ms, batch):
        def loss(p):
            return task_losses(program.task, cfg.seed, program.batch_sharding, p, ms, batch, where)[0].sum()

        return jax.vjp(loss, params)[1]  # (a pytree: its leaves are the residuals)

    st = program.abstract_state()
    jaxpr = jax.make_jaxpr(pullback)(st["params"], model_state(st), rows_like(program.example, rows)).jaxpr
    arguments = {id(v) for v in jaxpr.invars}
    kept = sum(math.prod(v.aval.shape) * v.aval.dtype.itemsize for v in jaxpr.outvars if id(v) not in arguments)
    data_parallel = math.prod(n for axis, n in program.mesh.shape.items() if axis != TENSOR)
    return kept // data_parallel


def plan_program(program: ReplicaProgram, *, backward: bool = False) -> Plan:
    """The plan of a built program (compiles its gradient step if `precompile` has not); with
    `backward`, also what its backward pass keeps (`ftjax plan`: one more trace of the loss, which
    `ftjax train`'s fit check, on a restarted replica's path, does without)."""
    st = program.abstract_state()
    compiled = compiled_grads(program)
    mem = compiled.memory_analysis()
    if mem is None:  # (every backend ftjax runs on has it; a plan without it would be made up)
        raise RuntimeError("XLA gave no memory analysis of the gradient step")
    param_bytes = tree_bytes(st["params"])
    model_state_bytes = tree_bytes(model_state(st))
    rows = program.cfg.data.batch_size
    per_device = compiled_flops(compiled)
    return Plan(
        task=program.task.name,
        devices=int(program.mesh.devices.size),
        params=sum(int(a.size) for a in jax.tree.leaves(st["params"])),
        param_bytes=param_bytes,
        optimizer_bytes=tree_bytes(st["opt"]),
        other_state_bytes=tree_bytes(st["step"]) + model_state_bytes,
        batch_bytes=max(0, int(mem.argument_size_in_bytes) - param_bytes - model_state_bytes),
        update_bytes=int(mem.output_size_in_bytes),
        temp_bytes=int(mem.temp_size_in_bytes),
        backward_bytes=backward_bytes(program) if backward else None,
        flops_per_step=(
            per_device * program.mesh.devices.size * program.cfg.data.micro_batches if per_device is not None else None
        ),
        rows_per_step=rows,
        tokens_per_step=rows * program.task.tokens_per_example,
        closed_form_flops_per_token=closed_form_flops_per_token(program, st["params"]),
    )


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def breakdown(plan: Plan) -> str:
    """The per-device total and its parts, in words."""
    b = human_bytes
    return (
        f"{b(plan.total_bytes)} per device (state {b(plan.state_bytes)} + batch {b(plan.batch_bytes)} + "
        f"gradients {b(plan.update_bytes)} + activations and temporaries {b(plan.temp_bytes)})"
    )


def verdict(plan: Plan, device: str, free_bytes: int) -> tuple[bool, str]:
    """(fits, the verdict in words: `fits <device> (<free> GiB)` or `does not fit ...`, with the numbers)."""
    where = f"{device} ({human_bytes(free_bytes)})"
    if plan.total_bytes <= free_bytes:
        return True, f"fits {where}: {breakdown(plan)}, {human_bytes(free_bytes - plan.total_bytes)} spare"
    return False, f"does not fit {where}: {breakdown(plan)}, {human_bytes(plan.total_bytes - free_bytes)} over"


def device_memory(device: jax.Device) -> tuple[int, str] | None:
    """(bytes one device of this kind can hold, where that figure comes from) for an accelerator:
    its allocator's limit when JAX reports one, else the known devices' table by device kind; None
    on CPU or for an unknown device without memory statistics."""
    if device.platform == "cpu":
        return None
    try:
        stats = device.memory_stats() or {}
    except Exception:  # (a backend may not implement it)
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"{device.device_kind} (the allocator's limit)"
    known = lookup(device.device_kind)
    return (known.memory_bytes, known.name) if known is not None else None


def peak_flops(cfg: Config, device: jax.Device) -> float | None:
    """A device's peak dense FLOP/s for MFU: `hardware.peak_flops_per_device`, else the known
    devices' bf16 peak by device kind; None on CPU (no made-up figure)."""
    if cfg.hardware.peak_flops_per_device:
        return float(cfg.hardware.peak_flops_per_device)
    if device.platform == "cpu":
        return None
    known = lookup(device.device_kind)
    return known.peak_bf16_flops if known is not None else None


def check_fits(program: ReplicaProgram) -> Plan | None:
    """DoesNotFit (with the numbers) if the program's per-device total exceeds the memory of this
    process's first device; the plan when it was checked; None where the memory is not known (CPU)."""
    device = jax.local_devices()[0]
    memory = device_memory(device)
    if memory is None:
        return None
    plan = plan_program(program)
    fits, text = verdict(plan, memory[1], memory[0])
    if not fits:
        raise DoesNotFit(f"task {plan.task} on {plan.devices} device(s) {text}")
    return plan
