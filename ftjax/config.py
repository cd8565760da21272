"""Run configuration: YAML files validated by pydantic, with `key.sub=value` overrides.

Every mistake is reported once, naming the field at fault (`model.d_model: ...`), and the command
exits with code 2 (see :class:`ConfigError`). Cross-field checks that depend on the mesh (divisibility
of the batch and of the sharded model dimensions by the replica's device count) live here too, so an
impossible mesh is refused before JAX starts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ftjax.base.batches import share_rows
from ftjax.base.net import is_all_interfaces, normalize_host

M = TypeVar("M", bound=BaseModel)


MAX_TOKENS_PER_DEVICE = 2**22  # data.batch_size x model.seq_len per device and step (Config._batch_fits)


class ConfigError(ValueError):
    """A config that cannot be run. ``str()`` names the field(s) at fault."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RopeScaling(_Strict):
    """`model.rope_scaling` (llama): how RoPE's frequencies are stretched for long contexts, as a Hugging
    Face config.json's `rope_scaling` says it (docs/design/model.md, "The Llama model"). llama3: Llama 3.1/3.2's
    (frequencies whose wavelength exceeds original_max_position_embeddings / low_freq_factor divided by
    factor, those below original / high_freq_factor kept, those between interpolated); linear: all divided."""

    rope_type: Literal["llama3", "linear"] = Field(description="llama3 (Llama 3.1, 3.2) or linear")
    factor: float = Field(gt=0, description="the factor the frequencies (or positions) are divided by")
    low_freq_factor: float = Field(1.0, gt=0, description="llama3 only")
    high_freq_factor: float = Field(4.0, gt=0, description="llama3 only")
    original_max_position_embeddings: int = Field(8192, gt=0, description="llama3 only")

    @model_validator(mode="after")
    def _factors_ordered(self) -> RopeScaling:
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"high_freq_factor ({self.high_freq_factor}) must exceed low_freq_factor ({self.low_freq_factor})"
            )
        return self


class ModelConfig(_Strict):
    kind: Literal["gpt", "mlp", "llama"] = Field(
        "gpt",
        description="the built-in model: gpt (learned positions, GELU), llama (RoPE, SwiGLU, RMSNorm, GQA) or mlp",
    )
    vocab_size: int = Field(256, gt=0, description="byte-level tokens: 256")
    d_model: int = Field(64, gt=0, description="the width of the residual stream")
    n_layers: int = Field(2, gt=0, description="transformer blocks")
    n_heads: int = Field(4, gt=0, description="attention (query) heads; must divide d_model")
    d_ff: int = Field(256, gt=0, description="the hidden width of each block's MLP")
    seq_len: int = Field(64, gt=1, description="tokens per training sequence (the context length)")
    # llama only (docs/design/model.md, "The Llama model")
    n_kv_heads: int | None = Field(
        None, gt=0, description="llama: key/value heads of grouped-query attention, dividing n_heads; default n_heads"
    )
    rope_theta: float = Field(10000.0, gt=0, description="llama: the base of the rotary position embedding")
    tie_embeddings: bool = Field(False, description="llama: the output projection is the input embedding's transpose")
    norm_eps: float = Field(1e-5, gt=0, description="llama: RMSNorm's epsilon")
    head_dim: int | None = Field(
        None, gt=0, description="llama: the size of an attention head (even); default d_model / n_heads"
    )
    rope_scaling: RopeScaling | None = Field(
        None, description="llama: Llama 3's RoPE frequency scaling ({rope_type: llama3 | linear, factor, ...}); none"
    )
    scan_layers: bool = Field(
        False,
        description="llama: the blocks' parameters stacked along a first axis (`layers/...`, not "
        "`blocks/<i>/...`) and the forward pass a scan over them: XLA compiles one block, not n_layers, and "
        "remat's savings show in a CPU plan; the same numbers either way, but another parameter tree "
        "(a checkpoint of the other layout is refused)",
    )
    # how the model is computed, not what (docs/design/model.md, "Precision", "Rematerialization")
    compute_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="llama: the dtype of the matmuls (parameters and optimizer state stay float32); "
        "auto: bfloat16 on gpu and tpu, float32 on cpu. gpt and mlp compute in float32",
    )
    attention: Literal["auto", "xla", "cudnn"] = Field(
        "auto",
        description="llama: the implementation of jax.nn.dot_product_attention: xla (any platform; it "
        "materializes every T x T score matrix); cudnn (the fused flash-attention kernel: gpu, compute_dtype "
        "bfloat16, head size a multiple of 8 up to 128); auto: cudnn where it can run, else xla",
    )
    remat: Literal["none", "full", "save_dots"] = Field(
        "none",
        description="rematerialize each transformer block in the backward pass (llama, gpt): none; full "
        "(save only the block's input); save_dots (also the outputs of its weight matmuls)",
    )
    attention_chunk: int = Field(
        0,
        ge=0,
        description="llama, where attention runs on XLA: queries this many positions at a time, each chunk's "
        "scores (chunk x seq_len, not seq_len x seq_len) recomputed in the backward pass; must divide seq_len; "
        "0: all at once. cuDNN's fused kernel keeps no score matrix and needs none",
    )
    logits_chunk: int = Field(
        0,
        ge=0,
        description="llama: the loss computes the output projection and the cross-entropy this many "
        "positions at a time, each chunk's logits recomputed in the backward pass, so the float32 logits "
        "of (rows x logits_chunk) tokens exist at once instead of the whole batch's; 0: all at once",
    )

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        # (a llama with its own head_dim need not divide d_model: Hugging Face's Llama allows it)
        if self.kind in ("gpt", "llama") and self.d_model % self.n_heads and self.head_dim is None:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.kind == "llama":
            if self.head_size % 2:
                what = "head_dim" if self.head_dim is not None else "d_model / n_heads"
                raise ValueError(
                    f"{what} ({self.head_size}, the head size) must be even (RoPE rotates pairs of a head's dimensions)"
                )
            if self.n_heads % self.kv_heads:
                raise ValueError(f"n_kv_heads ({self.kv_heads}) must divide n_heads ({self.n_heads})")
            if self.attention_chunk and (self.attention_chunk >= self.seq_len or self.seq_len % self.attention_chunk):
                raise ValueError(
                    f"attention_chunk ({self.attention_chunk}) must divide seq_len ({self.seq_len}) and be "
                    "below it; use 0 for the whole length"
                )
            if self.attention_chunk and self.attention == "cudnn":
                raise ValueError("attention_chunk: only for attention xla or auto (cuDNN's kernel keeps no scores)")
            if self.logits_chunk >= self.seq_len:
                raise ValueError(
                    f"logits_chunk ({self.logits_chunk}) must be below seq_len ({self.seq_len}): one chunk "
                    "holds the whole logits and only adds their recomputation; use 0"
                )
            return self
        for name in (
            "n_kv_heads",
            "rope_theta",
            "tie_embeddings",
            "norm_eps",
            "head_dim",
            "rope_scaling",
            "scan_layers",
            "attention",
            "attention_chunk",
            "logits_chunk",
        ):
            # (set to its default is no setting: a dumped config round-trips)
            if getattr(self, name) != type(self).model_fields[name].default:
                raise ValueError(f"{name}: only for kind llama (kind is {self.kind})")
        if self.kind == "mlp" and self.remat != "none":
            raise ValueError("remat: only for kind llama or gpt (kind is mlp)")
        if self.compute_dtype == "bfloat16":
            raise ValueError(f"compute_dtype: bfloat16 is for kind llama; the {self.kind} model computes in float32")
        return self

    @property
    def head_size(self) -> int:
        """The size of an attention head: head_dim, else d_model / n_heads."""
        return self.d_model // self.n_heads if self.head_dim is None else self.head_dim

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_heads, else n_heads (multi-head attention)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads


