"""ftjax: fault-tolerant hybrid-sharded data parallel training for JAX.

Each data-parallel replica is the unit of failure: a replica that dies is dropped from the
gradient average, the others keep going, and the dead one catches up from a live peer.
See docs/design/index.md for the design: processes, the step protocol, invariants and decisions.

The Python API (docs/design/index.md, "The API"; README, "Bring your own model"):

- `Task`, built by `nnx_task`, `linen_task` or `pytree_task`: what a replica trains;
- `fit(task, config)`: train it, standalone or as one replica of a job;
- `FaultTolerance`: the step protocol for a script that owns its training loop (`Finished`, `Left`:
  how its loop ends; `BatchStream`: a source's batches of each step, the ones ftjax trains);
- `load_config`, `Config`: the run configuration (YAML + overrides, validated);
- `constrain_rows(x)`: in a model, an activation split by rows like the batch (docs/design/model.md, "Rows");
- `TokenWindows(dir, split, window)`: a task's source of windows of token files (`ftjax data
  prepare`), `TokenFileError` what it raises; `Windows`, `stdlib_corpus()`: windows of a token array,
  and the toy corpus of Python's own sources (the examples' data).

Names are imported on first use, so that `ftjax coordinator` and `ftjax launch` never import JAX.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "Task": "ftjax.program.task",
    "TaskError": "ftjax.program.task",
    "nnx_task": "ftjax.program.task",
    "linen_task": "ftjax.program.task",
    "pytree_task": "ftjax.program.task",
    "fit": "ftjax.api",
    "FitResult": "ftjax.api",
    "FaultTolerance": "ftjax.runtime.script",
    "StepInfo": "ftjax.runtime.manager",
    "RunArgs": "ftjax.runtime.args",
    "Finished": "ftjax.runtime.manager",
    "Left": "ftjax.runtime.manager",
    "BatchStream": "ftjax.program.data",
    "Config": "ftjax.config",
    "ConfigError": "ftjax.config",
    "load_config": "ftjax.config",
    "constrain_rows": "ftjax.program.sharding",
    "TokenWindows": "ftjax.program.tokens",
    "TokenFileError": "ftjax.program.tokens",
    "Windows": "ftjax.program.data",
    "stdlib_corpus": "ftjax.program.data",
}

__all__ = [
    "BatchStream",
    "Config",
    "ConfigError",
    "FaultTolerance",
    "Finished",
    "FitResult",
    "Left",
    "RunArgs",
    "StepInfo",
    "Task",
    "TaskError",
    "TokenFileError",
    "TokenWindows",
    "Windows",
    "constrain_rows",
    "fit",
    "linen_task",
    "load_config",
    "nnx_task",
    "pytree_task",
    "stdlib_corpus",
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ftjax' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
