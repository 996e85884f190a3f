"""Shared fixtures, one intra-op thread per xdist worker, and the default suite's time budget.

README's test command runs the suite on two xdist workers (``-n 2``). Each worker then gets one torch (and
so native-kernel) thread: two workers of two threads each on two cores would wait on each other's OpenMP
teams. The time budget guards README's promise that the default suite stays under five minutes on two
cores: with ``DPVR_SUITE_BUDGET_S`` set (``.ci/run`` sets 300), a default run (``-m "not slow"``) that
takes longer fails, naming its slowest tests (``--durations``).
"""

import os
import time

import numpy as np
import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
# The ghost clipper's per-layer forms from fixed rates, not this host's measured ones: the same choices on
# every machine, and no cache file written by the tests.
os.environ.setdefault("DPVR_GHOST_CALIBRATE", "0")


@pytest.fixture
def rng():
    return np.random.default_rng(20261122)


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_STARTED] = time.perf_counter()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    budget = float(os.environ.get("DPVR_SUITE_BUDGET_S", "0") or 0)
    if not budget or hasattr(session.config, "workerinput"):  # workers report to the controller, which times
        return
    if session.config.getoption("markexpr") != "not slow" or session.config.getoption("file_or_dir"):
        return  # only the default run of the whole suite has a budget
    took = time.perf_counter() - session.config.stash[_STARTED]
    if took > budget:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_line(
                f"the default suite took {took:.0f} s, over its budget of {budget:.0f} s "
                "(DPVR_SUITE_BUDGET_S): mark the slowest tests above slow, or make them cheaper", red=True)


_STARTED = pytest.StashKey[float]()
