"""The healing replica's replay buffer: bounded RAM, spill to disk, nothing dropped."""

import numpy as np
import pytest

from ftjax.runtime.replay import ReplayBuffer, SpillError


def _update(step: int, n: int = 1000) -> np.ndarray:
    return np.arange(n, dtype=np.float32) * (step + 1)


def test_updates_beyond_the_ram_bound_spill_to_disk_and_come_back_bitwise(tmp_path):
    buf = ReplayBuffer(tmp_path / "spill", ram_bytes=3 * 4000)  # three updates of 4,000 bytes
    for step in range(10, 30):
        buf.put(step, _update(step), scale=0.5 + step)
        assert buf.ram_used <= 3 * 4000
    assert len(buf) == 20 and buf.spilled_bytes == 17 * 4000
    assert len(list((tmp_path / "spill").iterdir())) == 17  # the oldest went to disk, the newest stayed
    for step in range(10, 30):
        update, scale = buf.get(step)
        assert np.array_equal(update, _update(step)) and scale == 0.5 + step
    assert buf.first_missing(30) == 10 and buf.first_missing(12) == 10 and buf.first_missing(40) == 40
    buf.clear()
    assert len(buf) == 0 and buf.ram_used == 0 and not (tmp_path / "spill").exists()


def test_a_retried_step_replaces_the_update_held_for_it(tmp_path):
    buf = ReplayBuffer(tmp_path / "spill", ram_bytes=4000)
    buf.put(1, _update(1), 1.0)
    buf.put(2, _update(2), 1.0)  # step 1 spills
    buf.put(1, _update(7), 0.25)  # nobody committed the first attempt of step 1: the retry's update counts
    update, scale = buf.get(1)
    assert np.array_equal(update, _update(7)) and scale == 0.25
    assert len(buf) == 2 and buf.ram_used <= 4000


def test_zero_ram_keeps_everything_on_disk(tmp_path):
    buf = ReplayBuffer(tmp_path / "spill", ram_bytes=0)
    buf.put(5, _update(5), 1.0)
    assert buf.ram_used == 0 and 5 in buf and np.array_equal(buf.get(5)[0], _update(5))


def test_a_full_spill_disk_names_the_directory_and_the_setting(tmp_path):
    """Issue 26 item 9b: it was `OSError: 137216 requested and 123872 written`, nothing else."""
    buf = ReplayBuffer(tmp_path / "replay", ram_bytes=0)
    (tmp_path / "replay").mkdir()
    (tmp_path / "replay" / "update-3.npy").symlink_to("/dev/full")  # writes fail: no space left on device
    with pytest.raises(SpillError) as e:
        buf.put(3, np.ones(4096, np.float32), 1.0)
    msg = str(e.value)
    assert str(tmp_path / "replay") in msg and "ft.catchup_buffer_mib" in msg and "step 3" in msg, msg
    assert "No space left" in msg and "free space" in msg, msg
    assert isinstance(e.value, OSError) and not (tmp_path / "replay" / "update-3.npy").exists()
