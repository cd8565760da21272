  DIST="$(node_address "${NODES[${ON[0]}]}"):$(free_port)"  # a new jax.distributed service each attempt
