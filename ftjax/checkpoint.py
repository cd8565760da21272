"""Durable checkpoints with orbax's CheckpointManager: async, every N steps, keep K.

A checkpoint holds the train state (restored into the current mesh's shardings, so a job may come
back on another device count) and a small JSON record: the step and the replica's data stream
position, which make `--resume` continue the exact batch sequence.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp


class DurableCheckpoints:
    def __init__(self, directory: str | Path, *, every: int, keep: int, async_save: bool = True):
        self.every = every
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, save_interval_steps=max(every, 1), enable_async_checkpointing=async_save,
            create=True,
        )
        self.manager = ocp.CheckpointManager(Path(directory).absolute(), options=options)

    @classmethod
    def from_config(cls, cfg, run_dir: str | Path) -> "DurableCheckpoints":
        """The checkpoints a run's config asks for (`checkpoint:` section; default dir RUN/checkpoints)."""
        c = cfg.checkpoint
        return cls(c.dir or Path(run_dir) / "checkpoints", every=c.every, keep=c.keep, async_save=c.async_save)

    def maybe_save(self, step: int, state: dict, meta: dict[str, Any], *, force: bool = False) -> bool:
        """Save at multiples of `every` (or when forced). Returns whether a save started."""
        if not force and (self.every <= 0 or step % self.every):
            return False
        if step == self.latest_step():  # already saved (a forced final save after a periodic one)
            return False
        return bool(self.manager.save(
            step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
            force=force,
        ))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore(self, abstract_state: dict, step: int | None = None) -> tuple[dict, dict]:
        """(state, meta) of `step` (default: latest), placed with `abstract_state`'s shardings."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.manager.directory}")
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
        return out["state"], dict(out["meta"])

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
