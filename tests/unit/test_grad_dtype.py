"""ft.grad_dtype: bfloat16 (issue 28): the update crosses FTAR as bfloat16 and comes back float32,
rounded the way FTAR rounds, over a replica of 2 devices; a standalone replica rounds the same way;
float32 (the default) leaves every bit alone."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from fakes import participant, quorum
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ftjax.program.sharding import replica_mesh
from ftjax.runtime.lanes import LaneFlattener
from ftjax.runtime.reduce import FTARReducer, LocalReducer

BF16 = np.dtype(ml_dtypes.bfloat16)


class EchoEndpoint:
    """FTAR with one member: the average is the buffer; records what was sent."""

    def __init__(self):
        self.sent = []

    def allreduce(self, buf, out=None, ready=None, on_result=None, **_):
        if ready is not None:  # (the pipeline may still be filling buf)
            ready(0, buf.size)
        self.sent.append(buf.copy())
        out = buf.copy() if out is None else out
        out[...] = buf
        if on_result is not None:
            on_result(0, buf.size)
        return out


def _update():
    """A sharded and a replicated leaf whose values bfloat16 cannot hold (1 + 2^-10 rounds to 1)."""
    mesh = replica_mesh(jax.devices()[:2])
    specs = {"w": P("fsdp", None), "b": P()}
    shardings = {k: NamedSharding(mesh, s) for k, s in specs.items()}
    values = {"w": np.full((4, 3), 1 + 2**-10, np.float32), "b": np.arange(3, dtype=np.float32) / 3}
    return {k: jax.device_put(v, shardings[k]) for k, v in values.items()}, shardings


def _reducer(update, shardings, dtype):
    flat = LaneFlattener(update, shardings, lanes=1, devices_per_host=2, served=[0], dtype=dtype)
    return FTARReducer([EchoEndpoint()], flat)


def test_bfloat16_on_the_wire_float32_back_with_the_shardings_kept():
    update, shardings = _update()
    reducer = _reducer(update, shardings, BF16)
    q = quorum(1, 0, [participant("0")], "0")
    back = reducer.tree(reducer.average(q, update))
    (sent,) = reducer.endpoints[0].sent
    assert sent.dtype == BF16 and sent.size == 12 + 3
    for k in update:
        assert back[k].dtype == jnp.float32 and back[k].sharding == shardings[k]
        want = np.asarray(update[k]).astype(BF16).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(back[k]), want)
    assert np.all(np.asarray(back["w"]) == 1.0)  # rounded: the test can tell
    # a healing member relays zeros of the same dtype (FTAR refuses a call whose dtypes differ)
    healing = quorum(1, 0, [participant("0", healing=True)], "0", healing=True)
    reducer.average(healing, None)
    assert reducer.endpoints[0].sent[-1].dtype == BF16


def test_float32_leaves_every_bit_alone():
    update, shardings = _update()
    reducer = _reducer(update, shardings, np.float32)
    q = quorum(1, 0, [participant("0")], "0")
    back = reducer.tree(reducer.average(q, update))
    assert reducer.endpoints[0].sent[0].dtype == np.float32
    for k in update:
        np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(update[k]))
    assert LocalReducer().average(q, update) is update


def test_a_standalone_replica_rounds_like_ftar():
    update, _ = _update()
    q = quorum(1, 0, [participant("0")], "0")
    got = LocalReducer(None, BF16).average(q, update)
    np.testing.assert_array_equal(np.asarray(got["w"]), 1.0)
    # constant batch: the contribution rounded, divided in float32, the quotient rounded once
    got = LocalReducer(3, BF16).average(q, update)
    want = (np.asarray(update["b"]).astype(BF16).astype(np.float32) / 3).astype(BF16).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(got["b"]), want)
    assert got["b"].dtype == jnp.float32
