"""Durable checkpoints with orbax's CheckpointManager: async, every N steps, keep K.

A checkpoint holds the train state (restored into the current mesh's shardings, so a job may come
back on another device count) and a small JSON record: the step and the replica's data stream
position, which make `--resume` continue the exact batch sequence, and the identity of the job that
wrote it (:func:`job_identity`). A checkpoint is restored only into the same job: another one's (an
earlier run in the same directory with another seed, corpus, model or optimizer) raises
:class:`CheckpointMismatch` instead of being trained on silently.

Each finished checkpoint is sealed with the size and SHA-256 of every file it holds (CHECKSUMS in the
step's directory; orbax records no checksum of the array data), written once orbax has committed the
step. A restore verifies them first: a flipped, truncated or missing file, or a
checkpoint whose save never finished (no CHECKSUMS), raises :class:`CorruptCheckpoint` naming the step
and the file, and :meth:`DurableCheckpoints.restore_intact` falls back to the newest intact one.

The layout is plain orbax, readable without ftjax (docs/design/checkpoints.md, "Checkpoint layout"): each
checkpoint's meta records `params_digest`, which a program with only jax and orbax can recompute.
:func:`load_init` reads the other way: a run may start from a plain orbax checkpoint of the user's
parameters (`checkpoint.init_from`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from ftjax.base.trees import PyTree
from ftjax.config import ModelConfig
from ftjax.program.digest import params_digest
from ftjax.program.task import config_setting

CHECKSUMS = "ftjax_checksums.json"  # in each step's directory: {relative path: [size, sha256]}


class CheckpointError(ValueError):
    """A durable checkpoint cannot be used (the message says why and what to do)."""


class CheckpointMismatch(CheckpointError):
    """The checkpoint was written by another job (or by one that did not record its identity)."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint's files differ from the checksums recorded when it was saved (or it has none)."""

    def __init__(self, step: int, file: str, problem: str):
        super().__init__(f"checkpoint step {step} is corrupt or incomplete: {file}: {problem}")
        self.step, self.file, self.problem = step, file, problem
        self.moved_to: Path | None = None  # where restore_intact put it aside


class NoIntactCheckpoint(CheckpointError):
    """Every checkpoint in the directory is corrupt or incomplete."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (a full disk, a file size limit, a read-only directory)."""


def write_failure(where: str, step: int | None, e: BaseException) -> CheckpointWriteError:
    """One line for a failed save: the step, the directory, the file and the OS's reason. Orbax
    reports a failed write as tensorstore's ValueError, whose text names the file and the errno
    ("Failed writing: "PATH" ... [os_error_code='28']"), or as an OSError."""
    text = str(e)
    cause: BaseException | None = e
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, OSError) and cause.errno:
        why = f"{cause.filename or where}: {os.strerror(cause.errno)}"
    elif code := re.search(r"os_error_code='(\d+)'", text):
        files = re.findall(r'Failed writing: "([^"]+)"', text)
        why = f"{files[-1] if files else where}: {os.strerror(int(code.group(1)))}"
    else:
        why = text.splitlines()[0][:300] if text else type(e).__name__
    when = f"; seen at step {step}" if step is not None else ""  # (a background save fails at a later one)
    return CheckpointWriteError(
        f"cannot save checkpoints in {where} (checkpoint.dir{when}): {why}"
        + (f" (orbax's tracebacks: {_ORBAX_ERRORS.log})" if _ORBAX_ERRORS.log is not None else "")
    )


class _OrbaxErrors(logging.Filter):
    """Keeps orbax's ERROR records off the terminal: it logs one failed background save with its
    traceback once per thread that saw it (~470 lines for one full disk), and the failure is
    reported in one line (CheckpointWriteError). They are appended, best effort (that disk may be
    the full one), to `log`, beside the checkpoint directory."""

    log: Path | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        # (orbax's own, and asyncio's about a task of orbax's that failed: "never retrieved")
        if record.levelno < logging.ERROR or "orbax" not in record.pathname + record.getMessage():
            return True
        if self.log is not None:
            with contextlib.suppress(OSError), open(self.log, "a") as f:
                f.write(logging.Formatter("%(asctime)s %(levelname)s %(message)s").format(record) + "\n")
        return False


