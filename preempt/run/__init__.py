"""The run: PreemptibleRun, the face a user holds, and the parts it composes, one concern each.

``preemptible`` (the face) builds its parts and calls them at the loop's points (enter, epochs, batches, step,
exit). The parts, each importing only those before it (a layers contract in pyproject.toml): ``due`` (when to
save, pure), ``write_decisions`` (the scheduler's decisions, pure), ``config`` (every option, checked once),
``loop_state`` (the counters: their only writer), ``data_cursor`` (where the data stands), ``snapshot`` (what a
checkpoint holds), ``peers`` (one process or the ranks), ``checkpoint_writer`` (a save's one downward call: one
process's save or the ranks' commit, built once per run), ``background`` (the staging buffers, the writer thread and
lazy copies), ``sharded_saves`` (sharded state saved in the background by the ranks' writers), ``save_scheduler``
(when and how a checkpoint is written, one background job at a time), ``outcomes`` (what came of each save:
its record, its log line, a failed write),
``stopping`` (signals, walltime, requeue, the exit code), ``reporting`` (logs and progress), ``guarding`` (NaN
rollbacks, OOM skips, emergency saves), ``check_record`` (inside ``preempt check``: the live state at each checkpoint
step), ``resume_plan`` (where a run starts, pure), ``restore`` (following it)
and ``mirroring`` (the mirror's pull on entering, its uploads, the stop's wait for them).
preempt/README.md draws them.

May import: :mod:`preempt.checkpoint`, :mod:`preempt.data`, :mod:`preempt.cluster`, :mod:`preempt.health` and the
leaves. Never the CLI or the supervisor; nothing below imports the run (import-linter contracts in pyproject.toml).
"""