class DataConfig(_Strict):
    source: Literal["stdlib", "synthetic"] = Field(
        "stdlib",
        description="the built-in language model's data: stdlib (byte windows of the Python standard library's "
        "sources, deterministic and fingerprinted) or synthetic (random tokens, for benchmarks)",
    )
    batch_size: int = Field(8, gt=0, description="sequences per step, per replica")
    micro_batches: int = Field(
        1,
        gt=0,
        description="gradient accumulation: a replica computes its batch in this many micro-batches of "
        "batch_size / micro_batches rows, summed on the device (one all-reduce per step, the same update)",
    )

    @model_validator(mode="after")
    def _micro_batches_divide(self) -> DataConfig:
        if self.batch_size % self.micro_batches:
            raise ValueError(f"micro_batches ({self.micro_batches}) must divide batch_size ({self.batch_size})")
        return self


class MeshConfig(_Strict):
    hosts: int = Field(1, gt=0, description="processes (hosts) in one replica")
    devices_per_host: int = Field(
        1,
        gt=0,
        description="devices each process uses: the first of its "
        "accelerators, or on platform cpu that many simulated CPU devices",
    )
    live_hosts: int | None = Field(
        None,
        gt=0,
        description="a reduced-degree replica: the hosts it runs on now "
        "(a divisor of hosts; set by the launcher, docs/design/index.md 'Reduced-degree "
        "replicas'); default: hosts",
    )
    tensor: int = Field(
        1,
        gt=0,
        description="tensor parallelism inside a replica: groups of this many "
        "devices of one host split the heads and the MLP's hidden dimension (a "
        "divisor of devices_per_host; 1: FSDP alone)",
    )

    @property
    def fsdp(self) -> int:
        """The fsdp axis of a full replica: its devices / tensor."""
        return self.num_devices // self.tensor

    @property
    def num_devices(self) -> int:
        """The devices of a full replica: the job's layout (gradient lanes, batch divisibility)."""
        return self.hosts * self.devices_per_host

    @property
    def live(self) -> int:
        """The hosts this replica runs on: `hosts`, or fewer in a reduced-degree replica."""
        return self.hosts if self.live_hosts is None else self.live_hosts

    @property
    def live_devices(self) -> int:
        return self.live * self.devices_per_host

    @model_validator(mode="after")
    def _live_divides(self) -> MeshConfig:
        # Each live host serves whole gradient lanes (ftjax/runtime/lanes.py): hosts / live_hosts of them.
        if self.live_hosts is not None and (self.live_hosts > self.hosts or self.hosts % self.live_hosts):
            raise ValueError(f"live_hosts ({self.live_hosts}) must divide hosts ({self.hosts})")
        # A tensor group stays on one host: its collectives run inside every layer, too often for
        # the network between hosts; and each host then serves whole lanes (ftjax/runtime/lanes.py).
        if self.devices_per_host % self.tensor:
            raise ValueError(f"tensor ({self.tensor}) must divide devices_per_host ({self.devices_per_host})")
        return self


