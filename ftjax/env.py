"""Process environment: what must be fixed before JAX is imported, and the job token.

Many JAX processes share two cores in tests and on the demo machine; each one is limited to a
single XLA/BLAS thread so that timing-based checks (stall bounds, failure detection) do not flake
from oversubscription. Simulated CPU devices are also an XLA flag, so they are set here too.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "TF_NUM_INTEROP_THREADS",
                "TF_NUM_INTRAOP_THREADS")
_SINGLE_THREAD_XLA = ("--xla_cpu_multi_thread_eigen=false",)


def _merge_xla_flags(flags: str, device_count: int | None) -> str:
    # Only `--flag=value` tokens: XLA stops parsing at the first token that is not one, silently
    # dropping every flag after it (a stray token once cost a multi-process replica its devices).
    parts = [p for p in flags.split() if p.startswith("--")]
    if device_count is not None:
        parts = [p for p in parts if not p.startswith("--xla_force_host_platform_device_count")]
        parts.insert(0, f"--xla_force_host_platform_device_count={device_count}")
    for flag in _SINGLE_THREAD_XLA:
        if not any(p.split("=")[0] == flag.split("=")[0] for p in parts):
            parts.append(flag)
    return " ".join(parts)


def limited_env(base: Mapping[str, str] | None = None, *, device_count: int | None = None) -> dict[str, str]:
    """A copy of ``base`` (default: os.environ) for a child process: one compute thread, quiet logs."""
    env = dict(os.environ if base is None else base)
    for var in _THREAD_VARS:
        env.setdefault(var, "1")
    env["XLA_FLAGS"] = _merge_xla_flags(env.get("XLA_FLAGS", ""), device_count)
    # A persistent XLA compilation cache shared by every process of every job on this machine:
    # a restarted replica (and each test's fresh processes) loads its executables instead of
    # recompiling them, which is most of a JAX process's start-up. Same HLO, same executable, so
    # results are bitwise unchanged. Set JAX_COMPILATION_CACHE_DIR= (empty) to turn it off.
    env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "ftjax", "xla"))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def configure_process(device_count: int | None = None) -> None:
    """Apply :func:`limited_env` to this process. Must run before the first ``import jax``."""
    import sys

    if "jax" in sys.modules and device_count is not None and _current_device_flag() != device_count:
        raise RuntimeError(
            "simulated CPU devices must be set before the first `import jax`; "
            f"this process already imported JAX with device count {_current_device_flag()}"
        )
    os.environ.update(limited_env(device_count=device_count))


def _current_device_flag() -> int | None:
    m = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    return int(m.group(1)) if m else None


# --- the job token ---------------------------------------------------------------------------------
TOKEN_ENV = "FTJAX_TOKEN"  # the job's shared secret, for every process of the job


def read_token(token_file: str | None = None) -> str:
    """The job token: the contents of `token_file` if given, else $FTJAX_TOKEN. ValueError (naming
    where it looked) if that is empty."""
    if token_file:
        with open(token_file, encoding="utf-8") as f:
            token = f.read().strip()
        if not token:
            raise ValueError(f"token file {token_file} is empty")
        return token
    token = os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        raise ValueError(f"no job token: ${TOKEN_ENV} is not set (and no token file was given)")
    return token
