"""Durable checkpoints with orbax's CheckpointManager: async, every N steps, keep K.

A checkpoint holds the train state (restored into the current mesh's shardings, so a job may come
back on another device count) and a small JSON record: the step and the replica's data stream
position, which make `--resume` continue the exact batch sequence, and the identity of the job that
wrote it (:func:`job_identity`). A checkpoint is restored only into the same job: another one's (an
earlier run in the same directory with another seed, corpus, model or optimizer) raises
:class:`CheckpointMismatch` instead of being trained on silently.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp


class CheckpointMismatch(ValueError):
    """The checkpoint was written by another job (or by one that did not record its identity)."""


def job_identity(cfg, data_fingerprint: str) -> dict[str, Any]:
    """What makes a checkpoint this job's: every setting that changes the numbers of the run, as a
    flat {"section.field": value} record (JSON scalars, so that it survives the meta's round trip).

    In: `seed` (initial parameters and the data shuffle); the data (`data.source`, the corpus's
    content fingerprint `data.fingerprint`, `data.batch_size`, and `ft.replicas`, which splits the
    stream among replicas: the stream position of a checkpoint means other batches under another
    split); the whole `model` section (the architecture; a shape change would otherwise surface as an
    orbax shape error); the whole `optim` section (learning rate and its schedule, AdamW, clipping)
    and `ft.lr_scaling`. Whole sections, so that a field added to them later is checked by default.

    Out, because the same job may change them between restarts: `steps` (a run may be extended; with
    no `optim.decay_steps` the cosine decay then stretches from the resume on, which is what extending
    means), the mesh (a checkpoint is resharded onto another device count), the checkpoint cadence
    and directory, logging, the coordinator and every fault-tolerance timeout or transport knob.
    """
    identity: dict[str, Any] = {
        "seed": cfg.seed,
        "data.source": cfg.data.source,
        "data.fingerprint": data_fingerprint,
        "data.batch_size": cfg.data.batch_size,
        "ft.replicas": cfg.ft.replicas,
        "ft.lr_scaling": cfg.ft.lr_scaling,
    }
    for section in ("model", "optim"):
        identity.update({f"{section}.{k}": v for k, v in getattr(cfg, section).model_dump().items()})
    return identity


class DurableCheckpoints:
    """`identity` (see :func:`job_identity`) is saved in every checkpoint's meta and checked by
    `restore`; without one, nothing is saved or checked (a reader that only inspects checkpoints)."""

    def __init__(self, directory: str | Path, *, every: int, keep: int, async_save: bool = True,
                 identity: dict[str, Any] | None = None):
        self.every = every
        self.identity = identity
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, save_interval_steps=max(every, 1), enable_async_checkpointing=async_save,
            create=True,
        )
        self.manager = ocp.CheckpointManager(Path(directory).absolute(), options=options)

    @classmethod
    def from_config(cls, cfg, run_dir: str | Path, *, data_fingerprint: str) -> "DurableCheckpoints":
        """The checkpoints a run's config asks for (`checkpoint:` section; default dir RUN/checkpoints),
        holding and accepting only this job's (`data_fingerprint`: the data stream's)."""
        c = cfg.checkpoint
        return cls(c.dir or Path(run_dir) / "checkpoints", every=c.every, keep=c.keep, async_save=c.async_save,
                   identity=job_identity(cfg, data_fingerprint))

    def maybe_save(self, step: int, state: dict, meta: dict[str, Any], *, force: bool = False) -> bool:
        """Save at multiples of `every` (or when forced). Returns whether a save started."""
        if not force and (self.every <= 0 or step % self.every):
            return False
        if step == self.latest_step():  # already saved (a forced final save after a periodic one)
            return False
        if self.identity is not None:
            meta = {**meta, "identity": self.identity}
        return bool(self.manager.save(
            step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
            force=force,
        ))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore(self, abstract_state: dict, step: int | None = None) -> tuple[dict, dict]:
        """(state, meta) of `step` (default: latest), placed with `abstract_state`'s shardings.

        Raises CheckpointMismatch, before reading the state, if the checkpoint is not this job's."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.manager.directory}")
        if self.identity is not None:
            meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
            self._check(step, meta)
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
        return out["state"], dict(out["meta"])

    def _check(self, step: int, meta: dict[str, Any]) -> None:
        where = f"checkpoint {self.manager.directory} (step {step})"
        todo = (f"Give this job another checkpoint.dir or run directory (--out), or remove the old "
                f"checkpoints (rm -r {self.manager.directory}) to start it afresh.")
        theirs = meta.get("identity")
        if theirs is None:
            # Refused, not accepted with a warning: a directory of an older run is exactly the case
            # to catch, and a warning is what went unnoticed before (the stale-run finding).
            raise CheckpointMismatch(f"{where} has no job identity (written before ftjax recorded one): "
                                     f"nothing shows that it belongs to this job.\n{todo}")

        def show(identity: dict[str, Any], key: str) -> str:
            return json.dumps(identity[key]) if key in identity else "(not recorded)"

        keys = [*self.identity, *(k for k in theirs if k not in self.identity)]
        differ = [f"  {k}: checkpoint {show(theirs, k)}, this job {show(self.identity, k)}"
                  for k in keys if show(theirs, k) != show(self.identity, k)]
        if differ:
            raise CheckpointMismatch(f"{where} belongs to another job:\n" + "\n".join(differ) + f"\n{todo}")

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
