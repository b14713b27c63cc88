"""A line per finished test file in ``make unit``: where the run is, what each file cost.

With pytest-xdist the controller learns the collected test ids from the first worker that
finishes collecting (``pytest_xdist_node_collection_finished``) and counts the reports that come
back; a file is done when all its tests have reported their teardown. Without xdist the ids come
from the collection itself.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


class FileProgress:
    """Prints ``[k/N, 3:12] tests/test_x.py: 12 passed, 1 skipped; 34 s of test time`` as each file
    finishes (wall time since the session started; the file's test time summed over its tests,
    which xdist interleaves with other files' tests)."""

    def __init__(self, config):
        self.config = config
        self.expected: Counter | None = None
        self.outcomes: dict[str, Counter] = defaultdict(Counter)
        self.seconds: Counter = Counter()
        self.start = time.perf_counter()
        self.done = 0

    def _expect(self, nodeids):
        if self.expected is None:
            self.expected = Counter(_file_of(n) for n in nodeids)

    def pytest_xdist_node_collection_finished(self, node, ids):
        self._expect(ids)

    def pytest_collection_finish(self, session):
        if not hasattr(self.config, "workerinput"):
            self._expect(item.nodeid for item in session.items)

    def pytest_runtest_logreport(self, report):
        name = _file_of(report.nodeid)
        self.seconds[name] += report.duration
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            outcome = report.outcome
            if hasattr(report, "wasxfail"):
                outcome = "xfailed" if outcome == "skipped" else "xpassed"
            self.outcomes[name][outcome] += 1
        if report.when != "teardown" or self.expected is None:
            return
        self.expected[name] -= 1
        if self.expected[name] == 0:
            self.done += 1
            tally = ", ".join(f"{n} {k}" for k, n in sorted(self.outcomes[name].items()))
            minutes, seconds = divmod(int(time.perf_counter() - self.start), 60)
            reporter = self.config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                if reporter._tw.width_of_current_line:  # end the line of progress dots first
                    reporter.write("\n")
                reporter.write_line(f"[{self.done}/{len(self.expected)}, {minutes}:{seconds:02d}] {name}: {tally}; "
                                    f"{self.seconds[name]:.0f} s of test time")
