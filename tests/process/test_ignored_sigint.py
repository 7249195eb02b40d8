"""A run started in the background by a non-interactive shell inherits SIGINT ignored.

POSIX shells without job control start ``cmd &`` with SIGINT and SIGQUIT ignored, and the process inherits it
across exec. The run keeps it so (the shell asked for it) and says once, as it starts, that Ctrl+C does not reach
it and how to stop it instead; SIGTERM stops it as usual.
"""

from __future__ import annotations

import os
import re
import shlex
import signal

from helpers import PREEMPTED, Spawned, train_cmd


def test_a_run_started_with_ampersand_by_a_script_says_ctrl_c_is_ignored_and_stops_on_sigterm(tmp_path):
    save_dir = tmp_path / "run"
    cmd = shlex.join(train_cmd(save_dir, None, ["--hold_at", "step:3"]))
    p = Spawned(["sh", "-c", f"{cmd} & wait $!"])  # the shell's background job, as in a job script
    assert p.wait_event("holding", point="step", n=3), p.output
    said = re.findall(r"^\[preempt\] SIGINT is ignored in this process.*\(kill -TERM (\d+)\)", p.output, re.M)
    assert len(said) == 1, p.output
    pid = int(said[0])
    assert pid != p.proc.pid  # python, not the shell
    os.kill(pid, signal.SIGINT)  # what Ctrl+C would send: discarded by the kernel, the handler never sees it
    os.kill(pid, signal.SIGTERM)  # both pending together would be taken lowest number first: SIGINT would win
    assert p.finish() == PREEMPTED, p.output
    assert p.events_of("stop", cause="SIGTERM", step=3), p.events
    assert "Ctrl+C does not stop this run" in p.output and "exits 75, as Ctrl+C would" in p.output
