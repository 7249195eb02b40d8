"""The checkpoint commands on a run's mirror, against a real S3 server (moto_server, tests/s3server.py): ``ls``,
``verify``, ``inspect`` and ``report`` given the mirror's URL say what they say of the save_dir the mirror copies;
``preempt pull URL DIR`` brings a checkpoint back bit for bit; an incomplete step is shown incomplete, a corrupted
object makes verify fail naming it; errors are clear and never print a credential."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import cli, cli_json, small_run
from s3server import put_checkpoint

from preempt.checkpoint.names import checkpoint_name
from preempt.mirror.store import MirrorStore


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A real PreemptibleRun's save_dir: four checkpoints (RNG states, sampler cursor, best metric, history)."""
    return small_run(tmp_path_factory.mktemp("mirrored") / "run")


def test_commands_on_a_mirror_say_what_they_say_of_the_save_dir(run_dir, mirror_url, tmp_path, capsys):
    steps = sorted(int(p.name[5:]) for p in run_dir.glob("step_*"))
    store = MirrorStore(mirror_url)
    for s in steps:
        put_checkpoint(store, run_dir, s)
    store.put_text("history.jsonl", (run_dir / "history.jsonl").read_bytes())
    newest = steps[-1]
    cut = newest + 1  # an upload cut off before its manifest: the model's object only
    store.put(run_dir / checkpoint_name(newest) / "model.safetensors", cut, "model.safetensors")

    # ls: the local rows, from the manifests and the listing; the cut step shown incomplete, never latest.
    rc, local = cli_json(capsys, "ls", run_dir)
    rc2, remote = cli_json(capsys, "ls", mirror_url)
    assert rc == rc2 == 0 and remote["dir"] == mirror_url
    rows = {r["step"]: r for r in remote["checkpoints"]}
    assert rows[cut]["status"] == "incomplete" and not rows[cut]["latest"]
    assert rows[cut]["problem"].startswith(f"{mirror_url}/{checkpoint_name(cut)}/manifest.json: missing")
    for want in local["checkpoints"]:
        got = rows[want["step"]]
        assert got["path"] == f"{mirror_url}/{want['name']}"
        differ = {k for k in want if want[k] != got[k]} - {"path", "complete"}
        assert not differ, (want, got)
    rc, out, _ = cli(capsys, "ls", mirror_url)
    assert rc == 0 and "incomplete" in next(ln for ln in out.splitlines() if ln.startswith(checkpoint_name(cut)))
    assert "valid (latest" in next(ln for ln in out.splitlines() if ln.startswith(checkpoint_name(newest)))

    # inspect: byte for byte the local output, the save_dir shown as the URL (the RNG digests read by range).
    for args in ([], ["--json"], [str(steps[0])]):
        rc, want, _ = cli(capsys, "inspect", run_dir, *(args or [str(newest)]))
        rc2, got, err = cli(capsys, "inspect", mirror_url, *(args or []))
        assert rc == rc2 == 0, err
        assert got == want.replace(str(run_dir), mirror_url), args
    assert "rng (xxh3-64" in got and "absent" not in got

    # report: the run's history at the prefix's root.
    rc, want, _ = cli(capsys, "report", run_dir)
    rc2, got, _ = cli(capsys, "report", mirror_url)
    assert rc == rc2 == 0 and got == want.replace(str(run_dir), mirror_url)

    # verify: every object downloaded and hashed; the cut step fails as incomplete, the complete ones pass.
    rc, doc = cli_json(capsys, "verify", mirror_url)
    assert rc == 1 and {c["step"]: c["ok"] for c in doc["checkpoints"]} == {**dict.fromkeys(steps, True), cut: False}
    assert cli(capsys, "verify", mirror_url, "latest")[0] == 0
    assert cli(capsys, "verify", f"{mirror_url}/{checkpoint_name(steps[0])}")[0] == 0  # the URL of one checkpoint

    # pull: the newest complete checkpoint, file for file the local one, and a run would resume from it.
    new = tmp_path / "new machine" / "run"
    rc, doc = cli_json(capsys, "pull", mirror_url, new)
    assert rc == 0 and doc["step"] == newest and doc["source"] == f"{mirror_url}/{checkpoint_name(newest)}"
    pulled = new / checkpoint_name(newest)
    src = run_dir / checkpoint_name(newest)
    assert sorted(p.name for p in pulled.iterdir()) == sorted(p.name for p in src.iterdir())
    assert all((pulled / p.name).read_bytes() == p.read_bytes() for p in src.iterdir())
    assert cli(capsys, "verify", new)[0] == 0

    # One object overwritten through the S3 API with other bytes of its size: ls (sizes) cannot see it, verify
    # names it with both digests, pull of that step fails and leaves nothing.
    bad = run_dir / checkpoint_name(steps[0]) / "state.safetensors"
    store.put_bytes(steps[0], bad.name, bytes(b ^ 0x40 for b in bad.read_bytes()))
    rc, doc = cli_json(capsys, "ls", mirror_url)
    assert {r["step"]: r["status"] for r in doc["checkpoints"]}[steps[0]] == "valid"
    rc, out, _ = cli(capsys, "verify", mirror_url, str(steps[0]))
    assert rc == 1 and f"{mirror_url}/{checkpoint_name(steps[0])}/state.safetensors: xxh3 mismatch (manifest" in out
    rc, _, err = cli(capsys, "pull", mirror_url, tmp_path / "other", "--step", str(steps[0]))
    assert rc == 1 and f"{checkpoint_name(steps[0])}/state.safetensors: xxh3 mismatch" in err
    assert not [p for p in (tmp_path / "other").iterdir() if p.name != "lock"]

    # An object missing from a step with a manifest (a deletion not finished): incomplete, naming it.
    store.delete(steps[1], "state.json")
    rc, doc = cli_json(capsys, "ls", mirror_url)
    row = next(r for r in doc["checkpoints"] if r["step"] == steps[1])
    assert row["status"] == "incomplete" and row["problem"].endswith("1 of 3 objects missing: state.json")


