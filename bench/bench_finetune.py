#!/usr/bin/env python
"""Fine-tuning checkpoint benchmark for preempt (issue #29): what a LoRA run's checkpoints write, stall and cost.

Run from the repository root::

    python bench/bench_finetune.py                    # 1.5 GiB frozen fp32 base + LoRA r=16, 1 + 5 checkpoints
    python bench/bench_finetune.py --quick            # ~64 MiB base, the same rows: a smoke run (~2 min)
    python bench/bench_finetune.py --full             # nothing frozen (0.5 GiB of weights): carry on vs off
    python bench/bench_finetune.py --base_gib 3 --checkpoints 8 --json bench/results/finetune.json
    python bench/bench_finetune.py --device cuda      # the state on the GPU (base, adapters, AdamW)

A frozen base (a stack of bias-free Linear layers shaped like a transformer's q/k/v/o and MLP up/down
projections, LayerNorms) with LoRA adapters injected by hand into those six projections (``lora_A``/``lora_B``
inside the modules; base weights ``requires_grad=False``), AdamW on the adapters. The same state, built from
the same seed and trained by the same steps, is checkpointed five ways side by side: preempt saving the whole
state (``carry_unchanged=False``, today), preempt carrying unchanged files (``carry_unchanged=True``), PEFT-style
adapters + optimizer tensors with ``safetensors.torch.save_file``, DCP ``save`` of the full state dict, and DCP
with ``ignore_frozen_params=True``. Per checkpoint: bytes written (for preempt: files whose inode is new or was
rewritten; a file hard-linked from an earlier checkpoint counts as carried), loop stall, durable time; then
SIGTERM -> durable with a real signal to a training child per way. Ratios against the changed bytes and a raw
write of that many bytes measured in the same run. See bench/README.md.

Each preempt way runs in a process of its own, the three peers share one (their saves are synchronous and only
read the state); the processes stay alive and the parent drives them in rounds whose order rotates, so drift of
the shared disk falls on every way alike. Helpers come from ``bench_checkpoint`` and ``bench_async``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_async import fmt_s, git_commit, leave, verdict  # noqa: E402  (the path above makes siblings importable)
from bench_checkpoint import (  # noqa: E402
    CHUNK,
    DEFAULT_DIR,
    GIB,
    PeakRss,
    dir_bytes,
    fsync_dir,
    fsync_path,
    machine_facts,
)

N_LAYERS = 8
LORA_R = 16
LORA_ALPHA = 32
TOKENS = 8  # tokens per training step (batch 1): the base is read once per step, the adapters change
QUIET_EVERY = 100_000  # checkpoint_every_steps of the preempt runs: between checkpoints run.step() only counts
META_SLACK = 16 << 10  # "a few KiB of metadata" of issue 29's bytes target

WAYS = {
    "preempt_off": "1. preempt, whole state (carry_unchanged=False): today",
    "preempt_carry": "2. preempt, carry_unchanged=True (the default)",
    "peft": "3. PEFT-style: save_file of adapters + optimizer tensors",
    "dcp_full": "4. DCP save, get_state_dict(model, optimizer)",
    "dcp_trainable": "5. DCP save, get_state_dict(ignore_frozen_params=True)",
}
PREEMPT_WAYS = ("preempt_off", "preempt_carry")
PEER_WAYS = ("peft", "dcp_full", "dcp_trainable")


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def perf() -> float:
    return time.perf_counter()


def carry_available() -> bool:
    """True when this preempt's PreemptibleRun takes ``carry_unchanged``."""
    from preempt_options import takes

    return takes("carry_unchanged")