_ORBAX_ERRORS = _OrbaxErrors()


def _closed_loop_hook(previous: Callable) -> Callable:
    """sys.unraisablehook, less tensorstore's reports of a write that finished after orbax closed the
    event loop of its failed save (`RuntimeError: Event loop is closed`, from its threads, tens of
    them): appended, best effort, to the orbax errors' log."""

    def hook(u) -> None:
        if u.exc_type is RuntimeError and str(u.exc_value) == "Event loop is closed" and _ORBAX_ERRORS.log:
            with contextlib.suppress(OSError), open(_ORBAX_ERRORS.log, "a") as f:
                f.write("".join(traceback.format_exception(u.exc_type, u.exc_value, u.exc_traceback)))
            return
        previous(u)

    hook.closed_loop = True  # type: ignore[attr-defined]  # (a function attribute: this hook's mark)
    return hook


class InitCheckpointError(CheckpointError):
    """`checkpoint.init_from` cannot start this run: not a checkpoint, or not of this model (the
    message names every leaf at fault)."""


def _files(step_dir: Path) -> dict[str, Path]:
    """{relative path: path} of a step's files, its seal apart."""
    return {str(p.relative_to(step_dir)): p for p in sorted(step_dir.rglob("*")) if p.is_file() and p.name != CHECKSUMS}


def _checksums(step_dir: Path) -> dict[str, list]:
    out = {}
    for name, path in _files(step_dir).items():
        with open(path, "rb") as f:
            out[name] = [path.stat().st_size, hashlib.file_digest(f, "sha256").hexdigest()]
    return out


def seal(step_dir: Path) -> None:
    """Record the checksums of a committed checkpoint's files (written to a temporary name and
    renamed, so that a crash leaves no half-written record)."""
    tmp = step_dir / (CHECKSUMS + ".tmp")
    tmp.write_text(json.dumps(_checksums(step_dir)))
    tmp.rename(step_dir / CHECKSUMS)


def verify(step_dir: Path, step: int) -> None:
    """Raise CorruptCheckpoint naming the first file that differs from the checkpoint's seal."""
    try:
        text = (step_dir / CHECKSUMS).read_text()
    except FileNotFoundError:
        raise CorruptCheckpoint(
            step, str(step_dir / CHECKSUMS), "missing: the save did not finish (or the checkpoint predates checksums)"
        ) from None
    try:
        recorded = {str(name): (int(size), str(digest)) for name, (size, digest) in json.loads(text).items()}
    except (ValueError, TypeError, AttributeError) as e:
        raise CorruptCheckpoint(step, str(step_dir / CHECKSUMS), f"unreadable ({e})") from None
    # A seal vouches only for the files it lists: one that lists none (`{}`) or leaves a file out
    # would pass an unchecked file as intact. The seal is written once every file is final, so an
    # unlisted file is damage (or an edit), never a save still in progress.
    unlisted = sorted(set(_files(step_dir)) - set(recorded))
    if not recorded or unlisted:
        what = "lists no file" if not recorded else f"does not list {unlisted[0]} ({len(unlisted)} unlisted)"
        raise CorruptCheckpoint(step, str(step_dir / CHECKSUMS), f"{what}: the seal is damaged")
    for name, (size, digest) in recorded.items():
        path = step_dir / name
        if not path.is_file():
            raise CorruptCheckpoint(step, str(path), "missing")
        if path.stat().st_size != size:
            raise CorruptCheckpoint(step, str(path), f"{path.stat().st_size} bytes, {size} when saved")
        with open(path, "rb") as f:
            if hashlib.file_digest(f, "sha256").hexdigest() != digest:
                raise CorruptCheckpoint(step, str(path), "content differs from its checksum")


class _SealingManager(ocp.CheckpointManager):
    """Seals each checkpoint once orbax has committed it: `_finalize_checkpoint` runs after the
    step's files are final, on the save's finalize thread (async) or in `save` (sync). A private
    hook; tests/integration/test_checkpoint_integrity.py fails if an orbax upgrade stops calling it."""

    def _finalize_checkpoint(self, step: int):
        super()._finalize_checkpoint(step)
        step_dir = Path(self.directory) / str(step)
        if jax.process_index() == 0 and step_dir.is_dir() and not (step_dir / CHECKSUMS).exists():
            seal(step_dir)


