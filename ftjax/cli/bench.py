"""`ftjax bench NAME ...`: each benchmark compares two things measured in the same run and prints
one JSON line (this machine is shared and noisy: ratios, not absolute times)."""

from __future__ import annotations

import sys

from ftjax.cli.main import resolve

# name -> one-line help; benchmark NAME is `main(argv)` of the module ftjax_bench.NAME
BENCHES: dict[str, str] = {
    "coordinator": "quorum latency of N simulated replicas",
    "ftar": "FTAR bus bandwidth against the raw TCP loopback link",
    "step": "FT-HSDP step time against synchronous HSDP and a standalone replica",
    "catchup": "catch-up transfer rate against the raw link",
    "outage": "step time in an outage against healthy, elastic and constant batch",
    "reduced": "a reduced-degree replica's step rate against the full replica's",
    "data": "token files: prepare's and the loader's tokens/s against the training step's",
    "diloco": "DiLoCo's tokens/s and bytes per token against every-step sync over a capped link",
    "overlap": "streaming DiLoCo's tokens/s with its exchange overlapped (tau) against not, int8 against bf16",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: ftjax bench NAME [ARGS...]\n\nbenchmarks:")
        for name, help_ in BENCHES.items():
            print(f"  {name:<12} {help_}")
        return 0 if argv else 2
    if argv[0] not in BENCHES:
        print(f"ftjax bench: unknown benchmark {argv[0]!r}; choose from {', '.join(BENCHES)}", file=sys.stderr)
        return 2
    return int(resolve(f"ftjax_bench.{argv[0]}:main")(argv[1:]) or 0)