def test_mirror_errors_are_clear_and_keep_credentials_out(mirror_url, tmp_path, capsys):
    bucket = mirror_url.split("/")[2]
    rc, _, err = cli(capsys, "ls", f"s3://{bucket}-missing/run")
    assert rc == 2 and "bucket does not exist" in err
    rc, _, err = cli(capsys, "ls", "nosuchscheme://x/y")
    assert rc == 2 and "nosuchscheme" in err
    rc, _, err = cli(capsys, "verify", mirror_url)
    assert rc == 2 and "no checkpoints" in err
    rc, _, err = cli(capsys, "pull", mirror_url, tmp_path / "d")
    assert rc == 2 and "no complete checkpoint" in err
    rc, _, err = cli(capsys, "prune", mirror_url, "--keep-last", "1")
    assert rc == 2 and "works on a local save_dir" in err

    # A server that does not answer (the discard port): exit 4 (the environment, not damage), no secret printed.
    secret = "s3cr3t-never-printed"
    rc, out, err = cli(
        capsys,
        "ls",
        f"s3://user:{secret}@{bucket}/run",
        "--mirror-option",
        "endpoint_url=http://127.0.0.1:9",
        "--mirror-option",
        f"secret={secret}",
        "--mirror-option",
        "key=k",
    )
    assert rc == 4 and "cannot list" in err and secret not in out + err
    rc, out, err = cli(capsys, "ls", mirror_url, "--mirror-option", secret)  # no '=': the text is not repeated
    assert rc == 2 and "expected KEY=VALUE" in err and secret not in out + err


def test_mirror_commands_import_no_torch(run_dir, mirror_url):
    store = MirrorStore(mirror_url)
    step = min(int(p.name[5:]) for p in run_dir.glob("step_*"))
    put_checkpoint(store, run_dir, step)
    script = (
        "import sys\nfrom preempt.cli.main import main\ncode = main(sys.argv[1:])\n"
        "sys.stderr.write(f'\\ntorch imported: {\"torch\" in sys.modules}\\n')\nsys.exit(code)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", script, "inspect", mirror_url], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert "torch imported: False" in r.stderr and f"{mirror_url}/{checkpoint_name(step)}" in r.stdout
