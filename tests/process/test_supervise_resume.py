"""preempt supervise and the runtime together: a restarted child resumes with the lowered learning rate in effect."""

from __future__ import annotations

import math
import re
import sys

from helpers import TRAIN, Spawned


def test_a_nan_restart_resumes_from_the_checkpoint_with_the_lower_lr(tmp_path):
    save_dir = tmp_path / "run"
    train = [sys.executable, str(TRAIN), "--save_dir", str(save_dir), "--lr", "{lr}", "--every_steps", "8"]
    train += ["--sync_save", "--nan_at", "10"]  # attempt 1 prints "Loss is NaN" at step 10 and exits 1
    sup = [sys.executable, "-m", "preempt", "supervise", "--lr", "0.01", "--log", str(tmp_path / "supervise.log")]
    p = Spawned([*sup, "--", *train])
    assert p.finish(timeout=180) == 0, p.output
    starts = re.findall(r"^start step (\d+) epoch \d+ batch \d+ lr (\S+)$", p.output, re.M)
    assert [s for s, _ in starts] == ["0", "8"], p.output
    assert float(starts[0][1]) == 0.01
    scale = float(re.search(r"asks for ([\d.]+) of the original", p.output).group(1))
    # StepLR(step_size=7, gamma=0.9) after 8 steps gives 0.009 in the checkpoint; the supervisor asked for lr/1.5
    assert math.isclose(scale, 1 / 1.5, rel_tol=1e-5), p.output
    assert math.isclose(float(starts[1][1]), 0.009 * scale, rel_tol=1e-9), p.output
    assert "resumed from" in p.output and "Loss is NaN" in p.output
