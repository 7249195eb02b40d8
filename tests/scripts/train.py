"""A small real training driven by the process tests.

Prints one line per step (``step N epoch E batch B``) so that a test can signal
it at a chosen moment, and on completion writes every tensor of the final
state (model, optimizer, scheduler, RNG, the loss history) to --final_out.
"""

from __future__ import annotations

import signal
import sys

if "--block_signals" in sys.argv:  # first, before seconds of imports and any thread: see preempt.cluster.signals
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2])

import argparse  # noqa: E402  (after the signal mask, on purpose)
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np
import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from preempt import PreemptibleRun, _testing
from preempt.checkpoint import cancel, commit


class Synthetic(Dataset):
    """Deterministic features and labels; optional random augmentation in __getitem__."""

    def __init__(self, n: int, dim: int, augment: bool, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g)
        self.y = (self.x[:, 0] + 0.5 * self.x[:, 1] > 0).long()
        self.augment = augment

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        x = self.x[i]
        if self.augment:  # draws from the global RNGs of whichever process loads
            x = x + 0.01 * torch.randn_like(x) + 0.001 * random.random() + 0.001 * float(np.random.rand())
        return x, self.y[i]


class Stream(IterableDataset):
    """The same samples as a stream: worker w of n yields indices w, w + n, ... (augmented as Synthetic does)."""

    def __init__(self, data: Synthetic) -> None:
        self.data = data
        self.pos = 0  # samples this copy (one per worker) has yielded this epoch
        self._start = 0

    def __iter__(self):
        info = get_worker_info()
        w, n = (info.id, info.num_workers) if info is not None else (0, 1)
        shard = range(w, len(self.data), n)
        start, self._start = self._start, 0
        for k in range(start, len(shard)):
            self.pos = k + 1  # before the yield: a state taken after this sample has been handed out counts it
            yield self.data[shard[k]]


class StatefulStream(Stream):
    """A stream that can seek: the state_dict/load_state_dict protocol of torchdata's Stateful."""

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self._start = int(state["pos"])


class EpochStream(StatefulStream):
    """--iterable epochs: a stream whose order within each worker's shard changes with the epoch, told by set_epoch
    (the convention of DistributedSampler and Hugging Face's datasets). The loop calls set_epoch in the main process,
    as a user does; only the run can reach the copies that persistent workers keep."""

    def __init__(self, data: Synthetic) -> None:
        super().__init__(data)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        info = get_worker_info()
        w, n = (info.id, info.num_workers) if info is not None else (0, 1)
        shard = range(w, len(self.data), n)
        order = torch.randperm(len(shard), generator=torch.Generator().manual_seed(self.epoch)).tolist()
        start, self._start = self._start, 0
        for k in range(start, len(shard)):
            self.pos = k + 1
            yield self.data[shard[order[k]]]


class EvalSet(Dataset):
    """--eval_loader_every: 64 samples of their own; with --eval_hold DIR, the worker that fetches sample 0 of this
    process's first evaluation prints ``holding in an evaluation worker`` and waits there until DIR/go exists."""

    def __init__(self, dim: int, hold: str | None) -> None:
        self.data = Synthetic(64, dim, augment=False, seed=4321)
        self.hold = hold

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        if self.hold is not None and i == 0:
            reached = Path(self.hold) / "eval_reached"
            if not reached.exists():
                reached.touch()
                print("holding in an evaluation worker", flush=True)
                _testing.emit("holding", point="evaluation worker", n=1)
                deadline = time.monotonic() + HOLD_LIMIT_S
                while not (Path(self.hold) / "go").exists() and time.monotonic() < deadline:
                    time.sleep(0.005)
        return self.data[i]


