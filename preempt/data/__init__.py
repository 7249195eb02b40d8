"""The data: which sample comes next, in any process, and the random streams that make it so.

Owns the resumable (seed, epoch) order, whose epoch a run holds against loaders that set their own (``sampler``),
what the run does to a DataLoader: its sampler found or replaced, the wrappers of Lightning Fabric recognised and
opened (``loaders``), its workers shielded from stop signals, every loader's while a run is active (``shield``),
per-sample random streams and iterable datasets' worker positions (``replay``), what a resumed epoch says it
replayed (``resume_notice``, pure), the batches a framework iterates drawn through the run (``stand_in``),
Accelerate's prepared loaders driven in preempt's order, sharded as Accelerate shards (``prepared``, by duck typing:
no import of Accelerate), and the global generators (``rng``). Where the data stands in a run (its cursor) is the
run's part, :mod:`preempt.run.data_cursor`.

May import: :mod:`preempt.errors`, :mod:`preempt._log`. Never the checkpoint, the run, the cluster, the CLI or the
supervisor (import-linter contracts in pyproject.toml).
"""
