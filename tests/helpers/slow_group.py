"""The slow tests run one after another on one pytest-xdist worker, the others on the second worker beside them.

With ``-n 2 --dist loadgroup`` (pyproject.toml), a group of tests is one unit of work, sent to one worker and run
there in order. tests/conftest.py puts every slow test in ``SLOW_GROUP``, so the long tests run as in a run without
workers: one real vLLM or Docker build at a time, module fixtures shared, time limits and measured figures beside
no other long test. A module whose short tests share a module- or session-scoped fixture with its slow ones joins
the group as a whole (``pytestmark``), so that one worker builds the fixture once.

pytest-xdist's own loadgroup learns a test's group from a suffix its worker adds to the test's node id, which
pytest 9.2's structured node ids no longer take: the groups would be lost, the slow tests spread over both workers.
So each worker writes the node ids of the group's tests to a folder the controller gives it
(``pytest_configure_node``), and the controller's scheduler (``SlowGroupScheduling``: loadgroup's, with that list)
makes them one unit. Where pytest-xdist's suffix still works, its groups are read as before.

What this takes of pytest-xdist beyond its documented hooks (``pytest_configure_node``,
``pytest_xdist_make_scheduler``, ``workerinput``): the class ``xdist.scheduler.LoadGroupScheduling`` and its
method ``_split_scope(nodeid)``, which names the unit a test belongs to. Tested with the range pyproject.toml pins;
``tests/test_support.py`` fails if the slow tests no longer reach one worker in order.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
from xdist.scheduler import LoadGroupScheduling

SLOW_GROUP = "slow"
# The key of a worker's ``workerinput`` that names the folder of the group's node ids.
FOLDER_KEY = "slow_group_folder"
FOLDER = pytest.StashKey[Path]()


def in_slow_group(item: pytest.Item) -> bool:
    return any(SLOW_GROUP in mark.args[:1] for mark in item.iter_markers("xdist_group"))


def put_slow_tests_in_the_group(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every slow test joins ``SLOW_GROUP``; in a worker, the group's node ids are written for the controller."""
    for item in items:
        if item.get_closest_marker("slow") is not None and not in_slow_group(item):
            item.add_marker(pytest.mark.xdist_group(SLOW_GROUP))
    worker = getattr(config, "workerinput", None)
    if worker is not None and FOLDER_KEY in worker:
        grouped = "".join(f"{item.nodeid}\n" for item in items if in_slow_group(item))
        (Path(worker[FOLDER_KEY]) / f"{worker['workerid']}.txt").write_text(grouped)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """The controller names the folder (one for the run) each worker writes its group's node ids to."""
    folder = node.config.stash.get(FOLDER, None)
    if folder is None:
        folder = node.config.stash[FOLDER] = Path(tempfile.mkdtemp(prefix="slow-group-"))
    node.workerinput[FOLDER_KEY] = str(folder)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> LoadGroupScheduling | None:
    if config.getvalue("dist") != "loadgroup" or FOLDER not in config.stash:
        return None
    return SlowGroupScheduling(config, log, config.stash[FOLDER])


class SlowGroupScheduling(LoadGroupScheduling):
    """pytest-xdist's loadgroup, with the node ids of ``SLOW_GROUP`` as the workers wrote them.

    The scheduler splits the tests into units once every worker has collected, so every worker's list is written by
    then; the folder is removed once read.
    """

    def __init__(self, config: pytest.Config, log: Any, folder: Path) -> None:
        super().__init__(config, log)
        self._folder = folder
        self._grouped: set[str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._grouped is None:
            self._grouped = {line for path in self._folder.glob("*.txt") for line in path.read_text().splitlines()}
            shutil.rmtree(self._folder, ignore_errors=True)
        return SLOW_GROUP if nodeid in self._grouped else super()._split_scope(nodeid)
