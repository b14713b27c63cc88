"""The unit tests in two tiers, chosen by measured time: the gate and the slow tier.

``make unit`` (run by ``make test`` and CI) deselects the slow tier; ``make unit-slow`` runs only it
and ``make test-all`` runs everything. A test is in the slow tier when it carries
``@pytest.mark.slow`` or when its time recorded in ``tests/durations.json`` (setup, call and
teardown on the 2-core reference machine, a cold full run) exceeds :data:`SLOW_SECONDS` — except
that every test file keeps its cheapest test in the gate when that one took at most
:data:`FILE_FLOOR_SECONDS` (so that CI still imports and exercises every test module), and that a
test marked ``@pytest.mark.gate`` (a cheap guard of something CI must always check) stays in the
gate whatever its time. A test the file
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
#: recorded time keeps ``make test`` near 20 minutes on the 2-core machine; docs/install.md).
SLOW_SECONDS = 3.0
#: The cheapest test of a file stays in the gate up to this many seconds.
FILE_FLOOR_SECONDS = 60.0
#: The gate's recorded test time (summed over tests; two workers share it) that keeps ``make test``
#: near 20 minutes on the 2-core machine with the notebooks, the docs and the install.
GATE_BUDGET_SECONDS = 1100.0


def recorded_seconds(path: Path = DURATIONS, key: str = "seconds") -> dict[str, float]:
    """Recorded seconds per test id (``key``: ``"seconds"`` of the whole suite, or ``"gate_seconds"`` of
    the gate run alone); empty when the file or the key is absent."""
    if not path.exists():
        return {}
    return {str(k): float(v) for k, v in json.loads(path.read_text()).get(key, {}).items()}


def slow_tier(seconds: dict[str, float], gate_seconds: dict[str, float] | None = None) -> set[str]:
    """The recorded test ids that belong to the slow tier (the rule of this module's docstring).

    ``gate_seconds``, where recorded, are the times of the gate run on its own: a test that is cheap
    in the whole suite only because a slow test before it compiled its programs pays for them there,
    and counts as slow when that exceeds :data:`SLOW_SECONDS` too."""
    gate_seconds = gate_seconds or {}
    by_file: dict[str, list[tuple[float, str]]] = {}
    for nodeid, took in seconds.items():
        by_file.setdefault(nodeid.split("::", 1)[0], []).append((took, nodeid))
    slow = set()
    for tests in by_file.values():
        tests.sort()
        floor = tests[0][1] if tests[0][0] <= FILE_FLOOR_SECONDS else None
        slow.update(nodeid for took, nodeid in tests
                    if max(took, gate_seconds.get(nodeid, 0.0)) > SLOW_SECONDS and nodeid != floor)
    return slow


def mark_slow_tier(items: list[pytest.Item], seconds: dict[str, float]) -> int:
    """Mark the items of the recorded slow tier as ``slow`` (not those marked ``gate``); return how many
    carry the mark."""
    slow = slow_tier(seconds, recorded_seconds(key="gate_seconds"))
    for item in items:
        if item.nodeid in slow and item.get_closest_marker("gate") is None:
            item.add_marker(pytest.mark.slow)
    return sum(item.get_closest_marker("slow") is not None for item in items)


class DurationRecorder:
    """``--record-durations PATH``: write each test's setup + call + teardown seconds after a whole run.

    The file decides the tiers of every later run, so it is written only from a run that passed and
    selected nothing — no path, ``-k``, ``--deselect`` or last-failed selection, every collected test
    reported — and atomically (a temporary file renamed over it). A run of the whole suite writes
    ``seconds``; a run of the gate (``-m "not slow"``, after it) adds ``gate_seconds``."""

    def __init__(self, path: str):
        self.path = Path(path)
        self.seconds: Counter = Counter()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] += report.duration

    def _why_not(self, session: pytest.Session, exitstatus: int) -> str | None:
        config = session.config
        if exitstatus != 0:
            return f"the run did not pass (exit status {int(exitstatus)})"
        selected = [opt for opt in ("keyword", "deselect", "lf", "failedfirst") if config.getoption(opt, None)]
        if config.getoption("markexpr", None) not in (None, "", "not slow"):
            selected.append("markexpr")
        if selected:
            return f"tests were selected ({', '.join(selected)})"
        if {Path(arg.split("::")[0]).resolve() for arg in config.args} != {Path(__file__).resolve().parent}:
            return f"the run was given {config.args}, not the whole tests folder"
        if len(self.seconds) != session.testscollected:
            return f"{len(self.seconds)} of {session.testscollected} collected tests reported"
        return None

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        why_not = self._why_not(session, exitstatus)
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if why_not is not None:
            if reporter is not None:
                reporter.write_line(f"durations not written to {self.path}: {why_not}")
            return
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=Path(__file__).parent, check=False).stdout.strip()
        except OSError:
            commit = ""
        measured = {k: round(v, 2) for k, v in sorted(self.seconds.items())}
        if session.config.getoption("markexpr", None) == "not slow":  # the gate alone, after a whole run
            if not self.path.exists():
                if reporter is not None:
                    reporter.write_line(f"durations not written: record the whole suite in {self.path} first")
                return
            record = json.loads(self.path.read_text())
            record.update(gate_seconds=measured, gate_commit=commit)
        else:  # the whole suite: the gate's own times belong to the old tiers, so they go
            record = {"machine": f"{platform.machine()}, {_cpu_count()} cores, {platform.python_version()}",
                      "commit": commit, "date": time.strftime("%Y-%m-%d"),
                      "workers": session.config.getoption("numprocesses", None) or 1, "seconds": measured}
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(json.dumps(record, indent=0) + "\n")
        os.replace(partial, self.path)
        if reporter is not None:
            reporter.write_line(f"durations of {len(self.seconds)} tests written to {self.path}")


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
