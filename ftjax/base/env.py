"""Process environment: what must be fixed before JAX is imported, and the job token.

Two kinds of process, set up differently:

- a **run** (`ftjax train` as a user starts it, or a cluster's job files): `configure_run` takes
  the platform from the config (`platform: auto|cpu|gpu|tpu`). Only `platform: cpu` sets
  `JAX_PLATFORMS=cpu` and simulates `mesh.devices_per_host` CPU devices; auto leaves the choice to
  JAX. Nothing limits threads.
- a **simulated job on this machine** (tests, `ftjax launch`, `ftjax demo`, the benchmarks), which
  asks for it explicitly: `limited_env` / `configure_process` give CPU, simulated devices and a
  single XLA/BLAS thread per process, since many JAX processes share two cores there and
  timing-based checks (stall bounds, failure detection) must not flake from oversubscription.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

_THREAD_VARS = (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "TF_NUM_INTEROP_THREADS",
    "TF_NUM_INTRAOP_THREADS",
)
_SINGLE_THREAD_XLA = ("--xla_cpu_multi_thread_eigen=false",)


def _merge_xla_flags(flags: str, device_count: int | None, *, single_thread: bool) -> str:
    # Only `--flag=value` tokens: XLA stops parsing at the first token that is not one, silently
    # dropping every flag after it (a stray token once cost a multi-process replica its devices).
    parts = [p for p in flags.split() if p.startswith("--")]
    if device_count is not None:
        parts = [p for p in parts if not p.startswith("--xla_force_host_platform_device_count")]
        parts.insert(0, f"--xla_force_host_platform_device_count={device_count}")
    for flag in _SINGLE_THREAD_XLA if single_thread else ():
        if not any(p.split("=")[0] == flag.split("=")[0] for p in parts):
            parts.append(flag)
    return " ".join(parts)


def _common(env: dict[str, str]) -> dict[str, str]:
    """What every ftjax process gets: the shared compilation cache, quiet logs, unbuffered output."""
    # A persistent XLA compilation cache shared by every process of every job on this machine:
    # a restarted replica (and each test's fresh processes) loads its executables instead of
    # recompiling them, which is most of a JAX process's start-up. Same HLO, same executable, so
    # results are bitwise unchanged. Set JAX_COMPILATION_CACHE_DIR= (empty) to turn it off.
    env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "ftjax", "xla"))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def limited_env(base: Mapping[str, str] | None = None, *, device_count: int | None = None) -> dict[str, str]:
    """A copy of ``base`` (default: os.environ) for a process of a simulated job on this machine:
    CPU, ``device_count`` simulated devices, one compute thread, quiet logs."""
    env = dict(os.environ if base is None else base)
    for var in _THREAD_VARS:
        env.setdefault(var, "1")
    env["XLA_FLAGS"] = _merge_xla_flags(env.get("XLA_FLAGS", ""), device_count, single_thread=True)
    env.setdefault("JAX_PLATFORMS", "cpu")
    return _common(env)


def run_env(
    base: Mapping[str, str] | None = None, *, platform: str = "auto", device_count: int | None = None
) -> dict[str, str]:
    """A copy of ``base`` (default: os.environ) for a run on `platform` (the config's): CPU and
    ``device_count`` simulated devices only for "cpu"; for "auto", "gpu" and "tpu" the platform is
    what JAX finds (`check_platform` refuses the wrong one) and no device is simulated."""
    env = dict(os.environ if base is None else base)
    if platform == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = _merge_xla_flags(env.get("XLA_FLAGS", ""), device_count, single_thread=False)
    elif platform in ("gpu", "tpu") and env.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        env.pop("JAX_PLATFORMS")  # a leftover from a CPU setup would hide the accelerator asked for
    return _common(env)


def _check_not_imported(device_count: int | None) -> None:
    import sys

    if "jax" in sys.modules and device_count is not None and _current_device_flag() != device_count:
        raise RuntimeError(
            "simulated CPU devices must be set before the first `import jax`; "
            f"this process already imported JAX with device count {_current_device_flag()}"
        )


def configure_process(device_count: int | None = None) -> None:
    """Apply :func:`limited_env` to this process (a simulated job: tests, benchmarks). Must run
    before the first ``import jax``."""
    _check_not_imported(device_count)
    os.environ.update(limited_env(device_count=device_count))


def configure_run(platform: str, device_count: int | None = None) -> None:
    """Apply :func:`run_env` to this process (`ftjax train`). Must run before the first ``import jax``."""
    _check_not_imported(device_count if platform == "cpu" else None)
    env = run_env(platform=platform, device_count=device_count)
    for var in set(os.environ) - set(env):
        del os.environ[var]
    os.environ.update(env)


def check_platform(platform: str, devices_per_host: int) -> None:
    """After JAX started: RuntimeError naming the config keys if it runs on another platform than
    `platform` asks for, or has fewer devices in this process than `devices_per_host`."""
    import jax

    found = jax.default_backend()
    if platform in ("gpu", "tpu") and found != platform:
        raise RuntimeError(
            f"platform: {platform} was asked for, but JAX found {found} only "
            f"(JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '')!r}); install the {platform} "
            "plugin of jax, or set platform: auto or cpu"
        )
    local = jax.local_device_count()
    if local < devices_per_host:
        hint = (
            "CPU devices are simulated only when set before JAX starts: `ftjax train` does it for "
            "platform: cpu; a process of your own sets XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{devices_per_host} before it imports jax. Or lower mesh.devices_per_host"
            if found == "cpu"
            else "lower mesh.devices_per_host"
        )
        raise RuntimeError(
            f"mesh.devices_per_host={devices_per_host}, but this process has {local} {found} "
            f"device(s) (platform: {platform}); {hint}"
        )


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
