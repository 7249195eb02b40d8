"""What a mirror listing many steps costs: ``preempt ls URL`` and a run's start on a new machine.

One moto_server (in memory, loopback) holds one genuine checkpoint; a relay in front of it (tests/s3relay.py) lists
beside it N forged steps below it, each with one 64-byte object (``manifest.json`` that is not a manifest, or a data
object: an upload cut off), paginated as S3 does (1000 keys a page), every page and every GET answered at once.
Each case is timed from outside (wall clock around a fresh ``python -m preempt ls URL`` process, and around a
``PreemptibleRun``'s enter on an empty save_dir in this process), with the relay's counts of listing pages, GETs of
forged objects and forged objects deleted.

    python bench/bench_mirror_listing.py                         # 10,000 and 100,000 junk manifests
    python bench/bench_mirror_listing.py --steps 10000 --name model.safetensors --timeout 300
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this tree, whatever an installed copy points at
sys.path.insert(0, str(ROOT / "tests"))  # the S3 server and the relay of the tests


def one(endpoint: str, steps: int, name: str, timeout: float) -> dict[str, object]:
    import s3relay
    import s3server
    import torch
    import xxhash

    from preempt import PreemptibleRun
    from preempt.checkpoint.hashed_io import dumps_json
    from preempt.checkpoint.names import MANIFEST, checkpoint_name
    from preempt.mirror.store import MirrorStore

    bucket = s3server.new_bucket(endpoint)
    url = f"s3://{bucket}/run"
    out: dict[str, object] = {"steps": steps, "object": name}
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 2)
        genuine = steps + 1
        # the genuine checkpoint: a run's step 1, its manifest re-signed for a step above the forged ones
        first = {"checkpoint_every_steps": 1, "checkpoint_interval": None, "exit_if_complete": False}
        with PreemptibleRun(Path(tmp) / "a", model=model, **first) as run:
            run.step()
        store = MirrorStore(url)
        ckpt = Path(tmp) / "a" / checkpoint_name(1)
        raw = json.loads((ckpt / MANIFEST).read_bytes())
        raw["step"] = genuine
        raw.pop("checksum")
        raw["checksum"] = xxhash.xxh3_128_hexdigest(dumps_json(raw))
        for f in ckpt.iterdir():
            if f.name != MANIFEST:
                store.put(f, genuine, f.name)
        store.put_bytes(genuine, MANIFEST, json.dumps(raw).encode())
        data = b"{" + b"-" * 63 if name == MANIFEST else b"x" * 64
        forged = s3relay.Forged(bucket, "run", range(steps), {name: data})
        with s3relay.relay(endpoint, "pass", (), forged=forged) as relay:
            env = {**os.environ, "AWS_ENDPOINT_URL": relay.endpoint}
            t0 = time.perf_counter()
            try:
                done = subprocess.run(
                    [sys.executable, "-m", "preempt", "ls", url],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=timeout,
                )
                out["ls_s"], out["ls_rc"] = round(time.perf_counter() - t0, 2), done.returncode
                out["ls_lines"] = done.stdout.count("\n")
            except subprocess.TimeoutExpired:
                out["ls_s"], out["ls_rc"] = f"> {timeout:g} (killed)", None
            out["ls_pages"], out["ls_gets"] = relay.pages, relay.gets
            relay.pages = relay.gets = 0
            t0 = time.perf_counter()
            try:
                with PreemptibleRun(
                    Path(tmp) / "b", model=model, mirror=url, mirror_options={"endpoint_url": relay.endpoint}, **first
                ) as run:
                    out["enter_s"] = round(time.perf_counter() - t0, 2)
                    out["resumed_at"] = run.global_step
                    run.step()
            except Exception as e:  # the old code's refusal: recorded, not raised
                out["enter_s"], out["enter_error"] = round(time.perf_counter() - t0, 2), str(e)[:300]
            out["run_pages"], out["run_gets"], out["run_deleted"] = relay.pages, relay.gets, relay.deleted
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, nargs="+", default=[10_000, 100_000])
    p.add_argument("--name", default="manifest.json", help="the object in each forged step")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds an ls may take before it is killed")
    args = p.parse_args()
    import socket

    import s3server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with s3server.start(port) as server:
        os.environ.update(s3server.env(server.endpoint))
        for steps in args.steps:
            print(json.dumps(one(server.endpoint, steps, args.name, args.timeout)), flush=True)


if __name__ == "__main__":
    main()
