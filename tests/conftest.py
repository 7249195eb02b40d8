"""Shared fixtures: a training process that tests start, signal and rerun, and the bit-exact comparison.

The resume-equivalence check is written once here (``run_interrupted`` plus
``assert_same_final``) and parametrised by the tests.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import forkserver
import pytest
import rank_launcher
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
TRAIN = Path(__file__).resolve().parent / "scripts" / "train.py"
TRAIN_DDP = Path(__file__).resolve().parent / "scripts" / "train_ddp.py"
RANK_LAUNCHER = Path(__file__).resolve().parent / "rank_launcher.py"
DDP_ARGS = ["--epochs", "2", "--samples", "192", "--every_steps", "4"]  # 12 steps per epoch on 2 ranks, 24 in all
PREEMPTED = 75

# Every process a test starts imports preempt from this checkout, whatever the installed (editable) copy points at:
# a suite run in one clone must not test another clone's code.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


# The order in which pytest-xdist hands out the test files (.ci/run: one file per worker at a time, in collection
# order with --no-loadscope-reorder): the tiers whose files run longest first, the many short unit files last, so
# that the workers end together. xdist's own order (files with the most tests first) left a two-to-three-minute file
# with one or two trials (the two-node SLURM job, the README's demo) to the very end, run by one worker alone.
TIERS_LONGEST_FIRST = ("slurm", "distributed", "process", "faults", "gpu", "unit")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def tier(item: pytest.Item) -> int:
        parts = item.path.relative_to(ROOT / "tests").parts
        return TIERS_LONGEST_FIRST.index(parts[0]) if parts[0] in TIERS_LONGEST_FIRST else len(TIERS_LONGEST_FIRST)

    items.sort(key=tier)  # stable: the files of a tier, and the tests of a file, keep their order


class Spawned:
    """A child process whose merged stdout/stderr is collected line by line by a thread."""

    def __init__(self, cmd: Sequence[str], env: dict[str, str] | None = None, *, session: bool = False) -> None:
        """``session``: the child leads a session and process group of its own, which a test may signal whole
        (``os.killpg(p.proc.pid, sig)``, as ``timeout`` and SLURM do) without signalling pytest."""
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen | forkserver.Forked
        if forkserver.forkable(cmd, full_env):  # python script.py / python -m module: forked from a server with torch
            self.proc = forkserver.start(cmd, full_env, ROOT, session=session)
        else:
            self.proc = subprocess.Popen(
                list(cmd),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=full_env,
                cwd=ROOT,
                start_new_session=session,
            )
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float = 60.0, count: int = 1) -> bool:
        """Blocks until ``count`` lines matching ``pattern`` (regex) appeared; False if the process ended first."""
        rx = re.compile(pattern)
        seen = found = 0
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    found += bool(rx.search(line))
                    if found >= count:
                        return True
                seen = len(self.lines)
                if self.proc.poll() is not None and not self._reader.is_alive():
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no line matching {pattern!r} within {timeout} s:\n{self.output}")
                self._cond.wait(min(left, 0.05))

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def finish(self, timeout: float = 120.0) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"process did not finish within {timeout} s:\n{self.output}") from None
        self._reader.join(10)
        return rc

    @property
    def output(self) -> str:
        with self._cond:
            return "\n".join(self.lines)


def run_python(
    cmd: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    cwd: Path | str | None = None,
    timeout: float | None = None,
    errors: str = "strict",
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, capture_output=True, text=True, ...)``; forked from a server that has torch when ``cmd``
    is ``python script.py ...``, ``python -m module ...`` or ``python -c code ...`` (tests/forkserver.py)."""
    env = dict(os.environ if env is None else env)
    cwd = os.getcwd() if cwd is None else cwd
    if forkserver.forkable(cmd, env):
        return forkserver.run(cmd, env, cwd, timeout=timeout, errors=errors)
    return subprocess.run(list(cmd), capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout, errors=errors)


