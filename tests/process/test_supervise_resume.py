"""preempt supervise and the runtime together: a restarted child resumes with the lowered learning rate in effect."""

from __future__ import annotations

import math
import sys

from helpers import TRAIN, Spawned


def test_a_nan_restart_resumes_from_the_checkpoint_with_the_lower_lr(tmp_path):
    save_dir = tmp_path / "run"
    train = [sys.executable, str(TRAIN), "--save_dir", str(save_dir), "--lr", "{lr}", "--every_steps", "8"]
    train += ["--sync_save", "--nan_at", "10"]  # attempt 1 prints "Loss is NaN" at step 10 and exits 1
    sup = [sys.executable, "-m", "preempt", "supervise", "--lr", "0.01", "--log", str(tmp_path / "supervise.log")]
    p = Spawned([*sup, "--", *train])
    assert p.finish(timeout=180) == 0, p.output
    starts = [(e["step"], e["lr"]) for e in p.events_of("entered")]
    assert [step for step, _ in starts] == [0, 8], p.events
    assert starts[0][1] == 0.01
    # StepLR(step_size=7, gamma=0.9) after 8 steps gives 0.009 in the checkpoint; the supervisor asked for lr/1.5
    assert math.isclose(starts[1][1], 0.009 / 1.5, rel_tol=1e-5), starts
    assert "asks for 0.666667 of the original" in p.output, p.output  # and says so
    assert "resumed from" in p.output and "Loss is NaN" in p.output