def params_structure(params: PyTree) -> str:
    """A short hash of a parameter tree's paths, shapes and dtypes (not its sharding: a checkpoint may
    be restored onto another mesh)."""
    rows = [
        f"{jax.tree_util.keystr(p)}:{tuple(x.shape)}:{x.dtype}"
        for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
    ]
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()[:16]


def job_identity(
    cfg, data_fingerprint: str, params: PyTree = None, locations: tuple[str, ...] = (), reads: tuple[str, ...] = ()
) -> dict[str, Any]:
    """What makes a checkpoint this job's: every setting that changes the numbers of the run, as a
    flat {"section.field": value} record (JSON scalars, so that it survives the meta's round trip).

    In: `seed` (initial parameters and the data shuffle); the data (the corpus's content fingerprint
    `data.fingerprint`, `data.batch_size`, and `ft.replicas`, which splits the stream among replicas:
    the stream position of a checkpoint means other batches under another split); the whole `optim`
    section (learning rate and its schedule, AdamW, clipping) and `ft.lr_scaling`. Whole sections,
    so that a field added to them later is checked by default.
    The task: its import path and arguments (`task`, `task_args`, less the `locations` that only say
    where its data is: `token_lm`'s `dir`, whose content `data.fingerprint` names), and the structure
    of its parameter tree (`params` given: paths, shapes, dtypes). A built-in task (the model of the
    `model:` section) adds `data.source` and the whole `model` section (see :func:`_model_identity`);
    a custom task reads neither, only the settings it declares (`reads`, `Task.reads`), with their values.

    The run's starting point when it is not the seed's (`checkpoint.init_from`, `checkpoint.init_opt`).

    Out, because the same job may change them between restarts: how the model is computed (`_HOW`),
    `data.micro_batches`,
    `steps` (a run may be extended; with no `optim.decay_steps` the cosine decay then stretches from the resume on,
    which is what extending means), the mesh (a checkpoint is resharded onto another device count), the
    checkpoint cadence and directory, logging, the coordinator and every fault-tolerance timeout or transport knob
    (live replicas must agree on more: :func:`replica_identity`).
    """
    builtin = builtin_task(cfg)
    identity: dict[str, Any] = {
        "seed": cfg.seed,
        **({"data.source": cfg.data.source} if builtin else {}),
        "data.fingerprint": data_fingerprint,
        "data.batch_size": cfg.data.batch_size,
        "ft.replicas": cfg.ft.replicas,
        "ft.lr_scaling": cfg.ft.lr_scaling,
        "task": cfg.task or "ftjax.program.tasks:language_model",
        "task_args": task_args_identity(cfg.task_args, locations),
    }
    if cfg.checkpoint.init_from:
        # The starting weights (and optimizer state) are the run's numbers like the seed's. Only
        # when set: a job without it keeps the identity it had before the field existed, so that
        # its older checkpoints still restore.
        identity["checkpoint.init_from"] = cfg.checkpoint.init_from
        identity["checkpoint.init_opt"] = cfg.checkpoint.init_opt
    if params is not None:
        identity["params.structure"] = params_structure(params)
    if builtin:
        identity.update(_model_identity(cfg.model))
    identity.update({f"optim.{k}": v for k, v in cfg.optim.model_dump().items()})
    identity.update({key: config_setting(cfg, key) for key in reads})
    return identity


def builtin_task(cfg) -> bool:
    """Whether the job trains a built-in task (`ftjax.program.tasks`: the model of the `model:`
    section on `data.source` or token files), the same rule as the config's mesh checks."""
    return cfg.task is None or cfg.task.startswith("ftjax.program.tasks:")


def _model_identity(model) -> dict[str, Any]:
    """The `model` section less how it is computed (`_HOW`); the llama's fields only when not at
    their defaults, so that checkpoints older than them keep their identity."""
    defaults = type(model)()
    return {
        f"model.{k}": v
        for k, v in model.model_dump().items()
        if f"model.{k}" not in _HOW and not (k in _LATER and v == getattr(defaults, k))
    }


