"""Every input of one simulation (SimConfig), and the inputs derived from them at a given scale.

Units: time in minutes, sizes in GPUs and hosts. Each field is a `ftjax simulate --field-name`
option; the presets (ftjax.sim.presets) give every field a value.

Inter-replica communication is modelled only when --link-gbps and --params are given (neither: the
step time is all there is, as before): one ring all-reduce of the gradients over the R replicas
takes 2 (R - 1) / R x params x bytes-per-param / link seconds (:meth:`SimConfig.allreduce_s`), added to
--step-s (then the compute time of a step) every step, or every --inner-steps steps for DiLoCo
(ftjax.sim.strategies.Diloco).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

CheckpointRule = Literal["young", "daly", "optimal"]

# Reduced-degree throughput of a replica against the fraction of its GPUs alive (piecewise linear).
# Measured by `ftjax bench reduced tiny data.batch_size=256` (README, "Performance"): a replica on
# half its hosts runs the same rows at 0.956 of the rate of a replica built for that size (the
# reduced mode's own cost: two lanes per host, the batch through `accumulate`), so 0.5 x 0.956 at
# half the GPUs, linear in the GPUs alive otherwise (FSDP compute on accelerators). Measured on CPU
# at one point; `--reduced-curve` replaces it (NTP, arXiv 2504.06095, reports 10-20% below the
# live share at reduced TP degree without power boost).
DEFAULT_REDUCED_CURVE: tuple[tuple[float, float], ...] = ((0.0, 0.0), (0.5, 0.478), (1.0, 1.0))

# NCCL communicator init grows with the GPU count: ~17 s at 16K GPUs, ~200 s at 98K (figures quoted
# in issue 19): 200/17 = (98/16)^a gives a = 1.36.
INIT_EXPONENT = math.log(200 / 17) / math.log(98_304 / 16_384)


class SimConfig(BaseModel):
    """Every input of one simulation. Each field is a `ftjax simulate --field-name` option."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # -- the job --
    gpus: int = Field(gt=0, description="GPUs in the job")
    gpus_per_host: int = Field(gt=0, description="GPUs per host (server)")
    replicas: int = Field(
        gt=0, description="data-parallel replicas (ft-hsdp, reduced-degree) = groups (redundancy, spare)"
    )
    steps: int = Field(gt=0, description="training steps to time-to-train")
    step_s: float = Field(
        gt=0,
        description="failure-free step time, seconds; with --link-gbps, its compute only (the inter-replica "
        "all-reduce is added to it)",
    )
    train_for: Literal["tokens", "steps"] = Field(
        description="tokens: the job ends when it has trained steps x the global batch (a step with k of R "
        "replicas trains k/R of one; the FT-HSDP paper's GPU-time accounting); steps: it ends "
        "after --steps steps however many replicas took part (what `ftjax launch` does)"
    )
    global_batch: Literal["elastic", "constant"] = Field(
        description="ft-hsdp (ftjax's ft.global_batch): elastic: a step with k of R replicas trains k of the R "
        "batches (with --train-for steps, the others' data is lost to the model); constant: the k "
        "compute all R batches, so a step takes R/k as long and no data is lost"
    )
    step_scaling: tuple[tuple[float, float], ...] = Field(
        description="--train-for steps: step time vs the fraction of replicas taking part, relative to all "
        "of them, points F:X,... (flat on a cluster; on one shared machine fewer replicas step faster)"
    )
    pause_fraction: float = Field(
        ge=0,
        lt=1,
        description="fraction of time lost to pauses unrelated to "
        "failures (logging, GC, jitter) while no unit is out "
        "(with one out, a failure's stall holds the others' "
        "losses: how --from-run measures them)",
    )

    # -- failures --
    mtbf_min: float = Field(gt=0, description="job-level mean time between failures at --gpus, minutes")
    failure_level: Literal["domain", "job"] = Field(
        description="domain: every failure domain (see --blast-radius) is a renewal process of its own; "
        "job: one job-level renewal process, each failure hitting a random domain"
    )
    failure_dist: Literal["exponential", "weibull"] = Field(
        description="time between failures of one domain (or of the job)"
    )
    weibull_shape: float = Field(gt=0, description="Weibull shape k (k<1: infant mortality, bursts)")
    failure_trace: str | None = Field(
        description="CSV of failures replacing the drawn ones: time_min [, gpus, first_gpu, hardware]"
    )
    blast_radius: Literal["gpu", "host", "rack"] = Field(description="what one failure takes down")
    hosts_per_rack: int = Field(gt=0, description="hosts per rack (--blast-radius rack)")
    hardware_share: float = Field(
        ge=0, le=1, description="share of failures that need a hardware repair (the rest: a restart fixes them)"
    )
    repair_min: float = Field(ge=0, description="minutes to repair a host after a hardware failure")
    spare_hosts: float = Field(ge=0, description="spare hosts that replace a host awaiting repair (inf: always one)")

    # -- recovery --
    sync_stall_min: float = Field(ge=0, description="whole-job restart, minutes, at --gpus (before --init-min)")
    init_min: float = Field(
        ge=0, description="communicator init added to every restart, minutes at --gpus; grows as GPUs^--init-exponent"
    )
    init_exponent: float = Field(ge=0, description="growth of init time with the GPU count")
    restart_policy: Literal["absorb", "queue", "restart"] = Field(
        description="a failure during a whole-job restart: absorb (the restart replaces it), queue (handled "
        "when the restart ends), restart (handled at once: a fatal one starts the restart over)"
    )
    ft_stall_min: float = Field(
        ge=0, description="stall of everyone per failure: detection + reconfiguration + step retry, minutes"
    )
    replica_restart_min: float = Field(
        ge=0,
        description="minutes a failed unit stays out after the "
        "stall: restart + catch-up (inf: until the next "
        "whole-job restart)",
    )
    rejoin_stall_min: float = Field(
        ge=0, description="stall of everyone when a unit rejoins, minutes (0: non-blocking catch-up)"
    )
    overlap: Literal["queue", "restart"] = Field(
        description="a failure during an FT stall: queue its full stall after the current one, or restart "
        "the stall clock"
    )
    checkpoint_interval_min: float | CheckpointRule = Field(
        description="minutes of training between durable checkpoints (0: none, lost work is part of "
        "--sync-stall-min), or young | daly | optimal (per strategy, from its rate of rollbacks)"
    )
    checkpoint_cost_min: float = Field(ge=0, description="blocking minutes per checkpoint save")

    # -- strategies --
    redundancy: int = Field(ge=1, description="copies of each data shard (redundancy, spare)")
    reduced_recovery: Literal["job-restart", "ft-stall"] = Field(
        description="reduced-degree: a failure restarts the job from its checkpoint (NTP) or stalls "
        "everyone like an ft-hsdp failure"
    )
    reduced_curve: tuple[tuple[float, float], ...] = Field(
        description="reduced-degree replica throughput vs fraction of its GPUs alive, points F:T,..."
    )
    power_boost: float = Field(ge=0, description="reduced replicas run (1 + X) x faster, up to a full one")
    packing: bool = Field(description="reduced-degree: pack failed GPUs into as few replicas as possible")
    min_degree: float = Field(
        ge=0, le=1, description="smallest fraction of its GPUs a reduced replica runs with (below: it is out)"
    )

    # -- inter-replica communication (off unless --link-gbps and --params are both given) --
    link_gbps: float | None = Field(
        gt=0, description="bandwidth of each replica's inter-replica link, Gbit/s (the ring all-reduce's)"
    )
    params: float | None = Field(gt=0, description="model parameters: the elements of one gradient all-reduce")
    bytes_per_param: float = Field(
        gt=0, description="bytes per all-reduced element (4: float32, the gradients' and DiLoCo's deltas')"
    )
    inner_steps: int = Field(
        gt=0, description="diloco, streaming-diloco (ftjax's ft.inner_steps H): steps between two averages"
    )
    fragments: int = Field(
        gt=0, description="streaming-diloco (ft.fragments F): parts of the parameters, one averaged every H/F steps"
    )
    fragment_sync_delay: int = Field(
        0,
        ge=0,
        description="streaming-diloco (ft.fragment_sync_delay tau): a round's all-reduce runs while its last tau "
        "steps compute, hidden up to tau x --step-s",
    )

    # -- stragglers --
    straggler_mtbs_min: float = Field(
        gt=0, description="job-level mean time between slow-replica episodes, minutes (inf: none)"
    )
    straggler_min: float = Field(ge=0, description="length of one slow episode, minutes")
    straggler_slowdown: float = Field(ge=1, description="a slow replica's step time, x the normal one")
    straggler_detect_min: float = Field(ge=0, description="minutes before ft-hsdp drops a slow replica from the quorum")

    # -- the runs --
    seeds: int = Field(ge=1, description="independent failure traces to average over")
    seed: int = Field(ge=0, description="base random seed")
    max_slowdown: float = Field(
        gt=1, description="a job not done after this many times its failure-free time is reported not finished"
    )

    @field_validator("reduced_curve")
    @classmethod
    def _curve(cls, curve: tuple[tuple[float, float], ...]) -> tuple[tuple[float, float], ...]:
        points = sorted(curve)
        if len(points) < 2 or points[0][0] > 0 or points[-1][0] < 1:
            raise ValueError("needs points covering fractions 0 to 1 (e.g. 0:0,0.5:0.4,1:1)")
        for f, t in points:
            if not (0 <= f <= 1 and 0 <= t <= 1):
                raise ValueError(f"point {f}:{t}: fraction and throughput must be in [0, 1]")
        if any(a[1] > b[1] for a, b in zip(points, points[1:])):
            raise ValueError("throughput must not fall as the fraction alive grows")
        return tuple(points)

    @field_validator("step_scaling")
    @classmethod
    def _scaling(cls, points: tuple[tuple[float, float], ...]) -> tuple[tuple[float, float], ...]:
        points = tuple(sorted(points))
        if not points:
            raise ValueError("needs at least one point F:X")
        for f, x in points:
            if not (0 < f <= 1 and x > 0):
                raise ValueError(f"point {f}:{x}: the fraction must be in (0, 1] and the step time ratio > 0")
        return points

    def step_ratio(self, live: float) -> float:
        """Step time with a fraction ``live`` of the replicas taking part, relative to all of them
        (piecewise linear through --step-scaling, flat beyond its ends)."""
        pts = self.step_scaling
        if live <= pts[0][0]:
            return pts[0][1]
        for (f0, x0), (f1, x1) in zip(pts, pts[1:]):
            if live <= f1:
                return x0 + (x1 - x0) * (live - f0) / (f1 - f0)
        return pts[-1][1]

    @field_validator("spare_hosts")
    @classmethod
    def _whole(cls, v: float) -> float:
        if not math.isinf(v) and v != int(v):
            raise ValueError("must be a whole number of hosts or inf")
        return v

    @model_validator(mode="after")
    def _shape(self) -> SimConfig:
        unit = self.replicas * self.gpus_per_host
        if self.gpus % unit:
            raise ValueError(
                f"--gpus ({self.gpus}) must be a multiple of --replicas x --gpus-per-host ({unit}): "
                "every replica has the same whole number of hosts"
            )
        if self.redundancy > self.replicas:
            raise ValueError(f"--redundancy ({self.redundancy}) cannot exceed --replicas ({self.replicas})")
        if isinstance(self.checkpoint_interval_min, str) and self.checkpoint_cost_min <= 0:
            raise ValueError(
                f"--checkpoint-interval-min {self.checkpoint_interval_min} needs "
                "--checkpoint-cost-min > 0 (free saves would be taken continuously)"
            )
        if not isinstance(self.checkpoint_interval_min, str) and self.checkpoint_interval_min < 0:
            raise ValueError("--checkpoint-interval-min must be >= 0, or young | daly | optimal")
        if (self.link_gbps is None) != (self.params is None):
            raise ValueError("--link-gbps and --params go together (the all-reduce time needs both)")
        if self.inner_steps % self.fragments:
            raise ValueError(
                f"--fragments ({self.fragments}) must divide --inner-steps ({self.inner_steps}): "
                "a fragment is averaged every inner-steps / fragments steps"
            )
        if self.fragment_sync_delay >= max(1, self.inner_steps // self.fragments):
            raise ValueError(
                f"--fragment-sync-delay ({self.fragment_sync_delay}) must be less than a round's steps "
                f"(inner-steps / fragments = {self.inner_steps // self.fragments})"
            )
        if self.blast_radius == "rack" and self.hosts % self.hosts_per_rack:
            raise ValueError(
                f"--hosts-per-rack ({self.hosts_per_rack}) must divide the hosts ({self.hosts}) "
                "with --blast-radius rack"
            )
        return self

    # -- derived sizes --
    @property
    def hosts(self) -> int:
        return self.gpus // self.gpus_per_host

    @property
    def hosts_per_replica(self) -> int:
        return self.hosts // self.replicas

    @property
    def gpus_per_replica(self) -> int:
        return self.gpus // self.replicas

    @property
    def blast_gpus(self) -> int:
        """GPUs in one failure domain."""
        return {"gpu": 1, "host": self.gpus_per_host, "rack": self.gpus_per_host * self.hosts_per_rack}[
            self.blast_radius
        ]

    @property
    def work_min(self) -> float:
        """Failure-free duration of the job (minutes of work to train)."""
        return self.steps * self.step_s / 60.0

    # -- derived times --
    def job_restart_min(self) -> float:
        """One whole-job restart: --sync-stall-min plus communicator init at the job's size."""
        return self.sync_stall_min + self.init_min

    def unit_restart_min(self, unit_gpus: int) -> float:
        """A unit's time out after the stall: --replica-restart-min plus init at the unit's size."""
        return self.replica_restart_min + self.init_min * (unit_gpus / self.gpus) ** self.init_exponent

    def allreduce_s(self) -> float:
        """One ring all-reduce of the gradients over the replicas, seconds: each replica sends and
        receives 2 (R - 1) / R of the bytes over its link (0 when communication is not modelled)."""
        if self.link_gbps is None or self.params is None:
            return 0.0
        r = self.replicas
        return 2 * (r - 1) / r * self.params * self.bytes_per_param * 8 / (self.link_gbps * 1e9)

    # -- the same job at another point --
    def at_gpus(self, gpus: int) -> SimConfig:
        """The same job at another GPU count: the job-level MTBF scales as 1/GPUs (the rate per domain
        stays fixed), and communicator init as GPUs^init_exponent."""
        scale = gpus / self.gpus
        return self.with_values(
            gpus=gpus, mtbf_min=self.mtbf_min / scale, init_min=self.init_min * scale**self.init_exponent
        )

    def with_values(self, **values) -> SimConfig:
        return SimConfig.model_validate({**self.model_dump(), **values})