def io_write_bytes() -> int:
    """This process's (all threads') bytes sent towards the block layer so far (``write_bytes`` of /proc/self/io)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("write_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


# ------------------------------------------------------------------ model


def model_dims(base_gib: float, elem: int) -> int:
    """d_model of the N_LAYERS-layer base whose 12 d^2 weights per layer come to ``base_gib`` GiB."""
    return max(64, int(round(math.sqrt(base_gib * GIB / (12 * N_LAYERS * elem)) / 64)) * 64)


def build_state(args: argparse.Namespace) -> dict[str, Any]:
    """The base (frozen unless --full), LoRA injected by hand, AdamW, and one training step function.

    Every process builds the same bytes: same seed, same order (on the CPU, then moved to ``--device``). The
    optimizer's moments exist only after the first step, as in a real loop; ``step()`` is one forward + backward +
    AdamW step on TOKENS tokens, and on a GPU it ends with a synchronisation, as a loop that reads its loss does.
    """
    import torch
    from torch import nn
    from torch.nn import functional as F

    dtype = getattr(torch, args.dtype)
    d = model_dims(args.base_gib, torch.empty(0, dtype=dtype).element_size())
    heads = max(1, d // 64)

    class LoRALinear(nn.Linear):
        """An nn.Linear whose class was swapped in place by ``inject_lora`` (no wrapper: state-dict keys stay)."""

        lora_A: nn.Parameter
        lora_B: nn.Parameter
        lora_scale: float

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = F.linear(x, self.weight)
            lora = (x.to(self.lora_A.dtype) @ self.lora_A.t()) @ self.lora_B.t()
            return out + (lora * self.lora_scale).to(out.dtype)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
            self.up, self.down = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            h = self.ln1(x)
            q, k, v = (m(h).view(b, t, heads, -1).transpose(1, 2) for m in (self.q, self.k, self.v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
            x = x + self.o(a)
            return x + self.down(F.gelu(self.up(self.ln2(x))))

    torch.manual_seed(0)
    with torch.device("cpu"):
        model = nn.Sequential(*(Block() for _ in range(N_LAYERS))).to(dtype)
    base_bytes = sum(p.nbytes for p in model.parameters())
    if not args.full:
        for p in model.parameters():
            p.requires_grad_(False)
        g = torch.Generator().manual_seed(1)
        for block in model:
            for name in ("q", "k", "v", "o", "up", "down"):
                m = getattr(block, name)
                m.__class__ = LoRALinear
                # adapters in float32 whatever the base's dtype, as PEFT keeps them; B = 0: the model starts as the base
                m.lora_A = nn.Parameter(torch.randn(LORA_R, m.in_features, generator=g) / math.sqrt(m.in_features))
                m.lora_B = nn.Parameter(torch.zeros(m.out_features, LORA_R))
                m.lora_scale = LORA_ALPHA / LORA_R
    device = torch.device(args.device)
    model.to(device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    x = torch.randn(1, TOKENS, d, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    y = torch.randn(1, TOKENS, d, generator=torch.Generator().manual_seed(3)).to(device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x).float(), y).backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return {"model": model, "opt": opt, "step": step, "d": d, "heads": heads, "base_bytes": base_bytes}


def changed_bytes(model: Any, opt: Any) -> dict[str, int]:
    """What training changes: the trainable tensors and every tensor of their AdamW state, in their dtypes."""
    out = {"params": sum(p.nbytes for p in model.parameters() if p.requires_grad)}
    for st in opt.state.values():
        for k, v in st.items():
            out[k] = out.get(k, 0) + v.nbytes
    out["total"] = sum(out.values())
    return out


def flat_optimizer(opt: Any) -> tuple[dict[str, Any], str]:
    """The optimizer's state tensors under flat names, and its param_groups as JSON (safetensors metadata)."""
    sd = opt.state_dict()
    tensors = {f"state.{pid}.{k}": v.contiguous() for pid, st in sd["state"].items() for k, v in st.items()}
    return tensors, json.dumps(sd["param_groups"])


# ------------------------------------------------------- counting bytes


def inode_snapshot(root: Path) -> dict[tuple[int, int], tuple[int, int]]:
    """(dev, inode) -> (mtime_ns, size) of every file under ``root``: what exists before a checkpoint."""
    snap = {}
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink():
            st = p.stat()
            snap[(st.st_dev, st.st_ino)] = (st.st_mtime_ns, st.st_size)
    return snap


def count_written(ckpt: Path, before: dict[tuple[int, int], tuple[int, int]]) -> dict[str, Any]:
    """Bytes of ``ckpt``'s files that this checkpoint wrote, and those it carried (hard links to earlier bytes).

    A file is carried when its inode existed before the checkpoint began with the same mtime and size: a hard link
    to an earlier checkpoint's file. An inode that existed but was written again (preempt recycles pruned files and
    writes a pool ahead, issue 16) counts as written; so does a new inode.
    """
    written = carried = 0
    files = {}
    for p in sorted(ckpt.rglob("*")):
        if not p.is_file() or p.is_symlink():
            continue
        st = p.stat()
        kept = before.get((st.st_dev, st.st_ino)) == (st.st_mtime_ns, st.st_size)
        files[str(p.relative_to(ckpt))] = {"bytes": st.st_size, "carried": kept, "nlink": st.st_nlink}
        if kept:
            carried += st.st_size
        else:
            written += st.st_size
    return {"written": written, "carried": carried, "files": files}


# ------------------------------------------------------------------ ways