class OptimConfig(_Strict):
    lr: float = Field(3e-3, gt=0, description="AdamW's peak learning rate (after warmup)")
    warmup_steps: int = Field(10, ge=0, description="linear warmup from 0 to lr over this many steps")
    decay_steps: int | None = Field(None, gt=0, description="cosine decay length; default: steps")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="the cosine decay ends at lr x this")
    b1: float = Field(0.9, ge=0, lt=1, description="AdamW's first-moment decay")
    b2: float = Field(0.95, ge=0, lt=1, description="AdamW's second-moment decay")
    eps: float = Field(1e-8, gt=0, description="AdamW's epsilon")
    weight_decay: float = Field(0.01, ge=0, description="AdamW's decoupled weight decay")
    clip_norm: float = Field(1.0, gt=0, description="the update's global norm is clipped to this (a fixed-order sum)")


class CheckpointConfig(_Strict):
    every: int = Field(0, ge=0, description="save a durable checkpoint every N steps (0: never)")
    keep: int = Field(3, gt=0, description="durable checkpoints kept; older ones are deleted")
    async_save: bool = Field(True, description="save in the background while training goes on (orbax's async save)")
    dir: str | None = Field(None, description="default: RUN_DIR/checkpoints; a job's replica R saves to DIR/replica-R")
    init_from: str | None = Field(
        None,
        description="start the run's parameters from this orbax checkpoint "
        "(written by StandardCheckpointer().save(DIR, params), or of {'params': ..., "
        "'opt': ...}; an ftjax run's RUN/checkpoints/STEP/state too) instead of the "
        "seed's; only a fresh start uses it, a resume restores its own checkpoint",
    )
    init_opt: bool = Field(False, description="with init_from: its optimizer state too ('opt'), instead of a fresh one")

    @field_validator("init_from")
    @classmethod
    def _a_path(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("empty path (leave it out to start from the seed)")
        return v

    @model_validator(mode="after")
    def _opt_needs_init_from(self) -> CheckpointConfig:
        if self.init_opt and not self.init_from:
            raise ValueError("init_opt: needs init_from (the checkpoint whose optimizer state to start from)")
        return self


class EvalConfig(_Strict):
    """Held-out evaluation (docs/design/data.md, "Evaluation"): every `every` steps, after the commit,
    each replica computes the loss of its share of `batches` held-out batches (no gradient, no
    state change) and writes `eval_loss` and `eval_perplexity` into its step record."""

    every: int = Field(0, ge=0, description="evaluate every N steps (0: never)")
    batches: int = Field(4, gt=0, description="held-out batches per evaluation, dealt round-robin to the replicas")


class LogConfig(_Strict):
    """What a replica's leader writes besides RUN/metrics.jsonl."""

    tensorboard: bool = Field(
        True,
        description="TensorBoard event files of every step record and event: RUN/tensorboard/replica-R/ "
        "(a standalone run: RUN/tensorboard/)",
    )
    wandb: bool = Field(
        False,
        description="also log the same scalars to Weights & Biases: a run per replica, RUN-replica-R, grouped "
        "by the run directory's name (needs `pip install wandb`; WANDB_MODE holds)",
    )
    wandb_project: str = Field("ftjax", min_length=1, description="the W&B project of log.wandb's runs")

    @field_validator("wandb")
    @classmethod
    def _wandb_installed(cls, on: bool) -> bool:
        # At startup, before anything trains: a job that asked for W&B and would silently log
        # nothing there is worse than one that does not start.
        if on:
            try:
                import wandb  # noqa: F401
            except ImportError as e:
                raise ValueError(f"true needs the wandb package, not importable ({e}): pip install wandb") from None
        return on


class CoordinatorConfig(_Strict):
    """The coordinator's settings: the one place their defaults live. `ftjax coordinator` has a flag
    for each field (`heartbeat_timeout_s` -> `--heartbeat-timeout-s`) defaulting to it, and the
    coordinator's rules take them as `coordinator.quorum.Settings.from_config`. Durations in seconds."""

    min_replicas: int = Field(1, gt=0, description="a quorum needs at least this many replicas")
    heartbeat_timeout_s: float = Field(2.0, gt=0, description="silence after which a replica is dead")
    join_timeout_s: float = Field(
        1.0, gt=0, description="how long a quorum waits for alive replicas that have not asked yet"
    )
    suspect_window_s: float = Field(
        0.3,
        gt=0,
        description="silence after which an accused (or disconnected) "
        "replica is dead; shorter than heartbeat_timeout_s",
    )
    startup_timeout_s: float = Field(
        60.0, gt=0, description="at job start, how long the first quorum waits for every expected replica"
    )

    @model_validator(mode="after")
    def _suspect_before_dead(self) -> CoordinatorConfig:
        if self.suspect_window_s >= self.heartbeat_timeout_s:
            raise ValueError(
                f"suspect_window_s ({self.suspect_window_s:g}) must be shorter than "
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s:g})"
            )
        return self

    def flags(self) -> list[str]:
        """These settings as `ftjax coordinator` flags."""
        return [arg for name, value in self.model_dump().items() for arg in (flag_name(name), str(value))]


