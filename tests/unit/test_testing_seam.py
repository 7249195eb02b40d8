"""The test seam (preempt/_testing.py): fault points by name, and the event stream a test reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from preempt import _testing


def test_a_hook_is_called_at_its_point_only_while_installed():
    seen = []
    with _testing.installed("commit", lambda stage, cancel: seen.append(stage)):
        _testing.reach("commit", "before_rename", None)
        _testing.reach("load", "/x")  # another point: not this hook
    _testing.reach("commit", "committed", None)  # removed: nothing
    assert seen == ["before_rename"]


def test_an_unknown_point_is_refused_by_name():
    with pytest.raises(ValueError, match="fault point 'comit': expected one of commit, write, load, upload"):
        _testing.install("comit", lambda *a: None)


@pytest.mark.parametrize("on", [True, False])
def test_events_are_one_json_line_each_on_stdout_only_when_asked(on):
    code = "from preempt import _testing; _testing.emit('checkpoint', step=3, reason='interval'); print('plain')"
    env = {**os.environ, _testing.EVENTS_ENV: "1" if on else "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    if not on:
        assert lines == ["plain"]
        return
    assert lines[0].startswith(_testing.EVENT_PREFIX) and lines[1] == "plain"
    assert json.loads(lines[0][len(_testing.EVENT_PREFIX) :]) == {
        "event": "checkpoint",
        "step": 3,
        "reason": "interval",
    }
