"""Child processes that never outlive their owner.

Used by the launcher and by every multi-process test: each child gets a thread-limited environment,
is tracked, and is SIGKILLed (with its own children: each child leads a process group) when the
group is closed, on normal exit, on an exception, and at interpreter exit. None of that runs when
the owner is SIGKILLed, so on Linux each child also asks the kernel for SIGKILL when its parent dies
(`prctl(PR_SET_PDEATHSIG)`): a SIGKILLed launcher takes its coordinator and replicas with it.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Collection, Mapping, Sequence

from ftjax.base.env import limited_env

_LIVE_GROUPS: weakref.WeakSet[ProcessGroup] = weakref.WeakSet()
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None  # loaded before any fork


def _child_setup(parent: int | None, cpus: Collection[int] | None):
    """The `preexec_fn` of a child (None: nothing to do): SIGKILL it when `parent` dies (None: don't),
    pin it to `cpus` (None: any core)."""
    if parent is None and cpus is None:
        return None

    def setup() -> None:
        if parent is not None:
            _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # type: ignore[union-attr]
            if os.getppid() != parent:  # the parent died before the prctl: the signal will never come
                os._exit(1)
        if cpus is not None:
            os.sched_setaffinity(0, cpus)

    return setup


def _death_parent() -> int | None:
    """This process's pid when its children should die with it, else None. The kernel sends the
    signal when the *thread* that forked exits, not the process: only children started from the main
    thread (which lives as long as the process) get it, or a helper thread's end would kill them. The
    signal survives exec (the virtual cluster's `ip netns exec` and `unshare` wrappers exec) but not a
    set-user-ID binary: none is in the launcher's chain."""
    if _LIBC is None or threading.current_thread() is not threading.main_thread():
        return None
    return os.getpid()


def free_port() -> int:
    """A port the OS considers free now (for processes that cannot report a port they bound to 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProcessGroup:
    """Starts and owns child processes; ``close()`` (or leaving the ``with`` block) kills them all."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self._on_close: list = []
        _LIVE_GROUPS.add(self)

    def on_close(self, callback) -> None:
        """Run `callback()` after the children are killed (cleanup of what they leave behind)."""
        self._on_close.append(callback)

    def start(
        self,
        args: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        device_count: int | None = None,
        stdin=None,
        stdout=None,
        stderr=None,
        cwd: str | None = None,
        text: bool = False,
        cpus: Collection[int] | None = None,
    ) -> subprocess.Popen:
        """`cpus`: the cores the child (and every thread it starts) may run on; None: any."""
        child_env = limited_env(device_count=device_count)
        if env:
            child_env.update(env)
        proc = subprocess.Popen(
            list(args),
            env=child_env,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            cwd=cwd,
            text=text,
            start_new_session=True,  # its own process group: kill() reaches its children too
            preexec_fn=_child_setup(_death_parent(), cpus),
        )
        self.procs.append(proc)
        return proc

    def python(self, *args: str, **kw) -> subprocess.Popen:
        """Start ``python -m`` style children with this interpreter."""
        return self.start([sys.executable, *args], **kw)

    @staticmethod
    def kill(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            try:
                proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def close(self, timeout: float = 5.0) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                self.kill(proc, signal.SIGCONT)  # a SIGSTOPped child must be able to die
                self.kill(proc, signal.SIGKILL)
            else:
                # the leader exited; its group may still hold children
                self.kill(proc, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()
        callbacks, self._on_close = self._on_close, []
        for callback in callbacks:
            callback()

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@atexit.register
def _close_all() -> None:
    for group in list(_LIVE_GROUPS):
        group.close(timeout=2.0)
