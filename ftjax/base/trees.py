"""The one name for a JAX pytree in annotations (issue 57).

A pytree is any nesting of lists, tuples, dicts, None and registered nodes (flax's State, optax's
states) around leaves (arrays, scalars): a recursive union that neither JAX nor Python's type system
spells statically, so the alias is `Any` to the checker. Naming it still says what a value is (a tree
of arrays, not "anything") and keeps the `Any` annotations for values that truly are anything.
"""

from __future__ import annotations

from typing import Any, TypeAlias

PyTree: TypeAlias = Any
