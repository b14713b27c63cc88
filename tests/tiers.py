"""The unit tests in two tiers, chosen by measured time: the gate and the slow tier.

``make unit`` (run by ``make test`` and CI) deselects the slow tier; ``make unit-slow`` runs only it
and ``make test-all`` runs everything. A test is in the slow tier when it carries
``@pytest.mark.slow`` or when its time recorded in ``tests/durations.json`` (setup, call and
teardown on the 2-core reference machine, a cold full run) exceeds :data:`SLOW_SECONDS` — except
that every test file keeps its cheapest test in the gate when that one took at most
:data:`FILE_FLOOR_SECONDS`, so that CI still imports and exercises every test module. A test the file
does not know (a new one) runs in the gate until ``make test-durations`` measures it. The run's
summary says when the slow tier was left out.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("durations.json")
#: A test recorded above this many seconds goes to the slow tier (chosen so that the gate's
#: recorded time keeps ``make test`` near 20 minutes on the 2-core machine; see docs/contributing.md).
SLOW_SECONDS = 5.0
#: The cheapest test of a file stays in the gate up to this many seconds.
FILE_FLOOR_SECONDS = 60.0
#: The gate's recorded test time (summed over tests; two workers share it) that keeps ``make test``
#: near 20 minutes on the 2-core machine with the notebooks, the docs and the install.
GATE_BUDGET_SECONDS = 1100.0


def recorded_seconds(path: Path = DURATIONS) -> dict[str, float]:
    """Recorded seconds per test id; empty when the file is absent."""
    if not path.exists():
        return {}
    return {str(k): float(v) for k, v in json.loads(path.read_text())["seconds"].items()}


def slow_tier(seconds: dict[str, float]) -> set[str]:
    """The recorded test ids that belong to the slow tier (the rule of this module's docstring)."""
    by_file: dict[str, list[tuple[float, str]]] = {}
    for nodeid, took in seconds.items():
        by_file.setdefault(nodeid.split("::", 1)[0], []).append((took, nodeid))
    slow = set()
    for tests in by_file.values():
        tests.sort()
        floor = tests[0][1] if tests[0][0] <= FILE_FLOOR_SECONDS else None
        slow.update(nodeid for took, nodeid in tests if took > SLOW_SECONDS and nodeid != floor)
    return slow


def mark_slow_tier(items: list[pytest.Item], seconds: dict[str, float]) -> int:
    """Mark the items of the recorded slow tier as ``slow``; return how many carry the mark."""
    slow = slow_tier(seconds)
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)
    return sum(item.get_closest_marker("slow") is not None for item in items)


class DurationRecorder:
    """``--record-durations PATH``: write each test's setup + call + teardown seconds after the session."""

    def __init__(self, path: str):
        self.path = Path(path)
        self.seconds: Counter = Counter()
        self.failed = False

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] += report.duration
        self.failed |= report.failed

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.failed or not self.seconds:
            session.config.pluginmanager.get_plugin("terminalreporter").write_line(
                f"durations not written to {self.path}: a test failed or none ran")
            return
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=Path(__file__).parent, check=False).stdout.strip()
        except OSError:
            commit = ""
        record = {"machine": f"{platform.machine()}, {_cpu_count()} cores, {platform.python_version()}",
                  "commit": commit, "date": time.strftime("%Y-%m-%d"),
                  "workers": session.config.getoption("numprocesses", None) or 1,
                  "seconds": {k: round(v, 2) for k, v in sorted(self.seconds.items())}}
        self.path.write_text(json.dumps(record, indent=0) + "\n")


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
