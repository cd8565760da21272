"""The updates a healing replica receives while its snapshot is in flight, kept for the replay.

A newcomer takes part in FTAR with zero gradients and keeps every averaged update it receives from
the step its catch-up began; once the snapshot (of some step s) is installed it replays the updates
of steps s, s+1, ... and is bitwise in step with the job (docs/design/recovery.md, "Catch-up").

A catch-up may take any number of steps: a slow link, a source killed mid-transfer, a second source
whose snapshot arrives as late as the first. So the buffer never drops an update. Its RAM is bounded
in bytes (`ram_bytes`): past that, the oldest updates are written to local disk, one `.npy` file a
step, and read back one at a time during the replay. An earlier design kept a fixed number of steps
in RAM and evicted the oldest; a transfer longer than that could never complete, because every
snapshot it fetched was already older than the oldest update kept.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np


class SpillError(OSError):
    """The replay buffer could not write a spilled update to local disk (the message says where)."""


class ReplayBuffer:
    def __init__(self, spill_dir: str | Path, ram_bytes: int):
        self.spill_dir = Path(spill_dir)
        self.ram_bytes = int(ram_bytes)
        self._ram: dict[int, np.ndarray] = {}
        self._on_disk: set[int] = set()
        self._scale: dict[int, float] = {}
        self._ram_used = 0
        self.spilled_bytes = 0  # written to disk since the last clear (reported with the catch-up)
        self.update_bytes = 0  # the size of one update (the last one kept)

    def __contains__(self, step: int) -> bool:
        return step in self._scale

    def __len__(self) -> int:
        return len(self._scale)

    @property
    def ram_used(self) -> int:
        return self._ram_used

    def put(self, step: int, update: np.ndarray, scale: float) -> None:
        """Keep the averaged update of `step` (and its lr scale) until the replay. A step held
        already is replaced: the job retried it (nobody committed the first attempt), and only the
        update of the attempt that was committed may be replayed."""
        self._forget(step)
        self.update_bytes = update.nbytes
        self._ram[step] = update
        self._scale[step] = float(scale)
        self._ram_used += update.nbytes
        while self._ram_used > self.ram_bytes and self._ram:
            self._spill(min(self._ram))

    def _spill(self, step: int) -> None:
        # The oldest first: they are replayed first, and the newest stay hot in RAM.
        update = self._ram.pop(step)
        try:
            self.spill_dir.mkdir(parents=True, exist_ok=True)
            np.save(self._path(step), update, allow_pickle=False)
        except OSError as e:  # a full or read-only disk: say where, and which setting spills there
            self._path(step).unlink(missing_ok=True)
            raise SpillError(
                f"replay buffer: cannot spill the update of step {step} ({update.nbytes:,} bytes) to "
                f"{self.spill_dir}: {e}. The updates a healing replica keeps beyond ft.catchup_buffer_mib "
                f"({self.ram_bytes / 2**20:g} MiB of RAM) go to that directory: free space there, give the "
                f"run another --out on a larger disk, or raise ft.catchup_buffer_mib"
            ) from None
        self._on_disk.add(step)
        self._ram_used -= update.nbytes
        self.spilled_bytes += update.nbytes

    def _forget(self, step: int) -> None:
        if step in self._ram:
            self._ram_used -= self._ram.pop(step).nbytes
        if step in self._on_disk:
            self._on_disk.discard(step)
            self._path(step).unlink(missing_ok=True)
        self._scale.pop(step, None)

    def get(self, step: int) -> tuple[np.ndarray, float]:
        """The update of `step` and its lr scale (read back from disk if it was spilled)."""
        if step in self._ram:
            return self._ram[step], self._scale[step]
        if step in self._on_disk:
            return np.load(self._path(step), allow_pickle=False), self._scale[step]
        raise KeyError(f"replay buffer: no update of step {step}")

    def first_missing(self, current: int) -> int:
        """The oldest step from which `current` can be reached by replaying held updates: a
        snapshot older than this cannot be brought up to date."""
        s = current
        while s - 1 in self._scale:
            s -= 1
        return s

    def clear(self) -> None:
        self._ram.clear()
        self._on_disk.clear()
        self._scale.clear()
        self._ram_used = 0
        self.spilled_bytes = 0
        shutil.rmtree(self.spill_dir, ignore_errors=True)

    def _path(self, step: int) -> Path:
        return self.spill_dir / f"update-{step}.npy"
