"""The README's first command, examples/demo.sh, run as a user runs it: it must show the stop and the resume."""

from __future__ import annotations

import re
import subprocess

from conftest import ROOT


def test_demo_shows_a_preemption_and_the_resume():
    """SIGTERM goes out when the run reports epoch 1, so the stop shows on a fast machine and a loaded one alike."""
    r = subprocess.run(
        ["bash", str(ROOT / "examples" / "demo.sh")],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "== exit code 75 " in out, out
    assert re.search(r"stopping on SIGTERM .* \(epoch 1, batch [1-9]\d*\)", out), out
    assert re.search(r"resumed from runs/latentwire_demo/step_\d+: step \d+, epoch 1, batch [1-9]", out), out
    assert "is complete" in out and re.search(r"checkpoint\(s\), .*: all ok", out), out