@pytest.fixture
def sigint_handled():
    """SIGINT with Python's KeyboardInterrupt handler for this test and the processes it starts.

    A background job of a non-interactive shell (``pytest &`` in a script) inherits SIGINT ignored, and the
    library rightly keeps an ignored SIGINT ignored (preempt.cluster.signals). Tests of what Ctrl+C does need it
    handled, as in a terminal; children started meanwhile get it at its default (exec resets a handler).
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def train_cmd(save_dir: Path, final_out: Path | None, args: Sequence[str]) -> list[str]:
    cmd = [sys.executable, str(TRAIN), "--save_dir", str(save_dir), *args]
    if final_out is not None:
        cmd += ["--final_out", str(final_out)]
    return cmd


@dataclass(frozen=True)
class StoppedRun:
    """A run stopped once, made by a module fixture and shared by its tests: each copies ``save_dir`` before it
    resumes (``copy_to``), and reads what the stopped processes printed from ``output``."""

    save_dir: Path
    output: str

    def copy_to(self, save_dir: Path) -> Path:
        shutil.copytree(self.save_dir, save_dir, symlinks=True)
        return save_dir


@dataclass
class Interrupt:
    """Start the training (with ``args`` added for this process only), wait for ``after`` (a regex), wait ``delay``
    s more, send ``sig``. A test that needs the signal to land at a given point holds the process there
    (``args=("--hold_at", POINT)``, ``after=r"^holding at POINT"``) instead of counting on a delay."""

    after: str = r"^start "
    delay: float = 0.0
    sig: int = signal.SIGTERM
    args: Sequence[str] = ()


def in_step(k: int, sig: int = signal.SIGTERM) -> Interrupt:
    """``sig`` while the process holds inside the work of its own k-th step (before that step's ``run.step()``):
    a SIGTERM stops it at that step's safe point, however fast or slow the machine."""
    return Interrupt(after=rf"^holding at step {k}$", sig=sig, args=("--hold_at", f"step:{k}"))


@dataclass
class History:
    """Return codes and outputs of every process of one interrupted run."""

    codes: list[int] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "\n----\n".join(self.outputs)

    def count(self, pattern: str) -> int:
        return len(re.findall(pattern, self.text, flags=re.M))


def run_interrupted(
    save_dir: Path,
    final_out: Path,
    args: Sequence[str],
    interrupts: Sequence[Interrupt],
    env: dict[str, str] | None = None,
    between: Callable[[int], None] | None = None,
    max_reruns: int = 4,
) -> History:
    """Runs the training, interrupting it as listed, then reruns it until it completes (exit 0)."""
    history = History()
    for i, it in enumerate(interrupts):
        p = Spawned(train_cmd(save_dir, final_out, [*args, *it.args]), env)
        if p.wait_for(it.after):
            if it.delay:
                time.sleep(it.delay)
            p.signal(it.sig)
        rc = p.finish()
        history.codes.append(rc)
        history.outputs.append(p.output)
        if rc == 0:
            break
        if between is not None:
            between(i)
    for _ in range(max_reruns):
        if history.codes and history.codes[-1] == 0:
            break
        p = Spawned(train_cmd(save_dir, final_out, args), env)
        history.codes.append(p.finish())
        history.outputs.append(p.output)
    assert history.codes[-1] == 0, f"the training never completed: codes {history.codes}\n{history.text}"
    return history


def assert_same_final(expected: Path, actual: Path) -> None:
    """Every tensor of the final state equal under torch.equal (bit for bit)."""
    a, b = load_file(str(expected)), load_file(str(actual))
    assert a.keys() == b.keys(), f"different state keys: {sorted(a.keys() ^ b.keys())}"
    differing = [k for k in sorted(a) if not torch.equal(a[k], b[k])]
    assert not differing, f"{len(differing)} of {len(a)} tensors differ from the uninterrupted run: {differing[:8]}"


MiB = 1 << 20


def flip_bit(path: Path) -> None:
    """One bit flipped in the middle of a file, in place: every name of its inode (every checkpoint that carries
    it, :mod:`preempt.checkpoint.carry`) sees it."""
    at = os.stat(path).st_size // 2
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x40]))