def flag_name(field: str) -> str:
    """The command-line flag of a config field: `heartbeat_timeout_s` -> `--heartbeat-timeout-s`."""
    return "--" + field.replace("_", "-")


class FTConfig(_Strict):
    replicas: int = Field(1, gt=0, description="data-parallel replicas in the job (data streams)")
    lr_scaling: Literal["none", "linear", "sqrt"] = Field(
        "none", description="elastic mode: the learning rate while replicas are missing"
    )
    global_batch: Literal["elastic", "constant"] = Field(
        "elastic",
        description="elastic: a step averages the batches of the replicas present; constant: every "
        "step trains the same R batches, the contributors compute the missing ones (docs/design/index.md)",
    )
    micro_batch_rows: int | None = Field(
        None,
        gt=0,
        description="constant mode: rows of one micro-batch (the unit "
        "in which missing batches are dealt out); default: batch_size / 4, or "
        "less to stay a multiple of the replica's device count",
    )
    grad_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="the dtype of the update that leaves the device for FTAR (bfloat16: half the bytes; "
        "FTAR sums in float32 and rounds the average once); parameters and the update's apply stay float32",
    )
    wire_dtype: Literal["float32", "bfloat16", "int8"] = Field(
        "float32",
        description="what FTAR frames carry between replicas. float32: reduce-scatter partial sums in float32, "
        "the all-gather in grad_dtype; bfloat16: every frame in bfloat16 whatever grad_dtype (half the bytes of "
        "float32 sums; each hop rounds the partial sum, receivers add in float32, the average is rounded once "
        "and every replica gets the same bits); int8 (DiLoCo only): every frame row-wise int8 with a float32 "
        "scale per 128 elements (1.94x fewer bytes than bfloat16; each hop requantizes the partial sum, the "
        "average is quantized once, every replica gets the same bits)",
    )
    link_streams: int = Field(
        1,
        ge=1,
        le=64,
        description="TCP connections per FTAR ring link (frame n on connection n % link_streams): more than one "
        "can fill a fast network that one connection's copies cannot; links through shared memory keep one",
    )
    grad_path: Literal["auto", "serial", "pipelined", "pinned"] = Field(
        "auto",
        description='how the update reaches FTAR and comes back (docs/design/step.md, "One step"): serial (device -> '
        "host, the ring, host -> device, one after another); pipelined (the three overlap, buffers allocated once); "
        "pinned (pipelined, the device -> host copies through JAX's page-locked host memory); auto: pinned on "
        "accelerators that have it, pipelined on CPU (where page-locked memory is one more copy). Same bits in all",
    )
    sync: Literal["every_step", "diloco", "streaming_diloco"] = Field(
        "every_step",
        description="every_step: the replicas average gradients every step; diloco: each replica takes "
        "inner_steps optimizer steps alone, then they average the parameter deltas and outer_optimizer applies "
        "the average (an outer round: one step of the protocol); streaming_diloco: the parameters in `fragments` "
        'parts, one averaged per round, every inner_steps / fragments steps (docs/design/index.md, "Training across '
        'slow links"); `steps` then counts outer rounds',
    )
    inner_steps: int = Field(20, gt=0, description="diloco: inner optimizer steps between two averages of a parameter")
    sync_warmup_steps: int = Field(
        0,
        ge=0,
        description="diloco, streaming_diloco: the job's first N steps average the whole gradient every step, as "
        "every_step does, before the outer rounds start (the DiLoCo paper's synchronous warm start; `steps` counts "
        'them and then the rounds; docs/design/replicas.md, "Training across slow links")',
    )
    fragments: int = Field(
        4, gt=0, description="streaming_diloco: parts of the parameters (equal sizes; fragments - 1 arrays cut at most)"
    )
    fragment_sync_delay: int = Field(
        0,
        ge=0,
        description="streaming_diloco: tau, inner steps between a fragment's pseudo-gradient and its outer step "
        "(torchft's fragment_sync_delay): the delta is taken tau steps before the round's end and exchanged "
        "while those steps compute, the outer step applied at its end; less than inner_steps / fragments "
        "(0: at the end)",
    )
    fragment_update_alpha: float = Field(
        0.0,
        ge=0,
        le=1,
        description="streaming_diloco: a fragment's local parameters after its outer step are "
        "alpha * local + (1 - alpha) * the new global ones (torchft's fragment_update_alpha; 0: the global)",
    )
    outer_optimizer: Literal["nesterov", "sgd", "adam"] = Field(
        "nesterov",
        description="diloco: the optimizer of the averaged parameter deltas (a task's `outer_optimizer`, any optax "
        "transformation, wins); nesterov: SGD with Nesterov momentum (the DiLoCo paper's)",
    )
    outer_lr: float = Field(0.7, gt=0, description="diloco: the outer optimizer's learning rate")
    outer_momentum: float = Field(0.9, ge=0, lt=1, description="diloco: the outer SGD's momentum")
    ftar_timeout_s: float = Field(5.0, gt=0, description="a silent (hung) FTAR peer fails the step after this")
    commit_decision: Literal["ring", "coordinator"] = Field(
        "ring",
        description='who decides that a step commits (docs/design/step.md, "One history"). ring: each replica, once '
        "FTAR's confirmation ring completed on every host (no round trip; a cut inside the confirmation's last "
        "frame can let one replica commit a step its peer retries without it); coordinator: the coordinator, once "
        "every participant voted that its average succeeded (one more round trip per step, waiting at most "
        "ftar_timeout_s for the votes; closes that window)",
    )
    ftar_shared_memory: bool = Field(
        True,
        description="FTAR links between replicas on one host carry payloads "
        "through /dev/shm (frame headers stay on TCP)",
    )
    quorum_timeout_s: float = Field(
        120.0, gt=0, description="a replica whose coordinator gives it no quorum this long leaves with an error"
    )
    progress_timeout_s: float = Field(
        10.0,
        gt=0,
        description="a replica process whose training loop makes no "
        "progress this long (waits for the quorum, init, restores and checkpoint "
        "saves aside) leaves the job and exits; must exceed ftar_timeout_s",
    )
    digest_every: int = Field(
        1,
        ge=0,
        description="every N steps (0: never) send the coordinator the state's checksum, computed on the "
        "devices (it compares replicas and heals a diverged one); the full sha256 is taken at checkpoints and the end",
    )
    catchup_buffer_mib: float = Field(
        256.0,
        ge=0,
        description="RAM for the averaged updates a healing replica "
        "keeps for its replay; older ones spill to local disk (never dropped)",
    )
    catchup_rate_limit_mbps: float | None = Field(None, gt=0, description="test knob: slow snapshot transfers")
    catchup_streams: int = Field(
        2,
        ge=1,
        description="TCP connections one catch-up fetch downloads over at once (several pieces, and ranges of a "
        "large one, straight into place; 2 measured best on 2 cores); catchup_rate_limit_mbps holds for their sum",
    )
    drain_timeout_s: float = Field(
        60.0,
        ge=0,
        description="a finished replica serves its state this long "
        "at most, until every replica of the job has caught up",
    )
    on_host_loss: Literal["restart", "reduce"] = Field(
        "restart",
        description="restart: a replica that loses a host restarts whole once the host is back; "
        "reduce: its surviving hosts go on at once as a reduced-degree replica (constant global batch only), "
        "and it returns to full degree when the host is back",
    )
    reduced_min_fraction: float = Field(
        0.5,
        gt=0,
        le=1,
        description="reduce: a replica left with fewer than this fraction of mesh.hosts restarts whole instead",
    )

    @model_validator(mode="after")
    def _progress_after_ftar(self) -> FTConfig:
        # A healthy replica waits up to ftar_timeout_s for a hung peer before it reports it: a
        # shorter progress deadline would make it leave the job for its peer's fault.
        if self.progress_timeout_s <= self.ftar_timeout_s:
            raise ValueError(
                f"progress_timeout_s ({self.progress_timeout_s}) must exceed ftar_timeout_s ({self.ftar_timeout_s})"
            )
        return self


