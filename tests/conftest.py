"""The suite's hooks and fixtures. What the tests share as code lives in ``tests/helpers/``."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
from helpers.distributed import free_port
from helpers.processes import ROOT
from helpers.reference import References

# Every process a test starts imports preempt from this checkout, whatever the installed (editable) copy points at:
# a suite run in one clone must not test another clone's code.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


# The order in which pytest-xdist hands out the test files (.ci/run: one file per worker at a time, in collection
# order with --no-loadscope-reorder): the tiers whose files run longest first, the many short unit files last, so
# that the workers end together. xdist's own order (files with the most tests first) left a two-to-three-minute file
# with one or two trials (the two-node SLURM job, the README's demo) to the very end, run by one worker alone.
TIERS_LONGEST_FIRST = ("slurm", "distributed", "process", "faults", "gpu", "unit")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def tier(item: pytest.Item) -> int:
        parts = item.path.relative_to(ROOT / "tests").parts
        return TIERS_LONGEST_FIRST.index(parts[0]) if parts[0] in TIERS_LONGEST_FIRST else len(TIERS_LONGEST_FIRST)

    items.sort(key=tier)  # stable: the files of a tier, and the tests of a file, keep their order


@pytest.fixture
def sigint_handled():
    """SIGINT with Python's KeyboardInterrupt handler for this test and the processes it starts.

    A background job of a non-interactive shell (``pytest &`` in a script) inherits SIGINT ignored, and the
    library rightly keeps an ignored SIGINT ignored (preempt.cluster.signals). Tests of what Ctrl+C does need it
    handled, as in a terminal; children started meanwhile get it at its default (exec resets a handler).
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> References:
    """The final state of an uninterrupted run (``reference(args)``, ``reference(args, script=...)``,
    ``reference.torchrun(args)``, ``reference.made(key, make)``: helpers/reference.py), made once for the whole
    test run and shared by the xdist workers."""
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # one value for every worker of this run
    base = tmp_path_factory.getbasetemp()
    return References(base.parent / f"references-{run_id}" if run_id else base / "references")


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """The S3-compatible server of the mirror's tests (tests/s3server.py): ``PREEMPT_TEST_S3_ENDPOINT`` when .ci/run
    started one, else a moto_server of this worker, stopped at the end. Never stopped or paused by a test."""
    import s3server

    shared = os.environ.get(s3server.ENDPOINT_VAR)
    if shared:
        yield shared
        return
    with s3server.start(free_port()) as server:
        yield server.endpoint


@pytest.fixture
def mirror_url(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """``s3://<a bucket of this test>/run``, with the AWS variables set for this process and the ones it starts."""
    import s3server

    for name, value in s3server.env(s3_endpoint).items():
        monkeypatch.setenv(name, value)
    return f"s3://{s3server.new_bucket(s3_endpoint)}/run"