def replica_identity(
    cfg, data_fingerprint: str, locations: tuple[str, ...] = (), reads: tuple[str, ...] = ()
) -> dict[str, Any]:
    """What the live replicas of one job must agree on, beyond their layout: the coordinator refuses a
    member whose record differs, naming the setting (`replica._topology`, coordinator/layout.py).
    The job identity (:func:`job_identity`) less `checkpoint.init_from` (a path: each machine may hold
    its copy of the weights elsewhere), plus what a checkpoint leaves out because a job may change it
    between restarts, but not between replicas that train together:
    `steps` (the job's end) and `optim.decay_steps` resolved (its default is the job's optimizer steps:
    two replicas of other `steps` would apply one average with two learning rates);
    `ft.grad_dtype`, `ft.wire_dtype`, `ft.link_streams` (FTAR's call fingerprint: a peer that frames
    otherwise fails every average) and `ft.commit_decision` (who commits a step);
    `ft.global_batch` (the divisor of the average; constant: who computes a missing batch, in
    micro-batches of `ft.micro_batch_rows`, resolved); DiLoCo's outer optimizer (its rounds:
    `replica._topology`'s sync line)."""
    identity = job_identity(cfg, data_fingerprint, locations=locations, reads=reads)
    identity.pop("checkpoint.init_from", None)
    ft = cfg.ft
    identity["optim.decay_steps"] = cfg.optim.decay_steps or cfg.train_steps
    identity.update(
        {
            "steps": cfg.steps,
            "ft.grad_dtype": ft.grad_dtype,
            "ft.wire_dtype": ft.wire_dtype,
            "ft.link_streams": ft.link_streams,
            "ft.commit_decision": ft.commit_decision,
            "ft.global_batch": ft.global_batch,
        }
    )
    if ft.global_batch == "constant":
        identity["ft.micro_batch_rows"] = cfg.micro_rows
    if ft.sync != "every_step":
        identity.update({f"ft.{k}": getattr(ft, k) for k in ("outer_optimizer", "outer_lr", "outer_momentum")})
    return identity


def task_args_identity(task_args: dict[str, Any] | str, locations: tuple[str, ...]) -> str:
    """`task_args` as the identity records them (JSON), less `locations`. Also applied to a
    checkpoint's recorded ones, which may hold a location (written before they were left out)."""
    args = json.loads(task_args) if isinstance(task_args, str) else task_args
    kept = {k: v for k, v in args.items() if k not in locations}
    return json.dumps(kept, sort_keys=True, default=str)


def recorded_identity(theirs: dict[str, Any], ours: dict[str, Any], locations: tuple[str, ...]) -> dict[str, Any]:
    """A checkpoint's recorded identity as this job compares it with its own (`ours`): its `task_args`
    less `locations` (it may hold one, written before they were left out), and for a custom task
    (no `data.source` in ours) less the built-in model's settings that ours does not read (a custom
    task's checkpoint recorded them before its identity left them out)."""
    if isinstance(theirs.get("task_args"), str):
        theirs = {**theirs, "task_args": task_args_identity(theirs["task_args"], locations)}
    if "data.source" not in ours:
        theirs = {k: v for k, v in theirs.items() if k in ours or not (k == "data.source" or k.startswith("model."))}
    return theirs


# How the model is computed, not what: a job may change them between restarts, like its mesh.
_HOW = ("model.compute_dtype", "model.remat", "model.attention", "model.attention_chunk", "model.logits_chunk")
# Model fields added after checkpoints recorded their job's identity (the llama's).
_LATER = ("n_kv_heads", "rope_theta", "tie_embeddings", "norm_eps", "scan_layers", "head_dim", "rope_scaling")