class HardwareConfig(_Strict):
    """What the devices can do, where JAX's device kind does not say (ftjax/base/accelerators.py)."""

    peak_flops_per_device: float | None = Field(
        None,
        gt=0,
        description="peak dense FLOP/s of one device, the denominator of each step's MFU; default: "
        "the known devices' bf16 peak by device kind (none on CPU: no MFU)",
    )


class NetConfig(_Strict):
    """Where a train process's listeners (FTAR, catch-up, its replica's jax.distributed service)
    bind, and the address its peers dial (ftjax/base/net.py). The environment wins over these, since it
    is per process and the config is the job's: $FTJAX_BIND_HOST, $FTJAX_ADVERTISE_HOST."""

    bind_host: str | None = Field(
        None,
        description="host to bind (default: all interfaces, IPv6 and IPv4; "
        "the loopback address when the process advertises one)",
    )
    advertise_host: str | None = Field(
        None, description="host peers dial (default: the source address of this machine's route to the coordinator)"
    )
    interface: str | None = Field(
        None, description="advertise this network interface's address (e.g. ib0), unless advertise_host is set"
    )

    @field_validator("bind_host", "advertise_host", "interface")
    @classmethod
    def _a_host(cls, value: str | None, info) -> str | None:
        if value is not None and (not value.strip() or any(c.isspace() for c in value.strip())):
            raise ValueError(f"{value!r} is not a host (leave it out for the default)")
        if info.field_name == "advertise_host" and value is not None and is_all_interfaces(normalize_host(value)):
            raise ValueError(f"{value!r} is every interface, not an address peers can dial")
        return value


