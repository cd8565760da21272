"""Device <-> host copy rates of one gradient-sized buffer (56 MB: gpt_small's fp32 gradient) on
the first accelerator, the way ftjax's gradient path copies today (np.asarray, jax.device_put of a
numpy array: pageable memory) against JAX's page-locked host memory kind (`pinned_host`). Prints
one JSON line. Run where a GPU is: `python3 scripts/gpu_transfer_probe.py`."""

import json
import time

import jax
import jax.numpy as jnp
import numpy as np

d = jax.devices()[0]
n = 14_000_000  # gpt_small's fp32 gradient: 56 MB
x = jnp.ones((n,), jnp.float32) + 0
x.block_until_ready()
h = np.ones((n,), np.float32)


def t(f, reps=10):
    f()
    ts = []
    for _ in range(reps):
        a = time.perf_counter()
        f()
        ts.append(time.perf_counter() - a)
    return min(ts)


out = {"bytes": n * 4}
out["d2h_np_asarray_gbs"] = n * 4 / t(lambda: np.asarray(x + 0)) / 1e9  # includes a tiny add
out["d2h_copy_to_host_gbs"] = n * 4 / t(lambda: (lambda y: (y.block_until_ready(), np.asarray(y)))(x * 1)) / 1e9
out["h2d_device_put_gbs"] = n * 4 / t(lambda: jax.device_put(h, d).block_until_ready()) / 1e9
try:
    s_pinned = jax.sharding.SingleDeviceSharding(d, memory_kind="pinned_host")
    s_dev = jax.sharding.SingleDeviceSharding(d, memory_kind="device")
    out["memory_kinds"] = [m.kind for m in d.addressable_memories()]
    out["d2pinned_gbs"] = n * 4 / t(lambda: jax.device_put(x, s_pinned).block_until_ready()) / 1e9
    p = jax.device_put(x, s_pinned)
    p.block_until_ready()
    out["pinned2d_gbs"] = n * 4 / t(lambda: jax.device_put(p, s_dev).block_until_ready()) / 1e9
    out["pinned_np_view_gbs"] = n * 4 / t(lambda: np.asarray(p)) / 1e9
except Exception as e:
    out["pinned_error"] = repr(e)[:300]
print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}))
