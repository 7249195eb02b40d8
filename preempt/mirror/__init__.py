"""The mirror: a run's checkpoints copied to object storage (S3 and any fsspec URL), and brought back on a new machine.

Owns the one module that imports fsspec (``store``: list, read, put, get, copy, delete at one URL prefix), what the
mirror holds (``survey``: a listing and its manifests), the pure decisions (``plan``: complete, what to upload and in
which order, what to pull, what to delete, the stop's deadline), the download with the local commit protocol
(``pull``), the background uploader (``uploader``), and the wait before a retry (``backoff``, pure).

May import: :mod:`preempt.checkpoint`, :mod:`preempt.errors`, :mod:`preempt._log`. Never the run, the data, the
cluster, health, the CLI or the supervisor (import-linter contracts in pyproject.toml); fsspec only in ``store``,
when a store is made.
"""
