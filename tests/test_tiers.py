"""The rule that splits the unit tests into the gate (make unit, CI) and the slow tier (make unit-slow)."""

import pytest

from tiers import DURATIONS, FILE_FLOOR_SECONDS, GATE_BUDGET_SECONDS, SLOW_SECONDS, recorded_seconds, slow_tier


def test_a_test_cheap_in_the_whole_suite_but_slow_in_the_gate_alone_is_slow():
    seconds = {"tests/a.py::first": 0.5, "tests/a.py::second": 1.0, "tests/a.py::third": 2.0}
    gate_seconds = {"tests/a.py::first": 0.5, "tests/a.py::second": SLOW_SECONDS + 3}
    assert slow_tier(seconds, gate_seconds) == {"tests/a.py::second"}
    assert slow_tier(seconds) == set()


def test_tests_above_the_threshold_are_slow_except_each_files_cheapest():
    seconds = {"tests/a.py::quick": 0.5, "tests/a.py::long": SLOW_SECONDS + 1,
               "tests/b.py::only": SLOW_SECONDS + 5, "tests/b.py::longer": SLOW_SECONDS + 9,
               "tests/c.py::huge": FILE_FLOOR_SECONDS + 1, "tests/d.py::edge": SLOW_SECONDS}
    assert slow_tier(seconds) == {"tests/a.py::long", "tests/b.py::longer", "tests/c.py::huge"}


def test_the_gate_fits_its_budget_as_recorded():
    seconds = recorded_seconds()
    if not seconds:
        pytest.skip(f"no recorded durations at {DURATIONS} (make test-durations writes them)")
    gate_seconds = recorded_seconds(key="gate_seconds")  # the gate run's own times, where recorded
    slow = slow_tier(seconds, gate_seconds)
    gate = sum(max(took, gate_seconds.get(nodeid, 0.0)) for nodeid, took in seconds.items() if nodeid not in slow)
    assert gate <= GATE_BUDGET_SECONDS, (
        f"the gate's tests took {gate:.0f} s when recorded, over the {GATE_BUDGET_SECONDS:.0f} s that keep make test "
        "near 20 minutes on 2 cores: lower SLOW_SECONDS in tests/tiers.py or make the new tests cheaper")