class Config(_Strict):
    seed: int = Field(0, description="the seed of the initial parameters and of the data order")
    steps: int = Field(30, gt=0, description="steps to train (with diloco: outer rounds, after sync_warmup_steps)")
    platform: Literal["auto", "cpu", "gpu", "tpu"] = Field(
        "auto",
        description="auto: what JAX finds; cpu: CPU with mesh.devices_per_host simulated devices; "
        "gpu, tpu: fail unless JAX finds one",
    )
    model: ModelConfig = Field(
        default_factory=ModelConfig, description="the built-in model (a task's own model ignores it)"
    )
    data: DataConfig = Field(
        default_factory=DataConfig,
        description="the batch: its size per replica, micro-batches, the built-in data source",
    )
    mesh: MeshConfig = Field(
        default_factory=MeshConfig,
        description="the devices of one replica: hosts, devices per host, tensor parallelism",
    )
    optim: OptimConfig = Field(
        default_factory=OptimConfig,
        description="the optimizer: AdamW with warmup and cosine decay, global-norm clipping",
    )
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="durable checkpoints and the weights a run starts from"
    )
    coordinator: CoordinatorConfig = Field(
        default_factory=CoordinatorConfig, description="the coordinator's timeouts and quorum size"
    )
    ft: FTConfig = Field(
        default_factory=FTConfig,
        description="fault tolerance: the job's replicas, the gradient average, sync modes, timeouts",
    )
    net: NetConfig = Field(
        default_factory=NetConfig, description="where a process's listeners bind and the address its peers dial"
    )
    hardware: HardwareConfig = Field(
        default_factory=HardwareConfig, description="what ftjax cannot ask JAX: the devices' peak FLOP/s"
    )
    eval: EvalConfig = Field(default_factory=EvalConfig, description="held-out evaluation")
    log: LogConfig = Field(
        default_factory=LogConfig, description="where records go besides metrics.jsonl: TensorBoard, W&B"
    )
    task: str | None = Field(
        None,
        description="what to train: 'package.module:factory', called as factory(cfg, "
        "**task_args) and returning an ftjax.Task (default: the built-in language model "
        "of the model: and data: sections, ftjax.program.tasks:language_model)",
    )
    task_args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the task's factory")
    task_path: list[str] = Field(
        default_factory=list,
        description="directories searched first for the task's module (relative ones: to the config file's directory)",
    )

    @field_validator("task")
    @classmethod
    def _task_path_form(cls, v: str | None) -> str | None:
        if v is not None:
            module, sep, attr = v.partition(":")
            if not (
                module and sep and attr and all(p.isidentifier() for p in module.split(".")) and attr.isidentifier()
            ):
                raise ValueError(f"expected 'package.module:factory', got {v!r}")
        return v

    @model_validator(mode="after")
    def _mesh_fits(self) -> Config:
        n = self.mesh.num_devices
        if self.data.batch_size % n:
            raise ValueError(
                f"mesh: data.batch_size ({self.data.batch_size}) must be divisible by the replica's "
                f"{n} devices (mesh.hosts={self.mesh.hosts} x mesh.devices_per_host={self.mesh.devices_per_host})"
            )
        # FSDP shards every parameter along its `embed` (d_model) dimension over all devices. The
        # built-in tasks (ftjax.program.tasks:language_model, :token_lm) are the models of `model:`.
        if (self.task is None or self.task.startswith("ftjax.program.tasks:")) and self.model.d_model % n:
            raise ValueError(
                f"mesh: model.d_model ({self.model.d_model}) must be divisible by the replica's {n} devices "
                "(FSDP shards the embedding dimension)"
            )
        t, model = self.mesh.tensor, self.model
        if t > 1 and (self.task is None or self.task.startswith("ftjax.program.tasks:")):
            # tensor parallelism splits the MLP's hidden dimension and (llama) the heads
            split = {
                "d_ff": model.d_ff,
                **({"n_heads": model.n_heads, "n_kv_heads": model.kv_heads} if model.kind == "llama" else {}),
            }
            for name, size in split.items():
                if size % t:
                    raise ValueError(f"mesh: model.{name} ({size}) must be divisible by mesh.tensor ({t})")
        m = self.ft.micro_batch_rows
        if m is not None and (self.data.batch_size % m or m % n):
            raise ValueError(
                f"ft.micro_batch_rows ({m}) must divide data.batch_size ({self.data.batch_size}) "
                f"and be a multiple of the replica's {n} devices"
            )
        if self.ft.sync_warmup_steps and self.ft.sync == "every_step":
            raise ValueError(
                "ft.sync_warmup_steps: only with ft.sync diloco or streaming_diloco (every_step averages every "
                "step anyway)"
            )
        self._check_wire()
        if self.ft.sync != "every_step":
            self._check_diloco()
        elif knob := next((n for n in ("fragment_sync_delay", "fragment_update_alpha") if getattr(self.ft, n)), None):
            raise ValueError(f"ft.{knob}: only with ft.sync=streaming_diloco")
        elif self.ft.global_batch != "constant":
            # Rows a reduced replica does not compute go to the others, exactly once; elastic mode
            # has nobody to give them to (its batch n of stream r is trained by replica r or never).
            for key, on in (
                ("ft.on_host_loss", self.ft.on_host_loss == "reduce"),
                ("mesh.live_hosts", self.mesh.live < self.mesh.hosts),
            ):
                if on:
                    raise ValueError(
                        f"{key}: a reduced-degree replica needs ft.global_batch=constant "
                        "(the rows it no longer computes are dealt to the other replicas)"
                    )
        if self.mesh.live < self.mesh.hosts and self.own_rows % self.micro_rows:
            raise ValueError(
                f"mesh.live_hosts ({self.mesh.live}): its share of the batch ({self.own_rows} of "
                f"{self.data.batch_size} rows) is not a whole number of micro-batches "
                f"({self.micro_rows} rows, ft.micro_batch_rows)"
            )
        return self

    def _check_wire(self) -> None:
        if self.ft.wire_dtype == "int8" and self.ft.sync == "every_step":
            raise ValueError(
                "ft.wire_dtype=int8: only with ft.sync diloco or streaming_diloco (its outer deltas; every-step "
                "gradients in int8 are not measured)"
            )

    def _check_diloco(self) -> None:
        """ft.sync diloco or streaming_diloco: each replica trains its own batches alone between two
        averages, so nobody computes another's rows (elastic) and a reduced replica trains its
        whole batch on fewer devices."""
        ft = self.ft
        if ft.global_batch != "elastic":
            raise ValueError(f"ft.sync={ft.sync}: ft.global_batch must be elastic (each replica trains its batches)")
        if ft.sync == "streaming_diloco" and ft.inner_steps % ft.fragments:
            raise ValueError(
                f"ft.fragments ({ft.fragments}) must divide ft.inner_steps ({ft.inner_steps}): "
                "a fragment is averaged every inner_steps / fragments steps"
            )
        streaming = ft.sync == "streaming_diloco" and ft.fragments > 1  # (local parameters of their own)
        for name in ("fragment_sync_delay", "fragment_update_alpha"):
            if getattr(ft, name) and not streaming:
                raise ValueError(f"ft.{name}: only with ft.sync=streaming_diloco and ft.fragments > 1")
        if ft.fragment_sync_delay >= max(1, self.inner_per_step):
            raise ValueError(
                f"ft.fragment_sync_delay ({ft.fragment_sync_delay}) must be less than a round's "
                f"{self.inner_per_step} inner steps (ft.inner_steps / ft.fragments)"
            )
        if self.data.batch_size % self.mesh.live_devices:
            raise ValueError(
                f"data.batch_size ({self.data.batch_size}) must be divisible by the replica's "
                f"{self.mesh.live_devices} live devices (ft.sync={ft.sync}: a reduced replica trains its whole batch)"
            )

    @property
    def sync_fragments(self) -> int:
        """Parts of the parameters averaged in turn, one per step of the protocol: ft.fragments when
        streaming DiLoCo, else 1 (the whole update every step or round)."""
        return self.ft.fragments if self.ft.sync == "streaming_diloco" else 1

    @property
    def inner_per_step(self) -> int:
        """Optimizer steps a replica takes in one step of the protocol: 1, or an outer round's inner steps."""
        if self.ft.sync == "every_step":
            return 1
        return self.ft.inner_steps // self.sync_fragments

    @property
    def warmup_sync_steps(self) -> int:
        """Steps of the job that average gradients before DiLoCo's rounds (ft.sync_warmup_steps, at most `steps`)."""
        return min(self.ft.sync_warmup_steps, self.steps)  # (0 with every_step: validated)

    @property
    def train_steps(self) -> int:
        """Optimizer steps of the job (the learning-rate schedule's length): `steps` x `inner_per_step`,
        a synchronous warm-up step counting one."""
        w = self.warmup_sync_steps
        return w + (self.steps - w) * self.inner_per_step

    @model_validator(mode="after")
    def _micro_batches_fit(self) -> Config:
        # a micro-batch is split over the replica's devices like a batch (ftjax/program/step.py)
        n, k = self.mesh.num_devices, self.data.micro_batches
        if (self.data.batch_size // k) % n:
            raise ValueError(
                f"data.micro_batches ({k}): a micro-batch of {self.data.batch_size // k} rows "
                f"(data.batch_size / micro_batches) must be divisible by the replica's {n} devices"
            )
        return self

    @model_validator(mode="after")
    def _batch_fits(self) -> Config:
        # An absurd batch otherwise gets as far as the data pipeline and grows the process until the
        # OS kills it. The bound is far above any batch that fits an accelerator's memory (2**22
        # tokens make 4 GiB of float32 logits per device even at a byte vocabulary).
        n, tokens = self.mesh.num_devices, self.data.batch_size * self.model.seq_len
        if tokens > MAX_TOKENS_PER_DEVICE * n:
            raise ValueError(
                f"data.batch_size ({self.data.batch_size}) x model.seq_len ({self.model.seq_len}) = {tokens:,} "
                f"tokens per step, over the limit of {MAX_TOKENS_PER_DEVICE:,} per device x {n} devices "
                f"(the step's activations would not fit in memory): lower data.batch_size, or add replicas "
                f"(ft.replicas) or devices (mesh.devices_per_host) for a larger global batch"
            )
        return self

    @property
    def own_rows(self) -> int:
        """Rows of its own batch a replica computes: all, or a reduced replica's share, in proportion
        to its devices."""
        if self.ft.sync != "every_step":  # (a DiLoCo replica trains its own batches, whatever its degree)
            return self.data.batch_size
        return share_rows(self.data.batch_size, self.mesh.live, self.mesh.hosts)

    @property
    def micro_rows(self) -> int:
        """Rows of a micro-batch in constant-batch mode: ft.micro_batch_rows, else the smallest
        multiple of the device count that divides the batch and is at least a quarter of it."""
        if self.ft.micro_batch_rows is not None:
            return self.ft.micro_batch_rows
        b, n = self.data.batch_size, self.mesh.num_devices
        return next(m for m in range(n, b + 1, n) if b % m == 0 and 4 * m >= b)


# Keys that configs once had: a config still using one is refused with this hint.
_RETIRED = {
    "log_every": "removed: it had no effect",
    "coordinator.heartbeat_timeout_ms": "renamed coordinator.heartbeat_timeout_s, in seconds",
    "coordinator.join_timeout_ms": "renamed coordinator.join_timeout_s, in seconds",
    "ft.catchup_dir": "removed: catch-up goes from host to host, memory to memory (no directory)",
}


def _format_errors(err: ValidationError, where: tuple[str, ...] = ()) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in (*where, *e["loc"]))
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key" + (f" ({_RETIRED[loc]})" if loc in _RETIRED else "")
        shown = "input" in e and not isinstance(e["input"], dict) and repr(e["input"]) not in msg  # (ours may name it)
        got = f" (got {e['input']!r})" if shown else ""
        lines.append(f"{loc}: {msg}{got}" if loc else msg)
    return "; ".join(lines)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (value parsed as YAML) to a nested dict, returning a new dict."""
    out = _deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. model.d_model=128")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override {item!r}: empty key")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as e:
            raise ConfigError(f"{key}: cannot parse value {raw!r}: {e}") from None
        node = out
        for p in parts[:-1]:
            child = node.get(p)
            if child is None:
                child = node[p] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"{key}: {p!r} is not a section")
            node = child
        node[parts[-1]] = value
    return out


def _deepcopy(d: dict[str, Any]) -> dict[str, Any]:
    return {k: _deepcopy(v) if isinstance(v, dict) else v for k, v in d.items()}


def validated(model: type[M], data: dict[str, Any], *where: str) -> M:
    """`model` (a config or one of its sections, at path `where`) validated from `data`; ConfigError
    naming each field at fault."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, where)) from None


