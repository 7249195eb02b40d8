"""``preempt supervise``: runs a training command again after it stopped, and decides what the next attempt changes.

Owns the command line and its loop (``command``), its pure decisions: which exit means what, what the next attempt
changes, when to give up (``policy``), and the child process: starting it in its own session, passing signals on,
collecting its exit (``process``). The training process reads what the supervisor passes it through
:mod:`preempt.cluster.supervised`, below the run, so that the run never imports the supervisor.

May import: :mod:`preempt.cluster` (``signals``, ``supervised``), :mod:`preempt.checkpoint` (``safe_io``),
:mod:`preempt.errors`, :mod:`preempt._log`; never torch, nor the run (import-linter contracts in pyproject.toml).
Only the CLI imports it.
"""
