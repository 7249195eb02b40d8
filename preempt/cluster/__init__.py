"""The cluster: what the scheduler, the other ranks and the process's environment say.

Owns stop signals and the flag their handler sets (``signals``, no torch), SLURM: the job, its end time and the requeue
rule (``slurm``, no torch), the environment read in one place (``environment``), the contract of ``preempt supervise``
read by the training process (``supervised``, no torch), the ranks' agreement and commit under torch.distributed
(``distributed``), the ranks' restore together: each reads a share of a checkpoint's files and they exchange the rest
(``shared_read``; which rank reads which bytes: its pure ``plan``), which node's save_dir each rank writes to when the
nodes share none (``nodes``, no torch), FSDP/DTensor state through DCP (``sharded``), the cloud's advance notices read
from its metadata service by a thread (``notices``, no torch, the standard library's HTTP client only), Ray's drain of
this node read the same way from Ray's GCS (``ray_notice``, ray imported only inside a Ray worker), and the grace
from a stop's signal to the kill, where it comes from and whether a stop fits in it (``grace``, no torch), and launchers
that make a new folder per run, Hydra's, where a save_dir would not be found again (``launcher_dirs``, no torch).

May import: :mod:`preempt.checkpoint` (the ranks write and commit checkpoints), :mod:`preempt.errors`,
:mod:`preempt._log`, :mod:`preempt._version`. Never the run, the data, health, the CLI or the supervisor
(import-linter contracts in pyproject.toml); the supervisor imports ``signals`` and ``supervised`` from here.
"""
