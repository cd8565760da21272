import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ftjax.flat import HostFlattener
from ftjax.sharding import replica_mesh


def test_roundtrip_sharded_and_replicated_leaves():
    mesh = replica_mesh(jax.devices()[:4])
    tree = {"a": jnp.arange(24.0).reshape(8, 3), "b": jnp.arange(5.0), "c": {"d": jnp.ones((4, 4))}}
    shard = {"a": NamedSharding(mesh, P("fsdp", None)), "b": NamedSharding(mesh, P()),
             "c": {"d": NamedSharding(mesh, P(None, "fsdp"))}}
    tree = jax.device_put(tree, shard)
    f = HostFlattener(tree, shard)
    assert f.size == 24 + 5 + 16  # the replicated leaf counted once
    flat = f.flatten(tree)
    back = f.unflatten(flat * 2)
    for x, y, s in zip(jax.tree.leaves(tree), jax.tree.leaves(back), jax.tree.leaves(shard)):
        np.testing.assert_array_equal(np.asarray(y), 2 * np.asarray(x))
        assert y.sharding == s
