"""The order of the suite's files (tests/conftest.py, scripts/test_costs.py): heaviest first by the
seconds a JUnit report recorded, each file's tests in their written order."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from conftest import REPO, heaviest_first


def script():
    spec = importlib.util.spec_from_file_location("test_costs", Path(REPO) / "scripts" / "test_costs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.unit.test_layout" name="test_a" time="1.5"/>
<testcase classname="tests.integration.test_diloco" name="test_b" time="40.04"/>
<testcase classname="tests.unit.test_layout" name="test_c" time="2.0"/>
<testcase classname="tests.cluster.test_multihost.TestHosts" name="test_d" time="7.0"/>
</testsuite></testsuites>
"""


def test_a_report_gives_each_files_seconds_heaviest_first(tmp_path):
    (tmp_path / "run.xml").write_text(REPORT)
    script().main(str(tmp_path / "run.xml"), str(tmp_path / "costs.json"))
    seconds = json.loads((tmp_path / "costs.json").read_text())["seconds"]
    assert list(seconds.items()) == [
        ("tests/integration/test_diloco.py", 40.0),
        ("tests/cluster/test_multihost.py", 7.0),  # a class's tests count for its file
        ("tests/unit/test_layout.py", 3.5),
    ]


def test_a_report_naming_no_test_file_is_refused_by_name(tmp_path):
    (tmp_path / "run.xml").write_text(REPORT.replace("tests.unit.test_layout", "tests.unit.test_gone"))
    with pytest.raises(SystemExit, match="tests.unit.test_gone"):
        script().main(str(tmp_path / "run.xml"), str(tmp_path / "costs.json"))
    assert not (tmp_path / "costs.json").exists()


def test_files_run_heaviest_first_each_in_its_written_order():
    items = ["t/a.py::x", "t/b.py::x", "t/a.py::y", "t/c.py::x", "t/b.py::y", "t/new.py::x"]
    heaviest_first(items, {"t/a.py": 3.0, "t/b.py": 50.0, "t/c.py": 12.0}, nodeid=str)
    # b, then c, then the unrecorded file (a middling 10 s), then a
    assert items == ["t/b.py::x", "t/b.py::y", "t/c.py::x", "t/new.py::x", "t/a.py::x", "t/a.py::y"]
