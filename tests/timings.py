"""``pytest --timings PATH``: each test's seconds and kind as JSON lines, for the table of
docs/development.md (``python tools/test_timings.py PATH`` makes it).

A test's kind is what its time goes to, decided as it runs:

* ``slurm``: marked ``slurm`` (it drives the SLURM dev cluster; mostly waiting on the scheduler);
* ``hugging-face``: a ``tests/test_hf_*.py`` module (transformers models built, converted, compared);
* ``multi-process``: it started a process (``multiprocessing`` ranks, a ``subprocess`` such as a
  CLI or a local job), in its setup, call or teardown;
* ``single-process``: everything else.

Under pytest-xdist the workers decide the kind (the process count is theirs) and the controller,
which receives every report, writes the file.
"""

from __future__ import annotations

import json
import multiprocessing.process
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

_STARTED = [0]  # processes started by this pytest process (a worker, under xdist)


def busy_cpu_seconds() -> float:
    """CPU seconds every core of the machine has spent not idle since boot (/proc/stat): the
    difference over a test is its CPU time when nothing else runs (``-p no:xdist``)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:8]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def count_process_starts() -> None:
    """Count every ``subprocess.Popen`` and ``multiprocessing`` process this process starts."""
    popen_init, process_start = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start

    def counting_init(self: Any, *args: Any, **kwargs: Any) -> None:
        _STARTED[0] += 1
        popen_init(self, *args, **kwargs)

    def counting_start(self: Any) -> None:
        _STARTED[0] += 1
        process_start(self)

    subprocess.Popen.__init__ = counting_init
    multiprocessing.process.BaseProcess.start = counting_start


def mark_start(item: pytest.Item) -> None:
    item.stash[_KEY] = _STARTED[0]
    item.stash[_CPU] = busy_cpu_seconds()


def properties(item: pytest.Item) -> list[tuple[str, object]]:
    """What the report of the test's teardown carries: its kind, the processes it started and
    the machine's busy CPU seconds while it ran (its own when it ran alone)."""
    return [("kind", kind_of(item)), ("processes", _STARTED[0] - item.stash.get(_KEY, _STARTED[0])),
            ("cpu", round(busy_cpu_seconds() - item.stash.get(_CPU, busy_cpu_seconds()), 2))]


def kind_of(item: pytest.Item) -> str:
    if item.get_closest_marker("slurm"):
        return "slurm"
    if item.module.__name__.startswith("test_hf_"):
        return "hugging-face"
    if _STARTED[0] > item.stash.get(_KEY, _STARTED[0]):
        return "multi-process"
    return "single-process"


_KEY = pytest.StashKey[int]()
_CPU = pytest.StashKey[float]()


class Writer:
    """A plugin that collects the reports in the process that writes the file (the controller
    under xdist) and writes it when the session ends."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.rows: dict[str, dict[str, Any]] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        row = self.rows.setdefault(report.nodeid.split("@")[0],  # xdist's "@group" suffix dropped
                                   {"setup": 0.0, "call": 0.0, "teardown": 0.0, "outcome": "passed"})
        row[report.when] = round(report.duration, 3)
        if report.failed:
            row["outcome"] = "failed"
        elif report.skipped and row["outcome"] == "passed":
            row["outcome"] = "skipped"
        row.update((name, value) for name, value in report.user_properties if name in ("kind", "processes", "cpu"))

    def pytest_sessionfinish(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "w") as f:
            for nodeid, row in self.rows.items():
                f.write(json.dumps({"test": nodeid, "file": nodeid.split("::")[0], **row}) + "\n")