def load_config_dict(data: object) -> Config:
    if not isinstance(data, dict):
        raise ConfigError(f"config must be a mapping of sections, got {type(data).__name__}")
    return validated(Config, data)


BUILTIN_CONFIGS_DIR = Path(__file__).resolve().parent / "configs"


def builtin_configs() -> list[str]:
    """Names of the configs that ship inside the package (`tiny`, `gpt_small`, ...)."""
    return sorted(p.stem for p in BUILTIN_CONFIGS_DIR.glob("*.yaml"))


def resolve_config_path(config: str | Path) -> Path:
    """The YAML file that `config` names: a path to a file that exists wins; else the name of a
    built-in config (`tiny`, `tiny.yaml`); else ConfigError naming what was not found and listing the
    built-in names."""
    path = Path(config)
    if path.is_file():
        return path
    name = str(config)
    if "/" not in name and os.sep not in name:
        builtin = BUILTIN_CONFIGS_DIR / (name if name.endswith((".yaml", ".yml")) else f"{name}.yaml")
        if builtin.is_file():
            return builtin
    names = ", ".join(builtin_configs()) or "(none)"
    raise ConfigError(f"{config}: No such file, and not the name of a built-in config (built-in: {names})")


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read a YAML config (a path, or a built-in name: see resolve_config_path), apply overrides,
    validate. Raises ConfigError naming the field at fault."""
    path = resolve_config_path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: {e.strerror}") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: config must be a mapping of sections")
    data = apply_overrides(data, overrides or [])
    if isinstance(data.get("task_path"), list):  # relative to the config's directory, wherever we run
        data["task_path"] = [str((path.parent / str(d)).resolve()) for d in data["task_path"]]
    return load_config_dict(data)
