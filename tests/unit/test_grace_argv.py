"""The one read of the system in ``preempt.cluster.grace``: a process's command line (torchrun's agent's, for a
worker), as the parser of torchrun's options takes it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from preempt.cluster import grace

WAIT = "import sys; sys.stdin.read()"  # lives until the test closes its stdin (or kills it), however slow the machine


@pytest.fixture
def agent():
    """A stand-in for torchrun's agent: a process whose command line holds an empty argument."""
    p = subprocess.Popen([sys.executable, "-c", WAIT, "", "--shutdown-timeout=5"], stdin=subprocess.PIPE)
    yield p
    p.kill()
    p.wait()
    p.stdin.close()


def test_a_processs_command_line_is_read_without_its_empty_arguments(agent):
    assert grace.parent_argv(agent.pid) == [sys.executable, "-c", WAIT, "--shutdown-timeout=5"]


def test_this_processs_parent_is_read_by_default():
    code = "from preempt.cluster import grace; print(grace.parent_argv())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == repr(sys.orig_argv)


@pytest.mark.parametrize("pid", [-1, 0x3FFFFFFF])  # below 1, and above any pid Linux gives
def test_a_process_that_cannot_be_read_is_none(pid):
    assert grace.parent_argv(pid) is None
