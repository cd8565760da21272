"""The `ftjax` command. Each subcommand lives in the module named for what it does; this file only
dispatches, so that `ftjax coordinator` never imports JAX and `ftjax train` sets its devices before
JAX is imported."""

from __future__ import annotations

import importlib
import sys

# subcommand -> ("module:function", one-line help). Each function takes argv (list[str]) and returns
# an exit code.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("ftjax.cli.train:main", "train one replica (standalone, or as a member of a job)"),
    "coordinator": ("ftjax.cli.coordinator:main", "run the job's coordinator (gRPC quorum service + HTTP status)"),
    "launch": ("ftjax.launch:main", "run a fault-tolerant job on this machine (coordinator + replicas)"),
    "bench": ("ftjax.cli.bench:main", "benchmarks; each prints one JSON line"),
    "simulate": ("ftjax.sim.cli:main", "discrete-event goodput model of fault-tolerant training at scale"),
    "demo": ("ftjax.cli.demo:main", "the flagship demo (what `make demo` runs)"),
    "data": ("ftjax.cli.prepare:main", "token files: `ftjax data prepare` tokenizes a corpus once (train, heldout)"),
    "check": ("ftjax.cli.check:main", "load a config's task and trace its loss on its first examples"),
    "convert": ("ftjax.cli.convert:main", "Hugging Face Llama checkpoints in (`convert hf`) and out (`convert to-hf`)"),
    "generate": ("ftjax.cli.generate:main", "what a Llama checkpoint writes after a prompt (greedy or sampled)"),
    "plan": ("ftjax.cli.plan:main", "a config's memory per device and FLOPs per token; whether it fits a device"),
}


def version() -> str:
    """This package's version: from the installed distribution's metadata, else ftjax.__version__
    (a source checkout on PYTHONPATH)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("ftjax")
    except PackageNotFoundError:
        from ftjax import __version__

        return __version__


def _usage() -> str:
    lines = ["usage: ftjax COMMAND [ARGS...]", "       ftjax --version", "", "commands:"]
    lines += [f"  {name:<12} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += [f"  {'version':<12} print `ftjax VERSION`"]
    lines += ["", "Run `ftjax COMMAND --help` for a command's options."]
    return "\n".join(lines)


def resolve(target: str):
    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name in ("--version", "version"):
        print(f"ftjax {version()}")
        return 0
    if name not in COMMANDS:
        print(f"ftjax: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    code = resolve(COMMANDS[name][0])(rest)
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