def evaluate_loader(model: torch.nn.Module, loader: DataLoader) -> float:
    """The mean loss over the evaluation loader, dropout off (the loader's iterator is made here, between steps)."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in loader:
            total += float(classify_loss(model, x, y)) * len(y)
            count += len(y)
    model.train()
    return total / count


class Adapted(torch.nn.Linear):
    """A frozen linear layer with a LoRA adapter injected by hand inside it (not a PeftModel): the adapter's two
    matrices are parameters of the base module itself, so the model is passed whole, frozen and trained tensors
    side by side in one state_dict."""

    def __init__(self, n_in: int, n_out: int, rank: int = 4) -> None:
        super().__init__(n_in, n_out)
        self.requires_grad_(False)
        self.lora_a = torch.nn.Parameter(torch.randn(rank, n_in) * 0.01)
        self.lora_b = torch.nn.Parameter(torch.zeros(n_out, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


def lora_model(dim: int, width: int) -> torch.nn.Module:
    """--lora: a frozen base of ~4 MiB (width 1024) with adapters inside it, a BatchNorm whose running statistics
    change at every step, and a trained head."""
    return torch.nn.Sequential(
        Adapted(dim, width),
        torch.nn.BatchNorm1d(width),
        torch.nn.ReLU(),
        Adapted(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 2),
    )


VOCAB = 1000  # --peft: token ids drawn from [0, VOCAB)


class Tokens(Dataset):
    """--peft: random token sequences from a seeded generator; each is its own target (a language model's loss)."""

    def __init__(self, n: int, length: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, VOCAB, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return self.ids[i], self.ids[i]


def peft_model(width: int, length: int) -> torch.nn.Module:
    """--peft: a tiny Hugging Face GPT-2 built from its config (no download; dropout on, so the RNG matters) wrapped
    whole by peft (LoRA on every c_attn): a PeftModel, base frozen and adapters inside it, the tied embedding and
    head among the frozen tensors. Imported here: peft and transformers are needed by this option alone."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2, n_embd=width, n_head=4, vocab_size=VOCAB, n_positions=length, bos_token_id=0, eos_token_id=0
    )
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=["c_attn"], fan_in_fan_out=True)
    return get_peft_model(GPT2LMHeadModel(config), lora)


def classify_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(x), y)


def lm_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """--peft: the next-token loss, as transformers computes it from the labels."""
    return model(input_ids=x, labels=y).loss


def evaluate(model: torch.nn.Module, loss_of, data: Dataset) -> float:
    """--eval_every, --eval_epoch: the loss on a fixed validation set (the first 64 samples, no augmentation drawn),
    in eval mode; draws nothing from the RNGs. Reaches the loop point "eval" first."""
    reached("eval")
    model.eval()
    with torch.no_grad():
        x, y = zip(*(data[i] for i in range(min(64, len(data)))), strict=True)
        loss = loss_of(model, torch.stack(x), torch.stack(y)).item()
    model.train()
    return loss


def flatten(prefix: str, tree, out: dict) -> None:
    if isinstance(tree, torch.Tensor):
        out[prefix] = tree.detach().clone().contiguous()
    elif isinstance(tree, dict):
        for k, v in tree.items():
            flatten(f"{prefix}.{k}", v, out)
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            flatten(f"{prefix}.{i}", v, out)
    elif isinstance(tree, (int, float, bool)):
        out[prefix] = torch.tensor(float(tree), dtype=torch.float64)


def slow_commit(seconds: float):
    """--slow_commit: each commit sleeps this long before its manifest."""

    def action(point: str, n: int) -> None:
        if point == "before_manifest" and seconds:
            time.sleep(seconds)

    return action


def mirror_kill(spec: str) -> None:
    """--mirror_kill_at STAGE:STEP: the mirror's uploader SIGKILLs this process at STAGE of checkpoint STEP's
    upload (preempt.mirror.uploader.STAGES: "after_first_object" is after its first data object, before its
    manifest), printing ``mirror_kill STAGE STEP`` first."""
    stage, step = spec.split(":")

    def hook(at: str, at_step: int) -> None:
        if (at, at_step) == (stage, int(step)):
            print(f"mirror_kill {at} {at_step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    _testing.install("upload", hook)


def lazy_copy_at_stop() -> None:
    """--lazy_copy_at_stop: the writer makes a lazy snapshot's copies only after the loop has left the run.step()
    that took it (the "saved" point) and a SIGTERM it sends the process then has reached the run; meanwhile the
    loop's next optimizer.step() waits for those copies. Says when it sends the signal."""
    from preempt.checkpoint.staging import LazyCopy

    run = LazyCopy.run
    left_the_step = threading.Event()

    def at_stop(self) -> None:
        left_the_step.wait(HOLD_LIMIT_S)
        print("lazy_copy_signals SIGTERM", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        wait_for_stop()
        run(self)

    LazyCopy.run = at_stop
    act(lambda point, n: left_the_step.set() if point == "saved" else None)


# Named points of this process where a test acts (--signal_at, --hold_at, --settle_at, --slow_commit): the commit's
# stages (preempt.checkpoint.commit.STAGES, on the writer's thread for a background save), "load" (a checkpoint file
# is about to be read and verified), "discard" (a failed or cancelled write's temporary directory is about to be
# removed), and the loop's own: "step" (inside a step's work, before run.step()), "saved" (right after a run.step()
# that took a checkpoint: staged, for a background save), "epoch_end" (in end-of-epoch code) and "eval" (inside an
# evaluation of --eval_every or --eval_epoch). Each is counted from 1 in this process.
LOOP_POINTS = ("step", "saved", "epoch_end", "eval")
POINTS = (*commit.STAGES, "load", "discard", *LOOP_POINTS)
HOLD_LIMIT_S = 120.0  # a hold that nothing releases ends here, and the test that set it fails on what follows
_counts: dict[str, int] = {}
_counts_lock = threading.Lock()
_writing = threading.local()  # the commit stage's cancel event, per writing thread
_actions: list = []
_runs: list[PreemptibleRun] = []  # the run, once entered: a hold waits for its stop flag


def reached(point: str) -> None:
    """Counts ``point`` and does there what the options asked."""
    with _counts_lock:
        n = _counts[point] = _counts.get(point, 0) + 1
    for action in _actions:
        action(point, n)


def wait_for_stop(run=None) -> None:
    """Waits until ``run`` (default: this script's) has been asked to stop (the test's signal, or one this process
    sent itself), at most HOLD_LIMIT_S: the state is reached by the signal, the short polls only let its handler run
    in the main thread. The other training scripts of the suite hold with this too."""
    deadline = time.monotonic() + HOLD_LIMIT_S
    while time.monotonic() < deadline:
        held = run if run is not None else (_runs[0] if _runs else None)
        if held is not None and held.stop_requested:
            return
        time.sleep(0.005)


def _parse(option: str, item: str, fields: int) -> list[str]:
    parts = item.split(":")
    if len(parts) < fields or parts[0] not in POINTS:
        raise SystemExit(
            f"{option}: expected POINT:N{':SIG' * (fields == 3)}[...] with POINT in {POINTS}, got {item!r}"
        )
    return parts


def signal_at(spec: str) -> None:
    """``POINT:N:SIG[:until_cancelled][,...]``: send this process a real SIG the N-th time it reaches POINT.

    The signal is real (``os.kill``); SIGKILL ends the process right there. ``until_cancelled`` (a commit stage
    before the rename, in a background write): after the signal, the writer waits there until the run cancels its
    write, so that the loop's decision, not the writer's speed, settles what happens to it.
    """
    plan = []
    for item in spec.split(","):
        point, n, sig, *rest = _parse("--signal_at", item, 3)
        plan.append((point, int(n), signal.Signals[f"SIG{sig}"], rest == ["until_cancelled"]))

    def action(point: str, n: int) -> None:
        for at, count, sig, until_cancelled in plan:
            if (at, count) == (point, n):
                print(f"signal_at {point} {n} {sig.name}", flush=True)
                _testing.emit("signal_at", point=point, n=n, signal=sig.name)
                os.kill(os.getpid(), sig)
                if until_cancelled:
                    event = getattr(_writing, "cancel", None)
                    if event is not None and event.wait(HOLD_LIMIT_S):
                        cancel.check_cancelled()  # raises WriteCancelled: the run cancelled this write
                    print(f"signal_at {point} {n}: the write was never cancelled", flush=True)

    act(action)


def hold_at(spec: str) -> None:
    """``POINT:N[,...]``: the N-th time this process reaches POINT, it prints ``holding at POINT N`` and waits
    there until the run has been asked to stop (a signal from the test), however slow or fast the machine."""
    plan = {(point, int(n)) for point, n, *_ in (_parse("--hold_at", item, 2) for item in spec.split(","))}

    def action(point: str, n: int) -> None:
        if (point, n) not in plan:
            return
        print(f"holding at {point} {n}", flush=True)
        _testing.emit("holding", point=point, n=n, pid=os.getpid())
        wait_for_stop()
        print(f"released at {point} {n}", flush=True)

    act(action)


def wait_file_at(spec: str) -> None:
    """``POINT:N:FILE[,...]``: the N-th time this process reaches POINT, it prints ``waiting at POINT N`` and waits
    there until FILE exists (made by the test once it has done what must happen meanwhile), at most HOLD_LIMIT_S."""
    plan = {}
    for item in spec.split(","):
        point, n, *path = _parse("--wait_file_at", item, 3)
        plan[(point, int(n))] = ":".join(path)

    def action(point: str, n: int) -> None:
        path = plan.get((point, n))
        if path is None:
            return
        print(f"waiting at {point} {n}", flush=True)
        _testing.emit("waiting", point=point, n=n)
        wait_for_file(path)
        print(f"went on at {point} {n}", flush=True)

    act(action)


def wait_for_file(path: str) -> None:
    """Until ``path`` exists (the test makes it once it has done what must happen meanwhile), at most HOLD_LIMIT_S:
    the wait ends on the test's event, the short polls only look for it."""
    deadline = time.monotonic() + HOLD_LIMIT_S
    while not os.path.exists(path):
        if time.monotonic() >= deadline:  # the test never made it: say so, for the failure that follows
            print(f"train.py: {path} did not appear in {HOLD_LIMIT_S:g} s (HOLD_LIMIT_S); going on", file=sys.stderr)
            return
        time.sleep(0.01)


def settle_at(spec: str) -> None:
    """``POINT:N[,...]``: the N-th time this process reaches POINT (a loop point), the loop waits there until the
    background write in flight is durable (``run.wait_for_checkpoint()``), so that the next save is taken when it
    is due instead of being postponed behind a write that a busy machine made slow."""
    plan = {(point, int(n)) for point, n, *_ in (_parse("--settle_at", item, 2) for item in spec.split(","))}

    def action(point: str, n: int) -> None:
        if (point, n) in plan:
            if point not in LOOP_POINTS:
                raise SystemExit(f"--settle_at {point}:{n}: the loop waits only at a loop point {LOOP_POINTS}")
            path = _runs[0].wait_for_checkpoint(HOLD_LIMIT_S)
            print(f"settled at {point} {n}: {path.name if path else None} durable", flush=True)

    act(action)


def act(action) -> None:
    """Adds ``action(point, n)`` to what :func:`reached` does; the first one routes the commit's stages and the
    loads of checkpoint files through it (any script that imports this module: train_ddp.py too)."""
    _actions.append(action)
    if len(_actions) > 1:
        return

    def at_commit(stage: str, cancel: threading.Event | None) -> None:
        _writing.cancel = cancel  # the event that cancels this thread's write, for until_cancelled
        reached(stage)

    _testing.install("commit", at_commit)
    _testing.install("load", lambda path: reached("load"))


def _number_or_text(value: str) -> float | str:
    try:
        return float(value)
    except ValueError:
        return value


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--save_dir", required=True)
    p.add_argument("--final_out", default=None)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--dim", type=int, default=32, help="features per sample; with --peft, tokens per sample")
    p.add_argument("--width", type=int, default=64, help="hidden width; with --peft, GPT-2's n_embd")
    p.add_argument("--num_workers", type=int, default=0)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--augment", action="store_true")
    p.add_argument("--persistent_workers", action="store_true")
    p.add_argument("--no_per_sample_rng", action="store_true", help="run.sampler(per_sample_rng=False)")
    p.add_argument(
        "--iterable", choices=["stateful", "plain", "epochs"], default=None, help="an IterableDataset, no sampler"
    )
    p.add_argument("--onecycle", action="store_true", help="OneCycleLR instead of StepLR")
    p.add_argument("--clip", type=float, default=None, help="clip the gradients' norm (after unscaling)")
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--interval", type=float, default=None)
    p.add_argument("--every_steps", type=int, default=None)
    p.add_argument("--keep_last", type=int, default=2)
    p.add_argument("--step_sleep", type=float, default=0.0)
    p.add_argument("--first_step_sleep", type=float, default=0.0, help="sleep in the first step of each process")
    p.add_argument("--epoch_end_sleep", type=float, default=0.0)
    p.add_argument("--no_auto_resume", action="store_true")
    p.add_argument("--slow_commit", type=float, default=0.0, help="sleep this long before each manifest is written")
    p.add_argument("--signal_at", default=None, help="POINT:N:SIG[:until_cancelled][,...], see signal_at()")
    p.add_argument("--settle_at", default=None, help="POINT:N[,...]: wait there for the write in flight")
    p.add_argument("--hold_at", default=None, help="POINT:N[,...]: wait there for a stop signal, see hold_at()")
    p.add_argument("--wait_file_at", default=None, help="POINT:N:FILE[,...]: wait there for FILE, see wait_file_at()")
    p.add_argument("--time_limit", default=None, help="PreemptibleRun(time_limit=): seconds or [D-]HH:MM:SS")
    p.add_argument("--max_restarts", type=int, default=None)
    p.add_argument("--sync_save", action="store_true", help="PreemptibleRun(async_save=False)")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--nan_at", type=int, default=None, help="attempt 1 under preempt supervise: 'Loss is NaN', exit 1")
    p.add_argument(
        "--kill_at_step",
        default=None,
        help="STEP:SIG[,...]: send this process a real SIG once run.step() made STEP (in the order given)",
    )
    p.add_argument("--metrics", action="store_true", help="run.step(metrics={'loss': ...})")
    p.add_argument("--eval_every", type=int, default=None, help="run.report({'val_loss': ...}) after run.step()")
    p.add_argument("--eval_epoch", action="store_true", help="run.report({'val_loss': ...}) at each epoch's end")
    p.add_argument("--best", action="store_true", help="PreemptibleRun(best_metric='val_loss', keep_best=1)")
    p.add_argument("--report_epoch_end", action="store_true", help="run.report({'epoch_draw': ...}) at each epoch end")
    p.add_argument("--loggers", default=None, help="tensorboard,wandb: PreemptibleRun(loggers=[...])")
    p.add_argument(
        "--eval_loader_every",
        type=int,
        default=None,
        help="evaluate on a DataLoader (EvalSet) after every N-th run.step()",
    )
    p.add_argument("--eval_workers", type=int, default=2, help="the evaluation DataLoader's num_workers")
    p.add_argument("--eval_persistent", action="store_true", help="the evaluation DataLoader's persistent_workers")
    p.add_argument("--eval_hold", default=None, help="DIR: hold inside the first evaluation, see EvalSet")
    p.add_argument("--progress_every_s", type=float, default=None)
    p.add_argument("--no_recycle", action="store_true", help="PreemptibleRun(recycle_files=False)")
    p.add_argument("--lazy_copy_at_stop", action="store_true", help="lazy_snapshot=True, see lazy_copy_at_stop()")
    p.add_argument("--lora", action="store_true", help="a frozen base with adapters inside it (lora_model)")
    p.add_argument(
        "--block_signals",
        action="store_true",
        help="SIGTERM/USR1/USR2 blocked from the first statement: a stop during the imports is pending until the run"
        " installs its handlers (read from sys.argv before any import)",
    )
    p.add_argument("--peft", action="store_true", help="a PeftModel passed whole (peft_model), language-model data")
    p.add_argument("--carry_limit", type=int, default=None, help="PreemptibleRun(carry_unchanged=CarryOptions(...))")
    p.add_argument("--no_carry", action="store_true", help="PreemptibleRun(carry_unchanged=False)")
    p.add_argument("--mirror", default=None, help="PreemptibleRun(mirror=URL)")
    p.add_argument("--mirror_options", "--options", default=None, help="PreemptibleRun(mirror_options=json.loads())")
    p.add_argument("--mirror_deadline", type=float, default=None, help="PreemptibleRun(mirror_deadline=)")
    p.add_argument("--mirror_kill_at", default=None, help="STAGE:STEP: SIGKILL in the mirror's upload, see mirror_kill")
    args = p.parse_args()
    if args.lazy_copy_at_stop:
        lazy_copy_at_stop()
    if args.signal_at:
        signal_at(args.signal_at)
    if args.settle_at:  # first: at a point where the loop also holds or waits, the write in flight ends before
        settle_at(args.settle_at)
    if args.hold_at:
        hold_at(args.hold_at)
    if args.wait_file_at:
        wait_file_at(args.wait_file_at)
    if args.slow_commit:
        act(slow_commit(args.slow_commit))

    torch.set_num_threads(1)
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    data = Tokens(args.samples, args.dim) if args.peft else Synthetic(args.samples, args.dim, args.augment)
    loss_of = lm_loss if args.peft else classify_loss
    if args.peft:
        model = peft_model(args.width, args.dim)
    elif args.lora:
        model = lora_model(args.dim, args.width)
    else:
        model = torch.nn.Sequential(
            torch.nn.Linear(args.dim, args.width),
            torch.nn.ReLU(),
            torch.nn.Dropout(args.dropout),
            torch.nn.Linear(args.width, 2),
        )
    trained = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(trained, lr=args.lr, weight_decay=0.01)
    if args.onecycle:
        per_epoch = -(-args.samples // args.batch_size) // args.accum
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * per_epoch + 1)
    else:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=5)

    walltime = {}  # only when asked for: the other options also run against older installs
    if args.time_limit is not None:
        walltime["time_limit"] = _number_or_text(args.time_limit)
    if args.max_restarts is not None:
        walltime["max_restarts"] = args.max_restarts
    if args.sync_save:
        walltime["async_save"] = False
    if args.progress_every_s is not None:
        walltime["progress_every_s"] = args.progress_every_s
    if args.no_recycle:
        walltime["recycle_files"] = False
    if args.lazy_copy_at_stop:
        walltime["lazy_snapshot"] = True
    if args.carry_limit is not None:
        from preempt.checkpoint.carry import CarryOptions

        walltime["carry_unchanged"] = CarryOptions(carry_limit=args.carry_limit)
    if args.no_carry:
        walltime["carry_unchanged"] = False
    if args.best:
        walltime |= {"best_metric": "val_loss", "keep_best": 1}
    if args.mirror:
        walltime["mirror"] = args.mirror
        if args.mirror_options:
            walltime["mirror_options"] = json.loads(args.mirror_options)
        if args.mirror_deadline is not None:
            walltime["mirror_deadline"] = args.mirror_deadline
    if args.mirror_kill_at:
        mirror_kill(args.mirror_kill_at)
    loggers = []
    for name in (args.loggers or "").split(","):
        if name == "tensorboard":  # an object, so that a kill below can flush its events first
            from preempt.health.loggers import TensorBoard

            loggers.append(TensorBoard())
        elif name:
            loggers.append(name)
    if loggers:
        walltime["loggers"] = loggers
    kills = [
        (int(step), sig) for step, sig in (item.split(":") for item in (args.kill_at_step or "").split(",") if item)
    ]
    with PreemptibleRun(
        args.save_dir,
        model=model,
        optimizer=opt,
        scheduler=sched,
        scaler=scaler,
        checkpoint_interval=args.interval,
        checkpoint_every_steps=args.every_steps,
        keep_last=args.keep_last,
        auto_resume=not args.no_auto_resume,
        **walltime,
    ) as run:
        _runs.append(run)
        run.user_state.setdefault("losses", [])
        workers = {"num_workers": args.num_workers, "persistent_workers": args.persistent_workers}
        if args.iterable:
            stream = {"stateful": StatefulStream, "plain": Stream, "epochs": EpochStream}[args.iterable](data)
            loader = DataLoader(stream, batch_size=args.batch_size, **workers)
        else:
            sampler = run.sampler(data, shuffle=True, seed=7, per_sample_rng=not args.no_per_sample_rng)
            loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, **workers)
        eval_loader = None
        if args.eval_loader_every:  # made inside the run, iterated between run.step() calls by the loop itself
            eval_loader = DataLoader(
                EvalSet(args.dim, args.eval_hold),
                batch_size=16,
                num_workers=args.eval_workers,
                persistent_workers=args.eval_persistent,
            )
        lr = opt.param_groups[0]["lr"]
        print(f"start step {run.global_step} epoch {run.epoch} batch {run.batch} lr {lr!r}", flush=True)
        _testing.emit("entered", step=run.global_step, epoch=run.epoch, batch=run.batch, lr=lr)
        first_attempt = os.environ.get("PREEMPT_SUPERVISE_ATTEMPT") == "1"
        started_at = run.global_step
        saved_at = -1  # the step of the last checkpoint taken by this process
        for epoch in run.epochs(args.epochs):
            micro = 0
            if callable(getattr(loader.dataset, "set_epoch", None)):
                loader.dataset.set_epoch(epoch)  # what a user writes (it reaches the main process's copy only)
            for x, y in run.batches(loader):
                if first_attempt and run.global_step + 1 == args.nan_at:
                    print(f"step {run.global_step + 1}: Loss is NaN", flush=True)
                    sys.exit(1)
                noise = torch.randn(()) * 1e-3  # the loop's own draw from the global RNG
                loss = loss_of(model, x, y) + noise
                scaler.scale(loss / args.accum).backward()
                micro += 1
                if micro % args.accum:
                    continue
                if args.clip is not None:
                    scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(trained, args.clip)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                sched.step()
                run.user_state["losses"].append(loss.item())
                if args.step_sleep:
                    time.sleep(args.step_sleep)
                if args.first_step_sleep and run.global_step == started_at:
                    time.sleep(args.first_step_sleep)
                reached("step")
                print(f"step {run.global_step + 1} epoch {epoch} batch {run.batch}", flush=True)
                _testing.emit("step", step=run.global_step + 1, epoch=epoch, batch=run.batch)
                run.step(metrics={"loss": loss.item()} if args.metrics else None)
                if run.last_save is not None and run.last_save.step == run.global_step != saved_at:
                    saved_at = run.global_step
                    reached("saved")
                if eval_loader is not None and run.global_step % args.eval_loader_every == 0:
                    print(f"eval at step {run.global_step}", flush=True)
                    _testing.emit("eval", step=run.global_step)
                    val = evaluate_loader(model, eval_loader)
                    run.user_state.setdefault("val_losses", []).append(val)
                    run.report({"val_loss": val})
                for kill_step, kill_sig in kills:  # each handler runs before the next kill is sent
                    if run.global_step == kill_step:
                        print(f"kill_at_step {kill_step} {kill_sig}", flush=True)
                        for logger in loggers:  # what was logged so far is on disk, as after a longer run
                            if getattr(logger, "writer", None) is not None:
                                logger.writer.flush()
                        os.kill(os.getpid(), signal.Signals[f"SIG{kill_sig}"])
                if args.eval_every and run.global_step % args.eval_every == 0:  # evaluation after run.step()
                    run.report({"val_loss": evaluate(model, loss_of, data)})
                    print(f"reported val_loss at step {run.global_step}", flush=True)
                    _testing.emit("reported", step=run.global_step, epoch_end=False)
            if args.eval_epoch:
                run.report({"val_loss": evaluate(model, loss_of, data)})
                print(f"reported val_loss at step {run.global_step} (epoch {epoch}'s end)", flush=True)
                _testing.emit("reported", step=run.global_step, epoch_end=True)
            # end-of-epoch code that draws from the RNG, like a validation loader would
            run.user_state.setdefault("epoch_draws", []).append(float(torch.rand(())))
            if args.report_epoch_end:
                run.report({"epoch_draw": run.user_state["epoch_draws"][-1]})
            print(f"epoch_end {epoch}", flush=True)
            _testing.emit("epoch_end", epoch=epoch)
            reached("epoch_end")
            if args.epoch_end_sleep:
                time.sleep(args.epoch_end_sleep)

    if os.environ.get("SLURM_JOB_ID"):
        # The run is complete and its final checkpoint durable. SLURM sends a time-limit warning 0-30 s earlier
        # than --signal asks, so in the one-minute test jobs it can land in the second between here and the
        # process's exit, where SIGTERM's default action would turn a finished job into FAILED (exit 143).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.final_out:
        out: dict[str, torch.Tensor] = {}
        flatten("model", model.state_dict(), out)
        flatten("optimizer", opt.state_dict(), out)
        flatten("scheduler", sched.state_dict(), out)
        flatten("scaler", scaler.state_dict(), out)
        out["rng.torch"] = torch.get_rng_state()
        out["rng.numpy"] = torch.from_numpy(np.random.get_state()[1].astype(np.int64))
        out["rng.python"] = torch.tensor(random.getstate()[1], dtype=torch.int64)
        out["losses"] = torch.tensor(run.user_state["losses"], dtype=torch.float64)
        out["epoch_draws"] = torch.tensor(run.user_state["epoch_draws"], dtype=torch.float64)
        if "val_losses" in run.user_state:
            out["val_losses"] = torch.tensor(run.user_state["val_losses"], dtype=torch.float64)
        save_file(out, args.final_out, metadata={"steps": json.dumps(run.global_step)})
    print("done", flush=True)


if __name__ == "__main__":
    sys.exit(main())
