"""The progress watchdog: beats keep it quiet, waits on others are exempt, silence names the phase."""

import threading
import time

import pytest

from ftjax.runtime.watchdog import ProgressWatchdog


class Verdicts:
    def __init__(self):
        self.got: list[tuple[str, float]] = []
        self.fired = threading.Event()

    def __call__(self, phase: str, silent_s: float) -> None:
        self.got.append((phase, silent_s))
        self.fired.set()


def test_silence_past_the_deadline_names_the_phase_it_stopped_in():
    verdicts = Verdicts()
    dog = ProgressWatchdog(0.2, verdicts)
    try:
        time.sleep(0.5)  # not armed yet: a process that has not completed a step is starting
        assert not verdicts.got
        dog.arm()
        dog.beat("commit vote")
        assert verdicts.fired.wait(10)
        ((phase, silent),) = verdicts.got
        assert phase == "commit vote" and silent >= 0.2
    finally:
        dog.close()


def test_beats_and_waits_on_the_quorum_keep_it_quiet():
    verdicts = Verdicts()
    dog = ProgressWatchdog(0.3, verdicts)
    dog.arm()
    try:
        end = time.monotonic() + 1.0
        while time.monotonic() < end:  # a loop that moves on
            dog.beat("forward")
            time.sleep(0.02)
        with dog.exempt("quorum"):  # far longer than the deadline, but a wait on others
            time.sleep(1.0)
        dog.beat("ftar")
        assert not verdicts.got
        assert verdicts.fired.wait(10) and verdicts.got[0][0] == "ftar"  # and then silence again
    finally:
        dog.close()


def test_a_step_longer_than_the_deadline_allows_the_next_one_twice_its_time():
    """A large model on CPU, or a step that compiles again: a step of 0.5 s against a deadline of
    0.2 s lets the next one be silent up to 1 s; a fast step brings the deadline back."""
    verdicts = Verdicts()
    dog = ProgressWatchdog(0.2, verdicts)
    try:
        dog.arm(0.5)
        dog.beat("forward")
        time.sleep(0.6)  # past the deadline, within twice the previous step
        assert not verdicts.got
        dog.beat("ftar")
        dog.arm(0.01)  # a fast step: back to the deadline
        dog.beat("forward")
        assert verdicts.fired.wait(10) and verdicts.got[0][0] == "forward"
        assert verdicts.got[0][1] < 0.9
    finally:
        dog.close()


def test_close_stops_it_and_a_bad_deadline_is_refused():
    verdicts = Verdicts()
    dog = ProgressWatchdog(0.2, verdicts)
    dog.arm()
    dog.close()
    assert not verdicts.fired.wait(0.5)
    with pytest.raises(ValueError, match="deadline_s"):
        ProgressWatchdog(0, verdicts)