class DurableCheckpoints:
    """`identity` (see :func:`job_identity`) is saved in every checkpoint's meta and checked by
    `restore`; without one, nothing is saved or checked (a reader that only inspects checkpoints)."""

    def __init__(
        self,
        directory: str | Path,
        *,
        every: int,
        keep: int,
        async_save: bool = True,
        identity: dict[str, Any] | None = None,
        locations: tuple[str, ...] = (),
    ):
        self.every = every
        self.identity = identity
        self.locations = locations  # (the task's: see job_identity)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, save_interval_steps=max(every, 1), enable_async_checkpointing=async_save, create=True
        )
        self.manager = _SealingManager(Path(directory).absolute(), options=options)
        if identity is not None:  # (a job's own checkpoints, not a reader's)
            _ORBAX_ERRORS.log = Path(directory).absolute().parent / "checkpoint-errors.log"
            for name in ("absl", "asyncio"):
                logging.getLogger(name).addFilter(_ORBAX_ERRORS)  # (once: a logger keeps a filter once)
            if not getattr(sys.unraisablehook, "closed_loop", False):
                sys.unraisablehook = _closed_loop_hook(sys.unraisablehook)

    @classmethod
    def from_config(
        cls,
        cfg,
        run_dir: str | Path,
        *,
        data_fingerprint: str,
        params: PyTree = None,
        locations: tuple[str, ...] = (),
        reads: tuple[str, ...] = (),
        replica: int | None = None,
    ) -> DurableCheckpoints:
        """The checkpoints a run's config asks for (`checkpoint:` section; default dir RUN/checkpoints),
        holding and accepting only this job's (`data_fingerprint`: the data stream's; `locations`,
        `reads`: the task's, see job_identity). `replica`: a job member's id. Its checkpoints go to
        `checkpoint.dir`/replica-R when that is given: one path given to every replica of a job (the
        launcher passes the same overrides to all) must not make them save into, and delete from, one
        orbax root; each replica's state and data position are its own."""
        c = cfg.checkpoint
        given = c.dir and (Path(c.dir) / f"replica-{replica}" if replica is not None else Path(c.dir))
        return cls(
            given or Path(run_dir) / "checkpoints",
            every=c.every,
            keep=c.keep,
            async_save=c.async_save,
            identity=job_identity(cfg, data_fingerprint, params, locations, reads),
            locations=locations,
        )

    @property
    def where(self) -> str:
        """The checkpoint directory."""
        return str(self.manager.directory)

    def due(self, step: int, *, force: bool = False) -> bool:
        """Whether `maybe_save(step, ..., force=force)` would save."""
        if not force and (self.every <= 0 or step % self.every):
            return False
        return step != self.latest_step()  # (not saved already: a forced final save after a periodic one)

    def maybe_save(self, step: int, state: dict, meta: dict[str, Any], *, force: bool = False) -> bool:
        """Save at multiples of `every` (or when forced). Returns whether a save started."""
        if not self.due(step, force=force):
            return False
        if self.identity is not None:
            meta = {**meta, "identity": self.identity}
        # what a reader without ftjax can check the restored parameters against (collective)
        meta = {**meta, "params_digest": params_digest(state)}
        try:  # (a failed background save of an earlier step surfaces here too)
            return bool(
                self.manager.save(
                    step,
                    args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
                    force=force,
                )
            )
        except Exception as e:
            raise write_failure(self.where, step, e) from e

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore(self, abstract_state: dict, step: int | None = None) -> tuple[dict, dict]:
        """(state, meta) of `step` (default: latest), placed with `abstract_state`'s shardings.

        Raises CorruptCheckpoint if its files differ from their checksums, and CheckpointMismatch if
        it is not this job's, both before reading the state."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.manager.directory}")
        verify(Path(self.manager.directory) / str(step), step)
        if self.identity is not None:
            meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
            self._check(step, meta)
        out = self.manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore())
        )
        return out["state"], dict(out["meta"])

    def restore_intact(
        self, abstract_state: dict, on_corrupt: Callable[[CorruptCheckpoint], None]
    ) -> tuple[dict, dict]:
        """(state, meta) of the newest checkpoint that verifies; each corrupt one newer than it is
        passed to `on_corrupt`. Raises NoIntactCheckpoint when none verifies."""
        steps = sorted(self.manager.all_steps(), reverse=True)
        for step in steps:
            try:
                return self.restore(abstract_state, step)
            except CorruptCheckpoint as e:
                e.moved_to = self._quarantine(step)
                on_corrupt(e)
        raise NoIntactCheckpoint(
            f"no intact checkpoint in {self.manager.directory}: steps {', '.join(map(str, steps))} are all corrupt "
            f"or incomplete (each reported above). Restore the directory from a backup, or remove it "
            f"(rm -r {self.manager.directory}) and drop --resume to start the job afresh."
        )

    def _quarantine(self, step: int) -> Path:
        """Move a corrupt step out of orbax's sight (kept for inspection, in DIR/corrupt/): orbax
        would otherwise take it for the latest step, and refuse to save that step or any below it."""
        target = Path(self.manager.directory) / "corrupt" / f"{step}-{time.strftime('%Y%m%dT%H%M%S')}"
        if jax.process_index() == 0:
            target.parent.mkdir(exist_ok=True)
            (Path(self.manager.directory) / str(step)).rename(target)
        self.manager.reload()
        return target

    def _check(self, step: int, meta: dict[str, Any]) -> None:
        assert self.identity is not None  # (checked only for a job with an identity)
        where = f"checkpoint {self.manager.directory} (step {step})"
        todo = (
            f"Give this job another checkpoint.dir or run directory (--out), or remove the old "
            f"checkpoints (rm -r {self.manager.directory}) to start it afresh."
        )
        theirs = meta.get("identity")
        if theirs is None:
            # Refused, not accepted with a warning: a directory of an older run is exactly the case
            # to catch, and a warning is what went unnoticed before (the stale-run finding).
            raise CheckpointMismatch(
                f"{where} has no job identity (written before ftjax recorded one): "
                f"nothing shows that it belongs to this job.\n{todo}"
            )

        theirs = recorded_identity(theirs, self.identity, self.locations)

        def show(identity: dict[str, Any], key: str) -> str:
            return json.dumps(identity[key]) if key in identity else "(not recorded)"

        keys = [*self.identity, *(k for k in theirs if k not in self.identity)]
        differ = [
            f"  {k}: checkpoint {show(theirs, k)}, this job {show(self.identity, k)}"
            for k in keys
            if show(theirs, k) != show(self.identity, k)
        ]
        if differ:
            raise CheckpointMismatch(f"{where} belongs to another job:\n" + "\n".join(differ) + f"\n{todo}")

    def close(self) -> None:
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            with contextlib.suppress(Exception):  # (the save's failure is the one to report)
                self.manager.close()
            raise write_failure(self.where, None, e) from e
        self.manager.close()


# --- a run's start from a plain orbax checkpoint (checkpoint.init_from) ----------------------------


def _leaf_name(path: tuple) -> str:
    """A leaf's path as orbax stores it, `params/blocks/0/attn/qkv/kernel`: dict keys, sequence
    indices and named-tuple fields alike (orbax restores named tuples, optax's states, as dicts)."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def _leaves(tree: PyTree) -> dict[str, str]:
    """{leaf name: "dtype[shape]"} of arrays, abstract arrays or orbax's array metadata."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        dtype, shape = getattr(leaf, "dtype", None), getattr(leaf, "shape", None)
        out[_leaf_name(path)] = (
            f"{np.dtype(dtype) if dtype is not None else type(leaf).__name__}"
            f"[{','.join(map(str, shape)) if shape is not None else '?'}]"
        )
    return out


def _differences(want: dict[str, str], have: dict[str, str]) -> list[str]:
    """One line per leaf missing from `have`, extra in it, or of another dtype or shape."""
    rows = []
    for name in sorted(want.keys() | have.keys(), key=lambda n: (not n.startswith("params/"), n)):  # params first
        if name not in have:
            rows.append(f"  {name}: missing from the checkpoint (this model: {want[name]})")
        elif name not in want:
            rows.append(f"  {name}: in the checkpoint ({have[name]}), not in this model")
        elif want[name] != have[name]:
            rows.append(f"  {name}: checkpoint {have[name]}, this model {want[name]}")
    return rows


def _as_checkpoint_floats(params: PyTree, have: dict[str, str]) -> PyTree:
    """`params` (abstract) with each float leaf's dtype the checkpoint's where that is another float
    of the same shape (`have`: `_leaves` of {"params": the checkpoint's}): such a leaf is restored as
    stored (a bfloat16 checkpoint reads half the bytes) and cast on the device afterwards."""

    def one(path, a):
        found = have.get(_leaf_name(("params", *path)))
        if found is None or not jnp.issubdtype(a.dtype, jnp.floating):
            return a
        dtype, shape = found.split("[", 1)
        if shape != f"{','.join(map(str, a.shape))}]" or not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
            return a
        return jax.ShapeDtypeStruct(a.shape, jnp.dtype(dtype), sharding=a.sharding)

    return jax.tree_util.tree_map_with_path(one, params)


def _check_rope(path: Path, model: ModelConfig | None, where: str) -> None:
    """A checkpoint of `ftjax convert hf` records the model settings it was converted with: a
    config whose RoPE (theta, scaling, head size) differs would load the same weights as another
    model, silently; InitCheckpointError names each setting that differs."""
    from ftjax.program.convert import META

    meta = path / META
    if model is None or not meta.is_file():
        return
    recorded = type(model)(**json.loads(meta.read_text())["model"])
    rows = [
        f"  model.{k}: checkpoint {getattr(recorded, k)}, this config {getattr(model, k)}"
        for k in ("rope_theta", "rope_scaling", "head_size", "norm_eps")
        if getattr(recorded, k) != getattr(model, k)
    ]
    if rows:
        raise InitCheckpointError(
            f"{where} was converted for another model ({META}); these settings differ:\n" + "\n".join(rows)
        )


def load_init(directory: str | Path, abstract_state: dict, *, opt: bool, model: ModelConfig | None = None) -> dict:
    """{"params": ...} (with `opt`, and "opt": ...) of the orbax checkpoint in `directory`, placed
    with `abstract_state`'s shardings.

    `directory` was written by `orbax.checkpoint.StandardCheckpointer().save(directory, tree)`, `tree`
    the parameter tree itself or a dict holding it under "params" (and the optimizer state under
    "opt"): an ftjax run's RUN/checkpoints/STEP/state is one (its other entries are not read). The
    checkpoint's metadata is compared with this model's trees before any array is read:
    InitCheckpointError names every leaf missing, extra, or of another shape or dtype. A parameter
    stored in another float dtype (bfloat16, as released weights ship) is read as stored and cast to
    this model's on the device. `model` (a ModelConfig) is checked against the settings a converted
    checkpoint records (`_check_rope`)."""
    where = f"checkpoint.init_from {directory}"
    path = Path(directory).absolute()
    if not path.is_dir():
        raise InitCheckpointError(f"{where}: not a directory")
    _check_rope(path, model, where)
    checkpointer = ocp.PyTreeCheckpointer()  # (reads what StandardCheckpointer wrote; restores part of it)
    found = checkpointer.metadata(path).item_metadata  # shapes and dtypes: no array is read
    if found is None:
        raise InitCheckpointError(
            f"{where}: holds no orbax pytree checkpoint (write one with orbax.checkpoint."
            "StandardCheckpointer().save(DIR, params); of an ftjax run, give "
            "RUN/checkpoints/STEP/state)"
        )
    tree = found.tree
    params = abstract_state["params"]
    # a dict holding "params" is the wrapped form, unless this model's own parameters have that key
    wrapped = isinstance(tree, dict) and "params" in tree and not (isinstance(params, dict) and "params" in params)
    have = tree if wrapped else {"params": tree}
    if opt and "opt" not in have:
        raise InitCheckpointError(
            f"{where}: checkpoint.init_opt asks for its optimizer state, but it holds none "
            "(save {'params': params, 'opt': opt_state} for both)"
        )
    # (a Llama's parameters in the other layout of model.scan_layers: restored in theirs, converted)
    target, convert = _other_layout(have["params"], params) or (None, None)
    want = {"params": params, **({"opt": abstract_state["opt"]} if opt else {})}
    if target is not None:  # (the optimizer's moments are parameter-shaped trees: converted alike)
        want = {k: _each_layers_tree(tree, target) for k, tree in want.items()}
    want["params"] = _as_checkpoint_floats(want["params"], _leaves({"params": have["params"]}))
    rows = _differences(_leaves(want), _leaves({k: have[k] for k in want}))
    if rows:
        raise InitCheckpointError(
            f"{where} is not a checkpoint of this model: {len(rows)} leaves differ "
            "(the model config, task or optimizer differs?):\n" + "\n".join(rows)
        )
    step_dir = path.parent
    if step_dir.name.isdigit() and (step_dir / CHECKSUMS).is_file():  # an ftjax run's step: check its seal
        verify(step_dir, int(step_dir.name))
    item = want if wrapped else want["params"]
    restored = checkpointer.restore(
        path,
        args=ocp.args.PyTreeRestore(
            item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=wrapped
        ),
    )  # (what else it holds, a step counter, an unwanted "opt", is not read)
    loaded = dict(restored) if wrapped else {"params": restored}
    return _placed(loaded, abstract_state, convert)


def _placed(loaded: dict, abstract_state: dict, convert: Callable | None) -> dict:
    """`loaded` as this model's: each tree in its layout of scan_layers (`convert`) and its leaves'
    dtypes (a checkpoint's other float), converted where the arrays are, placed as `abstract_state`."""
    for k in loaded:
        ours = jax.tree.leaves(abstract_state[k])
        if convert is None and all(x.dtype == a.dtype for x, a in zip(jax.tree.leaves(loaded[k]), ours)):
            continue
        shardings = jax.tree.map(lambda a: a.sharding, abstract_state[k])
        dtypes = jax.tree.map(lambda a: a.dtype, abstract_state[k])
        relaid = (lambda t: _each_layers_tree(t, convert)) if convert is not None else (lambda t: t)
        cast = lambda t, dtypes=dtypes, relaid=relaid: jax.tree.map(lambda y, d: y.astype(d), relaid(t), dtypes)
        loaded[k] = jax.jit(cast, out_shardings=shardings)(loaded[k])
    return loaded


def _each_layers_tree(tree: PyTree, fn: Callable[[dict], dict]) -> PyTree:
    """`tree` with `fn` applied to each dict in it that holds a Llama's blocks (a `blocks` or
    `layers` key): the parameters, and each parameter-shaped tree of an optimizer state (optax's
    states are named tuples of them); every other leaf as it is."""

    def holds_blocks(x) -> bool:
        return isinstance(x, dict) and ("blocks" in x or "layers" in x)

    return jax.tree.map(lambda x: fn(x) if holds_blocks(x) else x, tree, is_leaf=holds_blocks)


def _other_layout(have: PyTree, params: PyTree) -> tuple[Callable, Callable] | None:
    """Where the checkpoint holds a Llama's blocks in the other layout of `model.scan_layers` than
    this model (stacked, `layers/...`, in one; `blocks/<i>/...` in the other): (what an abstract
    tree of this model's layout is to restore in the checkpoint's, each leaf placed as this model's
    slice or stack of it will be; the conversion to this model's layout: the same numbers,
    ftjax/program/models/llama.py). None where the layouts agree (or it is no such model)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ftjax.program.models.llama import stacked_layers, unstacked_layers

    if not (isinstance(have, dict) and isinstance(params, dict)):
        return None

    def placed(a, shape, spec):
        sharding = a.sharding
        if isinstance(sharding, NamedSharding):
            sharding = NamedSharding(sharding.mesh, P(*spec(tuple(sharding.spec))))
        return jax.ShapeDtypeStruct(shape, a.dtype, sharding=sharding)

    def rest(tree):
        return {k: v for k, v in tree.items() if k not in ("blocks", "layers")}

    if "layers" in params and "blocks" in have and "blocks" not in params:
        n = len(have["blocks"])

        def unstacked(tree):
            layer = jax.tree.map(lambda a: placed(a, a.shape[1:], lambda s: s[1:]), tree["layers"])
            return {**rest(tree), "blocks": dict.fromkeys(range(n), layer)}

        return unstacked, stacked_layers
    if "blocks" in params and "layers" in have and "layers" not in params:

        def stacked(tree):
            n, first = len(tree["blocks"]), tree["blocks"][0]
            return {
                **rest(tree),
                "layers": jax.tree.map(lambda a: placed(a, (n, *a.shape), lambda s: (None, *s)), first),
            }

        return stacked, unstacked_layers
    return None
