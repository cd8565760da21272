"""JAX's persistent compilation cache for every process of a replica of several processes on CPU.

JAX writes cache entries from process 0 only, so that the processes of one job do not race on the
same file of a shared directory: on GPU their keys are equal (JAX leaves the device assignment out
of the key there), and process 0's entry serves them all. On CPU they are not: the key hashes each
process's own compile options and devices, so process k > 0 looks up entries that no process ever
writes, and every start of it compiles every program again. Measured on this machine (a 2-host tiny
replica, a warm cache): process 0 loads its programs in under a second, process 1 compiled for ~15 s
at every start, several times that on a loaded machine, which is most of what a multi-host replica's
restart waits for. Here each process of such a replica writes its own entries: their keys differ, so
no two processes of a replica write one file (process 1 of two replicas on one machine may, as
process 0 of two replicas already may under JAX's own rule; JAX skips a key whose file exists).

This wraps one private function of JAX (`jax._src.compiler._cache_write`); where a JAX version
no longer has it, or calls it with other arguments, nothing is wrapped and process k > 0 only
compiles as it did before (the results are the same bits either way: same program, same options).
"""

from __future__ import annotations

import inspect
import warnings

_PARAMETERS = ("cache_key", "compile_time_secs", "module_name", "backend", "executable", "host_callbacks")


def write_from_every_process() -> bool:
    """Let a process other than JAX's process 0 write its own CPU executables to the persistent
    cache. Idempotent; returns whether the writer is in place."""
    try:
        from jax._src import compilation_cache, compiler, config, distributed
    except ImportError:
        return False
    original = getattr(compiler, "_cache_write", None)
    if getattr(original, "_ftjax_every_process", False):
        return True
    if (
        original is None
        or not hasattr(compilation_cache, "put_executable_and_time")
        or tuple(inspect.signature(original).parameters) != _PARAMETERS
    ):
        return False

    def _cache_write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks):
        if distributed.global_state.process_id == 0 or host_callbacks or backend.platform != "cpu":
            # process 0, a program with host callbacks (baked into its HLO: JAX never caches
            # those) and the other platforms (on GPU every process shares a key): JAX's own rule.
            return original(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks)
        if compile_time_secs < config.persistent_cache_min_compile_time_secs.value:
            return None
        try:
            compilation_cache.put_executable_and_time(
                cache_key, module_name, executable, backend, int(compile_time_secs)
            )
        except Exception as e:  # a cache that cannot be written costs a compile, never the run
            warnings.warn(
                f"could not write the compilation cache entry of {module_name!r}: {type(e).__name__}: {e}", stacklevel=2
            )
        return None

    _cache_write._ftjax_every_process = True  # type: ignore[attr-defined]  # (a function attribute: the mark)
    compiler._cache_write = _cache_write
    return True
