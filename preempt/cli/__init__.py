"""The command line: every ``preempt`` command but ``supervise``'s own loop, and what they print.

Owns the parser and ``main`` (``main``, the console script's target), exit codes and output (``output``),
``ls``/``verify``/``prune``/``export`` (``checkpoints``), ``inspect`` (``inspection``), the selector and formatting
they share (``views``), what ``ls`` and ``verify`` show wherever the checkpoints are (``listing``), and ``preempt
report`` (``report``) with the timeline and goodput it computes from a run's history (``timeline``, pure) and
its ``--plot`` (``plot``). The same
commands on a run's mirror in object storage, and ``preempt pull`` (``remote``); what DIR names, a path or a URL,
and ``--mirror-option`` (``where``). ``preempt check`` (``check``): a command run straight and stopped, their states
compared (it runs COMMAND; torch only inside its comparison). ``preempt supervise`` is parsed here and runs in
:mod:`preempt.supervise.command`.

May import: every part but the run (the commands read what a run left on disk or in its mirror; they never run
one). Nothing imports the CLI but ``python -m preempt`` (import-linter contracts in pyproject.toml). No checkpoint
command imports torch: the torch-free half of :mod:`preempt.checkpoint` reads headers and JSON; ``export`` copies the
verified data area. fsspec is imported by :mod:`preempt.mirror.store` when a command is given a mirror's URL.
"""
