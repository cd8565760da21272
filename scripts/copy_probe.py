"""Raw device <-> host copies of one buffer, the yardstick for the gradient path's d2h and h2d phases
(issue 30): pageable host memory (`np.asarray`, `jax.device_put`) and, where the platform has it,
JAX's pinned host memory kind. Prints one JSON line of GB/s (1e9 bytes per second, best of 5).

    python scripts/copy_probe.py [--mib 1024 | --bytes N]

(`--bytes`: the gradient path's own bytes per step, `grad_bytes` of `ftjax bench step`'s phases.)
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from ftjax_bench.common import best_time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--bytes", type=int, default=None, help="copy this many bytes instead (a multiple of 4)")
    args = ap.parse_args()
    n = args.mib * 2**18 if args.bytes is None else max(1, args.bytes // 4)  # float32 elements
    device = jax.devices()[0]
    x = (jnp.ones((n,), jnp.float32) + 0).block_until_ready()
    host = np.ones((n,), np.float32)
    out = {"device": device.device_kind, "bytes": n * 4}

    out["d2h_gbps"] = n * 4 / best_time(lambda: np.asarray(x + 0)) / 1e9  # (a fresh array: no cached host copy)
    out["d2h_async_gbps"] = n * 4 / best_time(lambda: (y := x * 1).copy_to_host_async() or np.asarray(y)) / 1e9
    out["h2d_gbps"] = n * 4 / best_time(lambda: jax.device_put(host, device).block_until_ready()) / 1e9
    try:
        out["memory_kinds"] = [m.kind for m in device.addressable_memories()]
        pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
        on_device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
        out["d2pinned_gbps"] = n * 4 / best_time(lambda: jax.device_put(x, pinned).block_until_ready()) / 1e9
        p = jax.device_put(x, pinned).block_until_ready()
        out["pinned2d_gbps"] = n * 4 / best_time(lambda: jax.device_put(p, on_device).block_until_ready()) / 1e9
    except Exception as exc:  # a platform without the memory kind (CPU)
        out["pinned_error"] = repr(exc)[:200]
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}))


if __name__ == "__main__":
    main()
