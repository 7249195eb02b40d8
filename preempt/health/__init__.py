"""Health and the record of a run: the guards, the GPU monitor, and what a run writes about itself.

Owns the non-finite loss and out-of-memory guards and their streaks (``guards``), the NVML GPU monitor
(``monitor``: gpu_samples.jsonl, gpu_stats.json), train.log and history.jsonl (``history``), and the progress line
and epoch summaries (``progress``), and the metric loggers (``loggers``: TensorBoard, W&B, one run across
restarts; their packages are imported only by a run that asks for them).
The run's part that acts on them (rollbacks, skips, emergency saves) is :mod:`preempt.run.guarding`; ``preempt
report`` reads the history from :mod:`preempt.cli.main`.

May import: :mod:`preempt.checkpoint` (its safe I/O and atomic writes), :mod:`preempt.errors`, :mod:`preempt._log`.
Never the run, the data, the cluster, the CLI or the supervisor (import-linter contracts in pyproject.toml).
"""
