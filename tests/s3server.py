"""A real S3-compatible server for the mirror's tests: moto's standalone server (``moto_server``), in memory, on the
loopback address, started as a subprocess (the way s3fs's own tests run it).

``.ci/run`` may start one shared server and export ``PREEMPT_TEST_S3_ENDPOINT``; the tests that do not stop their
server use it. A test that SIGSTOPs or kills a server starts a private one (:func:`start`).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ENDPOINT_VAR = "PREEMPT_TEST_S3_ENDPOINT"
START_TIMEOUT = 60.0  # moto imports flask and boto: seconds on a busy 2-core machine


def env(endpoint: str) -> dict[str, str]:
    """The standard AWS variables that make boto/s3fs talk to ``endpoint`` with no other code."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing-key",
        "AWS_SECRET_ACCESS_KEY": "testing-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }


class Server:
    """One moto_server process: ``endpoint``, ``pause()``/``resume()`` (SIGSTOP/SIGCONT), ``stop()``."""

    def __init__(self, port: int) -> None:
        exe = shutil.which("moto_server")
        if exe is None:
            raise RuntimeError("moto_server is not installed: pip install 'moto[server]' (the test extra)")
        self.port = port
        self.endpoint = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [exe, "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + START_TIMEOUT
        while not answers(port):
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server on port {port} exited with {self.proc.returncode} at start")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"moto_server on port {port} did not answer within {START_TIMEOUT} s")
            time.sleep(0.05)

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # a SIGSTOPped process dies of SIGKILL too
        self.proc.wait(10)


def answers(port: int) -> bool:
    """The server accepts a connection and answers an HTTP request (moto binds before its app is ready)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"GET / HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            return s.recv(12).startswith(b"HTTP/")
    except OSError:
        return False


@contextmanager
def start(port: int) -> Iterator[Server]:
    server = Server(port)
    try:
        yield server
    finally:
        server.stop()


def new_bucket(endpoint: str) -> str:
    """A fresh bucket on ``endpoint`` (created with boto's client, through s3fs), unique to the caller."""
    import s3fs

    name = f"t-{uuid.uuid4().hex[:20]}"
    fs = s3fs.S3FileSystem(endpoint_url=endpoint, key="testing-key", secret="testing-secret", skip_instance_cache=True)
    fs.mkdir(name)
    return name


def put_checkpoint(store: Any, save_dir: Path, step: int, *, manifest: bool = True) -> None:
    """A local checkpoint's files into ``store`` (a MirrorStore) as the uploader puts them: the data objects first,
    the manifest last (or not at all: an upload cut off)."""
    from preempt.checkpoint.names import MANIFEST, checkpoint_name

    ckpt = save_dir / checkpoint_name(step)
    for f in sorted(ckpt.iterdir()):
        if f.name != MANIFEST:
            store.put(f, step, f.name)
    if manifest:
        store.put(ckpt / MANIFEST, step, MANIFEST)