def checkpoint_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every tensor file of a checkpoint (every rank's too), keyed ``file:key``."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        out.update({f"{f.name}:{k}": v for k, v in load_file(str(f)).items()})
    return out


def model_and_optimizer_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Copies of a model's and its optimizer's tensors, named ``model.KEY`` and ``opt.PARAM.KEY``."""
    out = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for pid, s in opt.state_dict()["state"].items():
        out.update({f"opt.{pid}.{k}": v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)})
    return out


def read_into(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The checkpoint at ``path`` applied to a fresh ``model`` and ``opt``: their tensors, as
    :func:`model_and_optimizer_tensors` names them."""
    from preempt import CheckpointManager
    from preempt.checkpoint import state

    manager = CheckpointManager(path.parent, owner=False)
    info = next(c for c in manager.list() if c.path == path)
    state.apply(state.Components(model, opt), manager.read(info))
    return model_and_optimizer_tensors(model, opt)


def changed_bytes(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> int:
    """The bytes of the tensors that differ between two checkpoints (or are new)."""
    return sum(
        v.numel() * v.element_size() for k, v in after.items() if k not in before or not torch.equal(before[k], v)
    )


def assert_writes_what_changed(ckpts: Sequence[Path], carried: str = "base.safetensors") -> list[tuple[str, int, int]]:
    """Each checkpoint after the first (in order) lists ``carried`` as carried (``carried_from`` in its manifest) and
    wrote at most twice the bytes of the tensors that changed since the one before, plus 1 MiB (JSON, headers).

    Written: the bytes of the files whose inode no checkpoint before it in ``ckpts`` holds (a hard link writes
    nothing). Returns ``(name, written, changed)`` of each, for the test's report.
    """
    seen: set[int] = set()
    previous: dict[str, torch.Tensor] | None = None
    report: list[tuple[str, int, int]] = []
    for ckpt in ckpts:
        written = 0
        for f in ckpt.iterdir():
            st = os.stat(f)
            if st.st_ino not in seen:
                written += st.st_size
                seen.add(st.st_ino)
        now = checkpoint_tensors(ckpt)
        if previous is not None:
            files = json.loads((ckpt / "manifest.json").read_text())["files"]
            changed = changed_bytes(previous, now)
            report.append((ckpt.name, written, changed))
            assert files[carried].get("carried_from") is not None, (ckpt.name, files[carried], report)
            assert written <= 2 * changed + MiB, (ckpt.name, written, changed, report)
        previous = now
    return report


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Sequence[str]], Path]:
    """The final state of an uninterrupted run with the given arguments, computed once per argument list for the
    whole test run: under xdist the workers share it (the first to ask computes it under a lock on its file, the
    others wait and read it; an uninterrupted run ends bit for bit the same wherever it runs)."""
    import fcntl
    import hashlib

    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # one value for every worker of this run
    base = tmp_path_factory.getbasetemp()
    shared = base.parent / f"references-{run_id}" if run_id else base / "references"
    shared.mkdir(exist_ok=True)
    cache: dict[tuple[str, ...], Path] = {}

    def get(args: Sequence[str]) -> Path:
        key = tuple(args)
        if key not in cache:
            d = shared / hashlib.sha256("\0".join(key).encode()).hexdigest()[:20]
            d.mkdir(exist_ok=True)
            out = d / "final.safetensors"
            with open(d / "lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when this worker dies
                if not (d / "done").exists():
                    shutil.rmtree(d / "run", ignore_errors=True)  # a failed attempt's checkpoints: start fresh
                    p = Spawned(train_cmd(d / "run", out, args))
                    rc = p.finish()
                    assert rc == 0, p.output
                    (d / "done").write_text(" ".join(key))
            cache[key] = out
        return cache[key]

    return get


def direct_io_supported(directory: Path) -> bool:
    """Files in ``directory`` can be opened O_DIRECT (ext4, xfs; not every tmpfs): checkpoints there bypass the page
    cache; elsewhere they are written through it (preempt.checkpoint.direct_io), and a test says which it expects."""
    probe = directory / ".o_direct_probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
    except (AttributeError, OSError):  # no O_DIRECT on this OS, or refused here
        return False
    os.close(fd)
    probe.unlink()
    return True


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (where bind(0) and every outgoing connection draw theirs)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def port_slice(worker: str | None, workers: int, ephemeral_low: int, lowest: int = 20000) -> range:
    """The ports below the ephemeral range that one xdist worker (``gw<N>``; None when not under xdist) hands out:
    the range [lowest, ephemeral_low) cut into ``workers`` equal slices, so two workers never pick the same port.
    Empty where the ephemeral range starts too low to leave room."""
    index = int(worker[2:]) if worker and worker[2:].isdigit() else 0
    workers = max(workers, index + 1)
    size = max(ephemeral_low - lowest, 0) // workers
    return range(lowest + index * size, lowest + (index + 1) * size)


_ports = port_slice(
    os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), _ephemeral_low()
)
_turns = itertools.count(random.randrange(len(_ports)) if len(_ports) else 0)  # a random start, then in turn


