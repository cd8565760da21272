"""ftjax: fault-tolerant hybrid-sharded data parallel training for JAX.

Each data-parallel replica is the unit of failure: a replica that dies is dropped from the
gradient average, the others keep going, and the dead one catches up from a live peer.
See docs/design.md for the design: processes, the step protocol, invariants and decisions.
"""

__version__ = "0.1.0"