class PreemptWay:
    """PreemptibleRun(async_save=True): stall = the run.step() that takes the checkpoint; durable = until
    run.wait_for_checkpoint() returns. ``carry`` None: the option does not exist here, today's behaviour."""

    def __init__(self, name: str, state: dict[str, Any], save_dir: Path, carry: bool | None) -> None:
        from preempt import PreemptibleRun

        self.name, self.state, self.dir = name, state, save_dir
        kw = {} if carry is None else {"carry_unchanged": carry}
        self.run = PreemptibleRun(
            save_dir,
            model=state["model"],
            optimizer=state["opt"],
            async_save=True,
            checkpoint_every_steps=QUIET_EVERY,
            checkpoint_interval=None,
            progress_every_s=None,
            **kw,
        )  # keep_last=2 and recycle_files=True: the defaults, so pruned files are recycled as in a real run
        self.facts: dict[str, Any] = {"carry_unchanged": carry}

    def enter(self) -> None:
        """Enters the run; counts steps (no training) until its staging buffers and the pool written ahead exist.

        A real loop's first checkpoint comes minutes in, after both; a checkpoint due earlier would wait for them.
        """
        run = self.run
        t0 = perf()
        run.__enter__()
        run.step()  # the buffers are sized for the optimizer's state after the run's first step
        while perf() - t0 < 60 and (run.staging_prepare_s is None or not any(self.dir.glob(".recycle-*"))):
            run.step()
            time.sleep(0.002)
        self.facts.update(ready_after_s=perf() - t0, staging_prepare_s=run.staging_prepare_s)

    def checkpoint(self, k: int) -> dict[str, Any]:
        """``k`` training steps, the last of which takes a checkpoint; waits until it is durable."""
        run, train = self.run, self.state["step"]
        before = inode_snapshot(self.dir)
        prev = run.last_save
        io0 = io_write_bytes()
        while True:
            if QUIET_EVERY - run.global_step % QUIET_EVERY <= k:
                train()
            t0 = perf()
            run.step()
            stall = perf() - t0
            rec = run.last_save
            if rec is not None and rec is not prev and rec.step == run.global_step:
                break
        path = run.wait_for_checkpoint()
        durable = perf() - t0
        io1 = io_write_bytes()
        rec = run.last_save
        assert rec is not None and rec.durable and path == rec.path, rec
        c = count_written(path, before)
        if not run.manager.wait(timeout=120):
            raise RuntimeError("background deletion did not finish in 120 s")
        os.sync()
        return {
            "stall_s": stall,
            "durable_s": durable,
            "write_s": rec.write_s,
            "bytes_written": c["written"],
            "bytes_carried": c["carried"],
            "io_write_bytes": io1 - io0,
            "files": c["files"],
        }

    def close(self) -> None:
        leave(self.run)


class PeerWay:
    """A synchronous save into a new directory: stall = durable = the call, fsync of files and directories in it."""

    def __init__(self, name: str, state: dict[str, Any], out: Path) -> None:
        self.name, self.state, self.out = name, state, out
        out.mkdir(parents=True)
        self.facts: dict[str, Any] = {}

    def save(self, path: Path) -> None:
        import safetensors.torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model, opt = self.state["model"], self.state["opt"]
        if self.name == "peft":
            # PEFT's save_pretrained writes the adapters with save_file; Trainer adds the optimizer's state
            # (torch.save there; the same tensors with save_file here, param_groups as metadata)
            path.mkdir()
            adapters = {n: p.detach().contiguous() for n, p in model.named_parameters() if p.requires_grad}
            files = (path / "adapter_model.safetensors", path / "optimizer.safetensors")
            safetensors.torch.save_file(adapters, files[0])
            tensors, groups = flat_optimizer(opt)
            safetensors.torch.save_file(tensors, files[1], metadata={"param_groups": groups})
            for f in files:
                fsync_path(f)
        else:
            options = StateDictOptions(ignore_frozen_params=self.name == "dcp_trainable")
            msd, osd = get_state_dict(model, opt, options=options)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=path, no_dist=True)  # fsyncs its files
        fsync_dir(path)  # DCP does not fsync the directories: done here so that "durable" means the same
        fsync_dir(self.out)

    def checkpoint(self, i: int) -> dict[str, Any]:
        path = self.out / f"ckpt_{i}"
        io0 = io_write_bytes()
        t0 = perf()
        self.save(path)
        dt = perf() - t0
        io1 = io_write_bytes()
        nbytes = dir_bytes(path)
        for p in self.out.iterdir():
            if p != path:
                shutil.rmtree(p)
        os.sync()
        return {
            "stall_s": dt,
            "durable_s": dt,
            "bytes_written": nbytes,
            "bytes_carried": None,
            "io_write_bytes": io1 - io0,
        }

    def close(self) -> None:
        shutil.rmtree(self.out, ignore_errors=True)


# ---------------------------------------------------------------- children


def child_proto() -> Any:
    """The parent reads our stdout; everything else (preempt's log, warnings) goes to stderr."""
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return proto