def free_port() -> int:
    """A TCP port for a rendezvous or a MASTER_PORT that nothing else takes before the job binds it (the default
    29500 would collide between the jobs and processes of the suite).

    Not one the kernel hands out (bind to 0): that comes from the ephemeral range, where every outgoing connection
    draws its local port too (gloo's, a TCPStore client's, the other xdist worker's processes), and between the pick
    and torchrun's bind, seconds later in a SLURM job, one of them took it once in CI: torchrun's agent found the port
    busy, turned client of a stranger's socket and hung. So the port comes from below that range, from this worker's
    own slice (a random start, then in turn), and is checked to be bindable now."""
    for _ in range(len(_ports)):
        port = _ports[next(_turns) % len(_ports)]
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:  # in use, or in TIME_WAIT
                continue
            return port
    with socket.socket() as s:  # no room below the ephemeral range on this machine: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ranks_by_hand(save_dir: Path, final: Path | None, args: Sequence[str], nproc: int = 2) -> list[Spawned]:
    """train_ddp.py as ``nproc`` processes started without torchrun (MASTER_ADDR/PORT, RANK, WORLD_SIZE set
    here): no agent that kills the other ranks when one dies, as across the nodes of a job."""
    cmd = [sys.executable, str(TRAIN_DDP), "--save_dir", str(save_dir), *args]
    if final is not None:
        cmd += ["--final_out", str(final)]
    env = {"OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}  # ranks other than 0 log only errors
    env |= {"MASTER_PORT": str(free_port()), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc)}
    return [Spawned(cmd, {**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(nproc)]


def torchrun(
    save_dir: Path,
    final: Path | None,
    args: Sequence[str],
    nproc: int = 2,
    script: Path = TRAIN_DDP,
    env: dict[str, str] | None = None,
) -> Spawned:
    """``torchrun --standalone --nproc_per_node=N script --save_dir ... [--final_out ...]``.

    The agent starts each rank through ``tests/rank_launcher.py``, which forks ``python script ...`` from a fork server
    (see there) where the agent itself is forked from one."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    env = {"OMP_NUM_THREADS": "1", "PREEMPT_LOG_ALL_RANKS": "1", **(env or {})}  # each rank says where it stopped
    if forkserver.forkable(cmd, {**os.environ, **env}):
        env |= rank_launcher.servers_named()
        cmd.append(str(RANK_LAUNCHER))
    cmd += [str(script), "--save_dir", str(save_dir), *args]
    if final is not None:
        cmd += ["--final_out", str(final)]
    return Spawned(cmd, env)


def ddp_finals(final: Path, nproc: int = 2) -> list[dict[str, torch.Tensor]]:
    """What each rank of train_ddp.py wrote at the end (``final.rank<R>.safetensors``)."""
    return [load_file(str(final.with_suffix(f".rank{r}{final.suffix}"))) for r in range(nproc)]


def assert_equal_finals(want: list[dict[str, torch.Tensor]], got: list[dict[str, torch.Tensor]]) -> None:
    for rank, (a, b) in enumerate(zip(want, got, strict=True)):
        assert a.keys() == b.keys(), (rank, sorted(a.keys() ^ b.keys()))
        differ = [k for k in a if not torch.equal(a[k], b[k])]
        assert not differ, f"rank {rank}: {differ}"


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """The S3-compatible server of the mirror's tests (tests/s3server.py): ``PREEMPT_TEST_S3_ENDPOINT`` when .ci/run
    started one, else a moto_server of this worker, stopped at the end. Never stopped or paused by a test."""
    import s3server

    shared = os.environ.get(s3server.ENDPOINT_VAR)
    if shared:
        yield shared
        return
    with s3server.start(free_port()) as server:
        yield server.endpoint


@pytest.fixture
def mirror_url(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """``s3://<a bucket of this test>/run``, with the AWS variables set for this process and the ones it starts."""
    import s3server

    for name, value in s3server.env(s3_endpoint).items():
        monkeypatch.setenv(name, value)
    return f"s3://{s3server.new_bucket(s3_endpoint)}/run"


def small_run(d: Path) -> Path:
    """``d``: the save_dir of a real PreemptibleRun of 8 steps in this process, a checkpoint every 3 steps, all kept
    (RNG states, sampler cursor, best metric, history, provenance, complete.json)."""
    from torch.utils.data import DataLoader, TensorDataset

    from preempt import PreemptibleRun

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g))
    kw = dict(checkpoint_interval=None, checkpoint_every_steps=3, keep_last=None, best_metric="loss", keep_best=1)
    with PreemptibleRun(d, model=model, optimizer=opt, **kw) as run:
        loader = DataLoader(data, batch_size=8, sampler=run.sampler(data, seed=3))
        for _ in run.epochs(2):
            for x, y in run.batches(loader):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                run.step(metrics={"loss": loss.item()})
    return d


def cli(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    """``preempt ARGS`` in this process (``preempt.cli.main.main``): exit code, stdout, stderr."""
    from preempt.cli.main import main

    capsys.readouterr()
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def cli_json(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, dict]:
    """The same with ``--json``: exit code and the parsed output."""
    rc, out, _ = cli(capsys, *args, "--json")
    return rc, json.loads(out)
