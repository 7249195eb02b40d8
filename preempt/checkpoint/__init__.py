"""The checkpoint: what is on disk and how it gets there, with no notion of a training loop.

Owns the manager (``manager``: choose, load, verify, prune), one file checked against its manifest entry
(``files``, several read at once by a restore), the manifest, the atomic commit protocol (``commit``, written down
in its docstring: the layout, the stages, the rename, the leftovers), the names in a save_dir, one per step
(``names``), every byte written or read hashed on its way and the syncs issued together (``hashed_io``), a
write's cancellation before its rename (``cancel``), trees deleted at once or by a background thread
(``deleter``), writes and a cold restore's reads that bypass the page cache (``direct_io``), broken or
superseded checkpoints moved out of sight, never deleted (``aside``),
the pruned checkpoint's files written over (``recycle``), a payload's files written or
hard-linked when unchanged (``write``, ``carry``), which checkpoints are
kept (``retention``, pure), what is in the files (``state``, ``codec``, ``tensorfile``, ``components``; no pickle),
where each piece of a sharded tensor lies in the ranks' files of pieces (``pieces``, no torch),
the digests of a run's live state at each checkpoint step that ``preempt check`` holds its checkpoints to
(``live_record``), what torch's optimizers, schedulers and scalers accept of it (``hyperparams``, pure), when
``complete.json`` is believed (``completion``, pure),
the staging buffers and the background writer (``staging``), fresh host memory made resident at once
(``prefault``), host memory pinned for a GPU's copies exactly
(``pinned``), a lazy snapshot's copies from a GPU on a side stream (``side_stream``), the directory's lock and step
beacon (``lock``), a checkpoint's files asked of the disk before they are read (``readahead``), and the one rule
for every file opened inside a save_dir (``safe_io``).

May import: :mod:`preempt.errors`, :mod:`preempt._log`. Never the run, the data, the cluster, health, the CLI or the
supervisor (import-linter contracts in pyproject.toml). ``ls``/``verify``/``inspect``/``prune``/``export`` use the
torch-free half: ``manager``, ``files``, ``manifest``, ``commit``, ``names``, ``hashed_io``, ``tensorfile`` headers
and ``codec.loads`` import torch only inside the functions that meet tensors.
"""