def describe(state: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    model, opt = state["model"], state["opt"]
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    return {
        "d_model": state["d"],
        "heads": state["heads"],
        "layers": N_LAYERS,
        "dtype": args.dtype,
        "base_bytes": state["base_bytes"],
        "state_bytes": sum(t.nbytes for t in model.state_dict().values())
        + sum(v.nbytes for st in opt.state.values() for v in st.values()),
        "params": sum(p.numel() for p in params),
        "trainable_params": sum(p.numel() for p in trainable),
        "trainable_tensors": len(trainable),
        "changed": changed_bytes(model, opt),
    }


def first_steps(state: dict[str, Any]) -> float:
    """Two training steps before any checkpointing (the first creates AdamW's moments); the second's seconds."""
    state["step"]()
    t0 = perf()
    state["step"]()
    return perf() - t0


def phase_server(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Holds one state and its ways; each "round I" line trains ``--steps`` steps and checkpoints every way once."""
    proto = child_proto()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = perf()
        state = build_state(args)
        build_s = perf() - t0
        step_s = first_steps(state)
        mem = PeakRss()
        mem.__enter__()
        ways: list[Any] = []
        for name in args.ways:
            if name in PREEMPT_WAYS:
                carry = None if not carry_available() else name == "preempt_carry"
                way = PreemptWay(name, state, work / name, carry)
                way.enter()
            else:
                way = PeerWay(name, state, work / name)
            ways.append(way)
        proto.write(json.dumps({"ready": True, "step_s": step_s, **describe(state, args)}) + "\n")
        proto.flush()
        results: dict[str, list[dict[str, Any]]] = {w.name: [] for w in ways}
        for line in sys.stdin:
            cmd, _, arg = line.strip().partition(" ")
            if cmd == "end":
                break
            i = int(arg)
            out = {}
            peers = [w for w in ways if isinstance(w, PeerWay)]
            for w in ways:
                if isinstance(w, PreemptWay):
                    out[w.name] = w.checkpoint(args.steps)
            if peers:
                for _ in range(args.steps):
                    state["step"]()
                k = i % len(peers)
                for w in peers[k:] + peers[:k]:  # rotated: no way always follows the same one
                    out[w.name] = w.checkpoint(i)
            for name, r in out.items():
                results[name].append(r)
            proto.write(json.dumps({name: {k: v for k, v in r.items() if k != "files"} for name, r in out.items()}))
            proto.write("\n")
            proto.flush()
        mem.__exit__()
        for w in ways:
            w.close()
    msgs: dict[str, int] = {}
    for w in caught:
        key = f"{w.category.__name__}: {str(w.message)[:150]}"
        msgs[key] = msgs.get(key, 0) + 1
    return {
        "build_s": build_s,
        "step_s": step_s,
        "ways": {w.name: {**w.facts, "calls": results[w.name]} for w in ways},
        **mem.to_json(),
        "warnings": msgs,
    }


def phase_sigterm(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """A training child for the parent to SIGTERM: 2 checkpoints of ``--steps`` steps each, then "ready", then trains.

    preempt: the run's own handler; Preempted leaves run.step() once the stop's checkpoint is durable. Peers: a
    handler that only sets a flag; the loop saves synchronously at the next step boundary and exits 75.
    """
    proto = child_proto()
    way = args.ways[0]
    state = build_state(args)
    train = state["step"]
    first_steps(state)
    res: dict[str, Any] = {"way": way}
    save_dir = Path(args.save_dir)
    if way in PREEMPT_WAYS:
        carry = None if not carry_available() else way == "preempt_carry"
        pw = PreemptWay(way, state, save_dir, carry)
        pw.enter()  # the run's own __enter__; its __exit__ below, as a `with` block would
        for _ in range(2):
            pw.checkpoint(args.steps)
        before = inode_snapshot(save_dir)
        proto.write(f"ready {time.time()!r}\n")
        proto.flush()
        boundary = 0.0
        try:
            while True:
                train()
                boundary = time.time()  # the step boundary: run.step() sees the stop here
                pw.run.step()
        except SystemExit as e:  # Preempted: the stop's checkpoint is durable
            res["stopped_wall"] = time.time()
            res["boundary_wall"] = boundary
            res["exit_code"] = e.code
            path = pw.run.last_checkpoint
            res["manifest_exists"] = path is not None and (Path(path) / "manifest.json").is_file()
            rec = pw.run.last_save
            res["stop_reason"] = None if rec is None else rec.reason
            if path is not None:
                c = count_written(Path(path), before)
                res["bytes_written"], res["bytes_carried"] = c["written"], c["carried"]
            Path(args.result).write_text(json.dumps(res))
            pw.run.__exit__(type(e), e, e.__traceback__)
            raise
    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("flag", True))
    peer = PeerWay(way, state, save_dir)
    for i in range(2):
        for _ in range(args.steps):
            train()
        peer.checkpoint(i)
    proto.write(f"ready {time.time()!r}\n")
    proto.flush()
    while not stop["flag"]:
        train()
    res["boundary_wall"] = time.time()  # the step boundary where the loop sees the flag
    t0 = perf()
    path = save_dir / "ckpt_stop"
    peer.save(path)
    res.update(
        stopped_wall=time.time(),
        stop_save_s=perf() - t0,
        exit_code=75,
        manifest_exists=path.is_dir(),
        bytes_written=dir_bytes(path),
    )
    Path(args.result).write_text(json.dumps(res))
    raise SystemExit(75)


# ----------------------------------------------------------------- parent


def child_cmd(phase: str, args: argparse.Namespace, work: Path, result: Path, ways: tuple[str, ...]) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--only", phase, "--base_gib", repr(args.base_gib)]
    cmd += ["--dtype", args.dtype, "--device", args.device, "--steps", str(args.steps), "--threads", str(args.threads)]
    cmd += ["--dir", str(work), "--result", str(result), "--ways", *ways]
    return cmd + (["--full"] if args.full else [])


class Server:
    """A child process holding one state and ``ways``; ``round(i)`` checkpoints them once (see phase_server)."""

    def __init__(self, args: argparse.Namespace, work: Path, ways: tuple[str, ...]) -> None:
        self.ways, self.label = ways, "+".join(ways)
        self.result, self.errpath = work / f"{self.label}.json", work / f"{self.label}.err"
        t0 = perf()
        with open(self.errpath, "w") as err:
            self.p = subprocess.Popen(
                child_cmd("server", args, work, self.result, ways),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        self.ready = self._read()
        print(f"  {self.label:<34} ready in {perf() - t0:5.1f} s", file=sys.stderr, flush=True)

    def _read(self) -> dict[str, Any]:
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        if not line:
            self.p.wait()
            sys.stderr.write(self.errpath.read_text())
            raise SystemExit(f"bench: {self.label} process failed (exit {self.p.returncode}); its output is above")
        return json.loads(line)

    def round(self, i: int) -> dict[str, Any]:
        assert self.p.stdin is not None
        self.p.stdin.write(f"round {i}\n")
        self.p.stdin.flush()
        return self._read()

    def end(self) -> dict[str, Any]:
        assert self.p.stdin is not None
        self.p.stdin.write("end\n")
        self.p.stdin.close()
        if self.p.wait() != 0:
            sys.stderr.write(self.errpath.read_text())
            raise SystemExit(f"bench: {self.label} process failed (exit {self.p.returncode}); its output is above")
        res = json.loads(self.result.read_text())
        self.result.unlink()
        self.errpath.unlink()
        return res

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


def raw_write(work: Path, nbytes: int) -> float:
    """``os.write`` of ``nbytes`` (64 MiB chunks, a touched buffer) into a new file + fdatasync + fsync of the dir:
    what writing just the changed bytes costs (bench_checkpoint's raw reference). Untimed: deleting it, sync()."""
    buf = memoryview(bytearray(b"\1") * nbytes)
    path = work / "raw.bin"
    t0 = perf()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        pos = 0
        while pos < nbytes:
            pos += os.write(fd, buf[pos : pos + CHUNK])
        os.fdatasync(fd)
    finally:
        os.close(fd)
    fsync_dir(work)
    dt = perf() - t0
    path.unlink()
    os.sync()
    return dt


def run_rounds(args: argparse.Namespace, work: Path, ways: list[str]) -> dict[str, Any]:
    """One process per preempt way and one for the peers, alive together; rounds in rotating order, with the raw
    write of the changed bytes as one more entry of each round."""
    peers = tuple(w for w in ways if w in PEER_WAYS)
    groups = [(w,) for w in ways if w in PREEMPT_WAYS] + ([peers] if peers else [])
    servers: list[Server] = []
    calls: dict[str, list[dict[str, Any]]] = {w: [] for w in ways}
    raw: list[float] = []
    try:
        for g in groups:  # one after the other: building a 1.5 GiB state takes both cores
            servers.append(Server(args, work, g))
        ready = servers[0].ready
        changed = ready["changed"]["total"]
        entries: list[Any] = [*servers, "raw"]
        t0 = perf()
        for i in range(args.checkpoints):
            k = i % len(entries)
            for e in entries[k:] + entries[:k]:
                if e == "raw":
                    raw.append(raw_write(work, changed))
                else:
                    for name, r in e.round(i).items():
                        calls[name].append(r)
            print(f"  round {i + 1}/{args.checkpoints} done ({perf() - t0:5.1f} s)", file=sys.stderr, flush=True)
        ends = [s.end() for s in servers]
    finally:
        for s in servers:
            s.kill()
    procs = {s.label: {k: v for k, v in e.items() if k != "ways"} for s, e in zip(servers, ends, strict=True)}
    facts = {name: {k: v for k, v in e["ways"][name].items() if k != "calls"} for e in ends for name in e["ways"]}
    for e in ends:  # the files of every checkpoint (carried or written) are only in the final result
        for name, d in e["ways"].items():
            for c, full in zip(calls[name], d["calls"], strict=True):
                c["files"] = full.get("files")
    return {
        "state": ready,
        "step_s": {s.label: s.ready["step_s"] for s in servers},
        "calls": calls,
        "raw_changed_s": raw,
        "processes": procs,
        "way_facts": facts,
    }


def sigterm_trial(args: argparse.Namespace, work: Path, way: str, rng: random.Random, changed: int) -> dict[str, Any]:
    """One child: waits for "ready", sleeps 0.2-1 s, SIGTERMs it; then the raw write of the changed bytes."""
    result, errpath, save_dir = work / "sigterm.json", work / "sigterm.err", work / f"sigterm_{way}"
    with open(errpath, "w") as err:
        env = {**os.environ, "PREEMPT_LOG_LEVEL": "DEBUG"}  # the "written in X s" lines read below
        p = subprocess.Popen(
            child_cmd("sigterm", args, work, result, (way,)) + ["--save-dir", str(save_dir)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
        )
    try:
        assert p.stdout is not None
        while True:
            line = p.stdout.readline()
            if not line:
                p.wait()
                sys.stderr.write(errpath.read_text())
                raise SystemExit(f"bench: SIGTERM child of {way} ended before 'ready' (exit {p.returncode})")
            if line.split()[0] == "ready":
                break
        delay = rng.uniform(0.2, 1.0)
        time.sleep(delay)
        t_kill = time.time()
        p.send_signal(signal.SIGTERM)
        code = p.wait(timeout=600)
        t_exit = time.time()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    log = errpath.read_text()
    if code != 75 or not result.exists():
        sys.stderr.write(log)
        raise SystemExit(f"bench: SIGTERM child of {way} exited {code}, expected 75 with a result; its log is above")
    res = json.loads(result.read_text())
    result.unlink()
    errpath.unlink()
    shutil.rmtree(save_dir, ignore_errors=True)
    os.sync()
    res.update(
        delay_s=delay,
        kill_to_durable_s=res["stopped_wall"] - t_kill,
        kill_to_exit_s=t_exit - t_kill,
        kill_to_boundary_s=res["boundary_wall"] - t_kill,  # the rest of the training step the signal landed in
        boundary_to_durable_s=res["stopped_wall"] - res["boundary_wall"],  # the stop's checkpoint
    )
    if way in PREEMPT_WAYS:
        m = re.search(r"checkpoint \S+ \(preempt\) written in ([0-9.]+) s", log)
        res["stop_save_s"] = float(m.group(1)) if m else None
        res["log_tail"] = log.strip().splitlines()[-3:]
    res["raw_after_s"] = raw_write(work, changed)  # the yardstick in the same disk state, right after the trial
    return res


def run_sigterm(args: argparse.Namespace, work: Path, ways: list[str], changed: int) -> dict[str, list[dict[str, Any]]]:
    rng = random.Random(29)
    out: dict[str, list[dict[str, Any]]] = {w: [] for w in ways}
    t0 = perf()
    for i in range(args.sigterm_trials):
        k = i % len(ways)
        for w in ways[k:] + ways[:k]:
            out[w].append(sigterm_trial(args, work, w, rng, changed))
            print(f"  SIGTERM {w:<14} trial {i + 1} done ({perf() - t0:5.1f} s)", file=sys.stderr, flush=True)
    return out


# ----------------------------------------------------------------- report


def fmt_b(n: float | None) -> str:
    if n is None:
        return ""
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def summarize(calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The first checkpoint on its own; the median of the later ones."""
    later = calls[1:]
    out: dict[str, Any] = {"first": calls[0], "n_later": len(later)}
    for key in ("bytes_written", "bytes_carried", "stall_s", "durable_s", "io_write_bytes"):
        xs = [c[key] for c in later if c[key] is not None]
        out[key] = median(xs) if xs else None
    return out


def report(facts: dict[str, Any], args: argparse.Namespace, r: dict[str, Any]) -> str:
    lines: list[str] = []
    w = lines.append
    st = r["rounds"]["state"]
    ch = st["changed"]
    w(f"preempt fine-tuning checkpoint benchmark (issue #29)  {facts['date']}  host {facts['host']}")
    w(
        f"machine: {facts['cpu_count']} CPUs ({facts['cpu']}), {facts['mem_total_gib']:.0f} GiB RAM, Linux"
        f" {facts['kernel']}, scratch fs {facts['scratch_fs']}; load average {facts['load_start']:.2f} at the start,"
        f" {facts['load_end']:.2f} at the end"
    )
    w(
        f"software: Python {facts['python']}, torch {facts['torch']} ({args.threads or 'default'} threads per child),"
        f" safetensors {facts['safetensors']}, preempt {facts['preempt']} (git {facts['preempt_commit']})"
    )
    mode = "full training: nothing frozen, AdamW on every weight" if args.full else "frozen base"
    if args.device == "cuda":
        mode += f", on the GPU: {facts['gpu']}"
    w(
        f"state ({mode}): {N_LAYERS} layers, d={st['d_model']}, q/k/v/o d x d + up/down d x 4d Linear without"
        f" bias, LayerNorms; base {fmt_b(st['base_bytes'])} in {st['dtype']}; {st['params'] / 1e6:.1f}M params,"
        f" {st['trainable_params'] / 1e6:.2f}M trainable in {st['trainable_tensors']} tensors;"
        f" whole state (model + AdamW) {fmt_b(st['state_bytes'])}"
    )
    if not args.full:
        w(f"   LoRA r={LORA_R}, alpha={LORA_ALPHA}, injected by hand on q/k/v/o/up/down (float32 A, B in the modules)")
    parts = ", ".join(f"{k} {fmt_b(v)}" for k, v in ch.items() if k != "total")
    w(f"changed bytes per checkpoint: {fmt_b(ch['total'])} ({ch['total']:,} B: {parts})")
    raw = r["rounds"]["raw_changed_s"]
    w(
        f"raw write of the changed bytes (os.write + fdatasync + fsync of the dir): median {fmt_s(median(raw))}"
        f" (rounds: {', '.join(fmt_s(x) for x in raw)})"
    )
    steps = ", ".join(f"{k} {fmt_s(v)}" for k, v in r["rounds"]["step_s"].items())
    w(
        f"method: 1 + {args.checkpoints - 1} checkpoints per way, {args.steps} training steps before each ({TOKENS}"
        f" tokens, batch 1; one step: {steps}); one process per preempt way + one for the peers, all alive, driven in"
        " rounds of rotating order; page cache not dropped (write benchmark: every save fsyncs, sync() between"
        " saves, untimed)"
    )
    if not r["carry_available"]:
        w(
            "NOTE: way 2 not available: this preempt's PreemptibleRun has no carry_unchanged parameter (issue 29"
            " not merged); way 1 runs without the argument, which is today's behaviour"
        )
    w("")
    hdr = (
        f"{'way':<58}{'written':>11}{'x changed':>10}{'carried':>11}{'stall':>9}{'durable':>9}{'dev writes':>11}"
        f"  | {'first: written':>16}{'stall':>9}{'durable':>9}"
    )
    w(f"per checkpoint after the first (median of {args.checkpoints - 1}); 'first' = the run's first checkpoint")
    w(hdr)
    w("-" * len(hdr))
    summ: dict[str, Any] = {}
    for way, label in WAYS.items():
        if way not in r["ways"]:
            continue
        calls = r["rounds"]["calls"].get(way)
        if not calls:
            w(f"{label:<58}  not available (PreemptibleRun has no carry_unchanged)")
            continue
        s = summ[way] = summarize(calls)
        f = s["first"]
        x = s["bytes_written"] / ch["total"] if s["bytes_written"] is not None else None
        w(
            f"{label:<58}{fmt_b(s['bytes_written']):>11}{'' if x is None else f'{x:.2f}x':>10}"
            f"{fmt_b(s['bytes_carried']):>11}{fmt_s(s['stall_s']):>9}{fmt_s(s['durable_s']):>9}"
            f"{fmt_b(s['io_write_bytes']):>11}  | {fmt_b(f['bytes_written']):>16}{fmt_s(f['stall_s']):>9}"
            f"{fmt_s(f['durable_s']):>9}"
        )
    for way, d in r["rounds"]["way_facts"].items():
        if way in PREEMPT_WAYS:
            w(
                f"   ({way}: carry_unchanged={d['carry_unchanged']}; run ready {fmt_s(d['ready_after_s'])} after"
                f" entering, staging buffers {fmt_s(d['staging_prepare_s'])})"
            )
    for label, p in r["rounds"]["processes"].items():
        w(f"   ({label}: peak RSS {fmt_b(p['peak_rss'])}, built in {fmt_s(p['build_s'])})")
        for k, n in p["warnings"].items():
            w(f"   warning recorded ({label}, {n}x): {k}")

    sig = r.get("sigterm")
    targets: list[tuple[str, str, bool | None]] = []
    if sig:
        w("")
        w(
            "SIGTERM -> durable: a real SIGTERM to a training child 0.2-1 s after its 2nd checkpoint was durable"
            " (nothing in flight); preempt: kill() to the child's clock when Preempted leaves run.step() (after the"
            " stop's checkpoint's last fsync); peers: a handler sets a flag, the loop saves synchronously at the next"
            " step boundary. It is the rest of the training step the signal lands in ('to boundary', the same work"
            " for every way) + the stop's checkpoint ('boundary -> durable': from the step boundary where the loop"
            " sees the stop). 'x raw' = boundary -> durable / a raw write of the changed bytes right after the trial"
        )
        for way, label in WAYS.items():
            ts = sig.get(way)
            if ts is None:
                continue
            if not ts:
                w(f"   {label:<58} not available")
                continue
            k2d = [t["kill_to_durable_s"] for t in ts]
            k2b = [t["kill_to_boundary_s"] for t in ts]
            b2d = [t["boundary_to_durable_s"] for t in ts]
            xs = [t["boundary_to_durable_s"] / t["raw_after_s"] for t in ts]
            save = [t["stop_save_s"] for t in ts if t.get("stop_save_s") is not None]
            wb = [t["bytes_written"] for t in ts if "bytes_written" in t]
            summ.setdefault(way, {})["sigterm_x_raw"] = median(xs)
            w(
                f"   {label:<58} {fmt_s(median(k2d)):>8} ({', '.join(fmt_s(x) for x in k2d)}) = to boundary"
                f" {fmt_s(median(k2b))} + boundary -> durable {fmt_s(median(b2d))}"
                f" ({', '.join(fmt_s(x) for x in b2d)}); x raw {median(xs):.2f}"
                f" ({', '.join(f'{x:.2f}' for x in xs)}); stop's save {fmt_s(median(save)) if save else '?'},"
                f" wrote {fmt_b(median(wb)) if wb else '?'}; exit {', '.join(str(t['exit_code']) for t in ts)}"
            )
        ok = all(t["manifest_exists"] for ts in sig.values() for t in ts)
        w(f"   every child exited 75 with its stop's checkpoint on disk: {ok}")

    w("")
    w("targets (issue #29)")
    carry = summ.get("preempt_carry")
    off = summ.get("preempt_off")
    if not args.full:
        if carry and carry["bytes_written"] is not None:
            x = carry["bytes_written"] / ch["total"]
            extra = carry["bytes_written"] - ch["total"]
            ok = carry["bytes_written"] <= 1.1 * ch["total"] + META_SLACK
            targets.append(("bytes written per checkpoint after the first <= 1.1x changed + 16 KiB",
                            f"{x:.3f}x ({fmt_b(extra)} above the changed bytes)", ok))  # fmt: skip
        else:
            targets.append(("bytes written per checkpoint after the first <= 1.1x changed + 16 KiB", "way 2 n/a", None))
        if carry and "sigterm_x_raw" in carry:
            x = carry["sigterm_x_raw"]
            targets.append(("stop's checkpoint (step boundary -> durable) <= 1.2x a raw write of the changed bytes",
                            f"{x:.2f}x", x <= 1.2))  # fmt: skip
        else:
            targets.append(("stop's checkpoint (step boundary -> durable) <= 1.2x a raw write of the changed bytes",
                            "way 2 n/a", None))  # fmt: skip
    else:
        calls = r["rounds"]["calls"]
        for key in ("stall_s", "durable_s"):
            name = f"full training: {key[:-2]} carry on / off within 2%"
            if carry and off and carry[key] is not None and off[key] is not None:
                x = carry[key] / off[key]
                pairs = [
                    a[key] / b[key] for a, b in zip(calls["preempt_carry"][1:], calls["preempt_off"][1:], strict=True)
                ]
                value = f"{x:.3f}x (per round {', '.join(f'{p:.2f}' for p in pairs)})"
                targets.append((name, value, abs(x - 1) <= 0.02))
            else:
                targets.append((name, "way 2 n/a", None))
    for name, value, ok in targets:
        w(f"   {name:<70} {value:<46} {'NOT AVAILABLE' if ok is None else verdict(ok)}")
    return "\n".join(lines)


# ------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--base_gib", type=float, help="size of the base's weights, GiB (default 1.5; --quick 1/16;"
                    " --full 0.5)")  # fmt: skip
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the base's dtype (adapters:"
                    " float32); default float32")  # fmt: skip
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the state lives (default cpu)")
    ap.add_argument("--checkpoints", type=int, default=6, help="checkpoints per way, the first included (default 6)")
    ap.add_argument("--steps", type=int, default=3, help="training steps before each checkpoint (default 3)")
    ap.add_argument("--sigterm_trials", type=int, help="SIGTERM trials per way (default 2; --quick 1; 0: none)")
    ap.add_argument("--quick", action="store_true", help="a ~64 MiB base, 1 SIGTERM trial per way: a smoke run")
    ap.add_argument("--full", action="store_true", help="nothing frozen (full training): ways 1 and 2 only")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per child (default 1, as bench_async.py)")
    ap.add_argument("--dir", default=str(DEFAULT_DIR), help=f"scratch directory (default {DEFAULT_DIR})")
    ap.add_argument("--json", help="also write every timing to this JSON file")
    ap.add_argument("--only", choices=("server", "sigterm"), help=argparse.SUPPRESS)
    ap.add_argument("--ways", nargs="+", choices=tuple(WAYS), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--save-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.only:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        res = {"server": phase_server, "sigterm": phase_sigterm}[args.only](args, Path(args.dir))
        Path(args.result).write_text(json.dumps(res))
        return

    if args.base_gib is None:
        args.base_gib = 1 / 16 if args.quick else 0.5 if args.full else 1.5
    if args.sigterm_trials is None:
        args.sigterm_trials = 1 if args.quick else 2
    if args.base_gib <= 0 or args.checkpoints < 2 or args.steps < 1 or args.sigterm_trials < 0:
        ap.error("--base_gib must be > 0, --checkpoints >= 2, --steps >= 1, --sigterm_trials >= 0")
    scratch = Path(args.dir).resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    # preempt whole state: 2 kept + the recycled pool; DCP full: 1 kept + 1 new; + the moments of --full
    need = args.base_gib * GIB * (8 if not args.full else 16)
    free = shutil.disk_usage(scratch).free
    if free < need:
        raise SystemExit(f"bench: {scratch} has {free / GIB:.1f} GiB free; this run needs {need / GIB:.1f} GiB")
    carry = carry_available()
    ways = list(PREEMPT_WAYS if args.full else WAYS)
    run_ways = [w for w in ways if w != "preempt_carry" or carry]
    facts = machine_facts(scratch)
    facts["load_start"] = os.getloadavg()[0]
    facts["preempt_commit"] = git_commit()
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            ap.error("--device cuda: torch sees no CUDA device on this machine")
        facts["gpu"] = f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    work = Path(tempfile.mkdtemp(prefix="bench-finetune-", dir=scratch))
    print(f"bench: base {args.base_gib:g} GiB, ways {run_ways}, scratch {work}", file=sys.stderr, flush=True)
    if not carry:
        print("bench: PreemptibleRun has no carry_unchanged: way 2 is not available", file=sys.stderr, flush=True)
    results: dict[str, Any] = {"carry_available": carry, "ways": ways}
    t0 = perf()
    try:
        results["rounds"] = run_rounds(args, work, run_ways)
        if args.sigterm_trials:
            changed = results["rounds"]["state"]["changed"]["total"]
            results["sigterm"] = run_sigterm(args, work, run_ways, changed)
            if not carry:
                results["sigterm"]["preempt_carry"] = []
    finally:
        shutil.rmtree(work, ignore_errors=True)
    total = perf() - t0
    facts["load_end"] = os.getloadavg()[0]
    text = report(facts, args, results)
    print(text)
    print(f"\ntotal wall time {total:.0f} s", flush=True)
    if args.json:
        out = {"facts": facts, "args": vars(args), "results": results, "total_wall_s": total, "table": text}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1, default=str) + "\n")
        print(f"results written to {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
