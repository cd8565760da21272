"""Write tests/costs.json, the seconds each test file took, from a JUnit report of a whole run.

    PYTEST_ADDOPTS=--junitxml=/tmp/run.xml make test   # best on the 2-core machine, both cores hogged
    python scripts/test_costs.py /tmp/run.xml

tests/conftest.py orders the files heaviest first by these costs, so that `make test`'s workers
finish together (docs/dev/testing.md). Only the order depends on them: a stale file costs time, never
a result.
"""

from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_file(classname: str) -> str:
    """tests.integration.test_x[.TestClass] -> tests/integration/test_x.py (the longest prefix that is a file)."""
    parts = classname.split(".")
    for n in range(len(parts), 0, -1):
        path = "/".join(parts[:n]) + ".py"
        if os.path.isfile(os.path.join(REPO, path)):
            return path
    raise SystemExit(f"test_costs: no test file for JUnit classname {classname!r}")


def main(report: str, out: str = os.path.join(REPO, "tests", "costs.json")) -> None:
    seconds: dict[str, float] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        path = test_file(case.get("classname", ""))
        seconds[path] = seconds.get(path, 0.0) + float(case.get("time", 0.0))
    if not seconds:
        raise SystemExit(f"test_costs: {report} has no testcase")
    with open(out, "w") as f:
        json.dump({"seconds": {k: round(v, 1) for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])}}, f, indent=1)
        f.write("\n")
    print(f"{out}: {len(seconds)} files, {sum(seconds.values()):.0f} s")


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        raise SystemExit("usage: python scripts/test_costs.py REPORT.xml [OUT.json]")
    main(*sys.argv[1:])
