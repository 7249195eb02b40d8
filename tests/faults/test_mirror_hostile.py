"""What a forged or shared bucket can put in the mirror, through a real S3-compatible server (moto_server,
tests/s3server.py): objects the run itself never writes, with valid checksums where it matters. A valid checkpoint
is never lost to any of them."""

from __future__ import annotations

import functools
import itertools
import json
from pathlib import Path

import pytest
import torch
import xxhash
from s3server import put_checkpoint

from preempt import PreemptibleRun
from preempt.checkpoint.hashed_io import dumps_json
from preempt.checkpoint.manager import CheckpointManager
from preempt.checkpoint.manifest import Cursor, Manifest
from preempt.checkpoint.names import MANIFEST, MAX_STEP, checkpoint_name, parse_checkpoint_name
from preempt.errors import MirrorError
from preempt.mirror.pull import pull
from preempt.mirror.store import MirrorStore


def saved(save_dir, steps):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
    manager = CheckpointManager(save_dir, keep_last=None)
    manager.prepare()
    for step in steps:
        with torch.no_grad():
            model[1].weight.add_(1)
        manager.save_state(step=step, model=model)
    return manager


def test_aliases_of_a_step_are_not_that_step_and_the_pull_works(tmp_path, mirror_url):
    """``step_4/`` and ``step_03/`` beside ``step_000000004/`` were merged into step 4 (and 3): the pull
    failed with a FileNotFoundError. Only the one name of each step is a step; the others are ignored."""
    local = tmp_path / "local"
    saved(local, [4])
    store = MirrorStore(mirror_url)
    store.check()
    put_checkpoint(store, local, 4)
    ckpt = local / checkpoint_name(4)
    for alias in ("step_4", "step_03", "step_0000000004"):
        for f in ckpt.iterdir():
            store.fs.pipe(f"{store.root}/{alias}/{f.name}", f.read_bytes())
    assert sorted(store.steps()) == [4]
    got = pull(store, tmp_path / "new")
    assert got == tmp_path / "new" / checkpoint_name(4)
    assert CheckpointManager(tmp_path / "new", owner=False).verify(CheckpointManager(tmp_path / "new").list()[0]) == []


@pytest.mark.parametrize(
    ("name", "step"),
    [
        ("step_000000004", 4),
        ("step_4", None),
        ("step_03", None),
        ("step_0000000004", None),
        ("step_123456789012345", 123456789012345),
        ("step_1234567890123456", None),
        (f"step_{1 << 62}", None),
        ("step_-00000001", None),
    ],
)
def test_one_name_per_step_and_the_largest_step_is_one_constant(name, step):
    """a run resumed from a (re-signed) step 2^62 wrote steps its own parser rejected. Names, manifests and
    the writer now share MAX_STEP: the writer refuses a step no reader would accept."""
    assert parse_checkpoint_name(name) == step
    if step is not None:
        assert checkpoint_name(step) == name


def test_the_writer_refuses_a_step_no_reader_accepts_and_a_manifest_beyond_it_is_refused():
    with pytest.raises(ValueError, match=r"step 1000000000000000: a checkpoint's step is in \[0, 999999999999999\]"):
        checkpoint_name(MAX_STEP + 1)
    raw = json.loads(Manifest(step=MAX_STEP, cursor=Cursor(), reason="x", created=1.0, files={}).to_json())
    assert Manifest.from_json(json.dumps(raw).encode(), "m").step == MAX_STEP
    raw.pop("checksum")
    raw["step"] = 1 << 62
    raw["checksum"] = xxhash.xxh3_128_hexdigest(dumps_json(raw))
    with pytest.raises(ValueError, match=r"field 'step': expected an integer in \[0, 999999999999999\]"):
        Manifest.from_json(json.dumps(raw).encode(), "m")


SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"  # the form of an AWS secret key: a '/' in it


@pytest.mark.parametrize("command", ["ls", "verify", "pull"])
def test_a_secret_with_a_slash_in_the_url_is_never_printed(tmp_path, mirror_url, capsys, command):
    """``s3://KEY:SECRET@bucket/...`` where SECRET holds a '/': redaction read ``urlsplit().netloc``, which
    ends at that '/', and the commands printed the secret. Every part of it stays out of what they print."""
    from preempt.cli.main import main
    from preempt.mirror.store import redact

    bucket_prefix = mirror_url.split("://", 1)[1]
    url = f"s3://AKIAIOSFODNN7EXAMPLE:{SECRET}@{bucket_prefix}"
    assert redact(url) == f"s3://{bucket_prefix}"
    args = {"ls": ["ls", url], "verify": ["verify", url], "pull": ["pull", url, str(tmp_path / "new")]}[command]
    main(args)
    said = "".join(capsys.readouterr())
    assert said, "the command said nothing"
    for part in (SECRET, *SECRET.split("/")):
        assert part not in said, said


def forge(store: MirrorStore, source: Path, step: int, files: dict[str, bytes]) -> None:
    """A step the run never wrote: ``source``'s checkpoint with ``files`` replaced, its manifest re-signed (the digests
    and the checksum recomputed, as anyone with the bucket can), uploaded as ``step``."""
    raw = json.loads((source / MANIFEST).read_bytes())
    for name, data in files.items():
        raw["files"][name] = {"size": len(data), "xxh3_128": xxhash.xxh3_128_hexdigest(data)}
    raw["step"] = step
    raw.pop("checksum")
    raw["checksum"] = xxhash.xxh3_128_hexdigest(dumps_json(raw))
    for f in source.iterdir():
        if f.name != MANIFEST:
            store.put_bytes(step, f.name, files.get(f.name, f.read_bytes()))
    store.put_bytes(step, MANIFEST, json.dumps(raw).encode())


def train(save_dir: Path, mirror: str | None, steps: int, options: dict | None = None) -> tuple[int, int | None]:
    """A small run with ``mirror=`` (and ``mirror_options=``): (the step it started from, the step it resumed from or
    None)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    every: dict = {"checkpoint_every_steps": 1, "checkpoint_interval": None, "exit_if_complete": False}
    if options is not None:
        every["mirror_options"] = options
    with PreemptibleRun(save_dir, model=model, optimizer=opt, mirror=mirror, **every) as run:
        start = run.global_step
        resumed = None if run.resumed_from is None else int(run.resumed_from.name.split("_")[1])
        for _ in range(steps):
            loss = model(torch.randn(4, 8)).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            run.step()
    return start, resumed


def test_a_forged_newer_step_whose_files_match_their_digests_is_refused_and_the_older_genuine_one_resumed(
    tmp_path, mirror_url
):
    """A newer step whose model.safetensors is a pickle, with a re-signed manifest whose digests match: it was pulled,
    the run found no valid checkpoint, started fresh, and its retention deleted the mirror's genuine step. The pulled
    checkpoint is now checked as a local one (format included), set aside, and the genuine older one resumed."""
    local = tmp_path / "local"
    train(local, None, 2)
    store = MirrorStore(mirror_url)
    store.check()
    put_checkpoint(store, local, 2)
    forge(store, local / checkpoint_name(2), 9, {"model.safetensors": b"\x80\x04\x95" + b"cos\nsystem\n" * 8})
    start, resumed = train(tmp_path / "new", mirror_url, 1)
    assert (start, resumed) == (2, 2)
    assert list((tmp_path / "new" / "quarantine").iterdir())  # the forged one set aside locally
    # Retention on the mirror counts only the steps the run trusts: the forged step 9 (newer, never verified) neither
    # displaces the genuine step 2 nor is deleted by the run; keep_last=2 keeps 2 and the new 3.
    assert sorted(store.steps()) == [2, 3, 9]


def test_a_damaged_newer_step_in_the_mirror_does_not_stop_a_run_with_valid_local_checkpoints(tmp_path, mirror_url):
    """Local steps 1-3 valid, the mirror holds only a damaged step 10: the run exited 1 (NoCheckpointError). It now
    says so and resumes from the local step 3."""
    train(tmp_path / "run", None, 3)
    store = MirrorStore(mirror_url)
    store.check()
    ckpt = tmp_path / "run" / checkpoint_name(3)
    forge(store, ckpt, 10, {})  # (the manifest of step 10 lists the intact files' digests)
    for f in ckpt.iterdir():
        if f.name != MANIFEST:
            data = f.read_bytes()
            store.put_bytes(10, f.name, data[:-1] + bytes([data[-1] ^ 1]))
    start, resumed = train(tmp_path / "run", mirror_url, 1)
    assert (start, resumed) == (3, 3)


def test_a_server_error_text_reaches_no_log_with_control_characters(mirror_url, relayed):
    """Server text reached train.log and stderr unescaped (C1 control characters from an error message). A server
    whose error message holds a terminal's C1 escapes (CSI, OSC, ST: what XML lets an S3 error carry): the
    MirrorError's text, which the logs and commands print, holds them escaped."""
    bucket = mirror_url.split("://", 1)[1].split("/", 1)[0]
    _, options = relayed("error", (bucket,), message="denied \x9b31m\x9d0;owned\x9c by the server\x85")
    with pytest.raises(MirrorError) as caught:
        MirrorStore(mirror_url, options).steps()  # the listing's GET of the bucket answered with that error
    text = str(caught.value)
    assert "denied" in text and text.isprintable(), text
    assert "\\x9b31m" in text and "\\x9d0;owned\\x9c" in text, text


def test_verify_url_gives_each_object_the_time_of_its_size(tmp_path, mirror_url, monkeypatch):
    """``verify URL`` downloaded every object within the time of an empty one (op_timeout): a valid 256 MiB object
    failed as UNREADABLE on a slow link where ``pull`` of it succeeded. Each download is now given its listed size,
    from which its time budget grows as pull's does."""
    from preempt.cli.main import main

    local = tmp_path / "local"
    saved(local, [2])
    store = MirrorStore(mirror_url)
    store.check()
    put_checkpoint(store, local, 2)
    sizes: dict[str, int] = {}
    real = MirrorStore.get

    def get(self, step, name, path, size=0):
        sizes[name] = size
        return real(self, step, name, path, size)

    monkeypatch.setattr(MirrorStore, "get", get)
    assert main(["verify", mirror_url]) == 0
    ckpt = local / checkpoint_name(2)
    assert sizes == {f.name: f.stat().st_size for f in ckpt.iterdir() if f.name != MANIFEST}


def test_a_listing_of_many_pages_gives_each_page_its_own_time_and_is_bounded(mirror_url, monkeypatch):
    """100k keys made ``ls`` exit 4 saying "no answer within 20 s" though every page answered: one timeout covered
    the whole pagination. Each page now has the time of one operation, and a prefix of more objects than a run's
    mirror could hold is refused by name instead of listed without end."""
    import preempt.mirror.store as store_module
    from preempt.errors import MirrorError

    store = MirrorStore(mirror_url, {"op_timeout": 7})
    store.check()
    for i in range(1001):  # two pages of the server's 1000 keys
        store.put_bytes(1, f"junk_{i:05d}", b"x")
    pages: list[float] = []
    real = store.fs.call_s3

    def call_s3(method, *args, **kwargs):
        if method == "list_objects_v2":
            pages.append(kwargs["timeout"])
        return real(method, *args, **kwargs)

    monkeypatch.setattr(store.fs, "call_s3", call_s3)
    assert len(store.steps()[1]) == 1001
    assert pages == [7.0, 7.0]  # each page its own operation's time
    monkeypatch.setattr(store_module, "MAX_KEYS", 1000)
    with pytest.raises(MirrorError, match=r"more than 1000 objects under the prefix"):
        store.steps()


@pytest.fixture
def relayed(s3_endpoint, mirror_url):
    """(start a relay: mode, targets, **kw) -> the mirror's URL as seen through it, and its options)."""
    import s3relay

    opened = []

    def start(mode, targets, **kw):
        r = s3relay.relay(s3_endpoint, mode, targets, **kw)
        server = r.__enter__()
        opened.append(r)
        # (an operation gets 15 s: a relay on a busy machine answers late, and no test here waits for the timeout)
        return server, {"endpoint_url": server.endpoint, "op_timeout": 15}

    yield start
    for r in opened:
        r.__exit__(None, None, None)


def test_a_server_that_sends_more_than_asked_is_cut_off_at_the_cap(tmp_path, mirror_url, relayed):
    """A server that answers a ranged manifest read, or a 4 KiB object, with gigabytes and no Content-Length: ``ls``
    used 3.1 GB and ``pull`` wrote 2 GiB before its size check. Reads are streamed and cut off at what was asked."""
    local = tmp_path / "local"
    saved(local, [2])
    put_checkpoint(MirrorStore(mirror_url), local, 2)
    server, options = relayed("oversize", ("manifest.json", "state.json"), extra=256 << 20)
    store = MirrorStore(mirror_url, options)
    with pytest.raises(MirrorError, match="larger than|more than the"):
        store.read(2, MANIFEST, 64 << 20)
    # the cap (64 MiB) and what the sockets' buffers took before the client hung up: never the 256 MiB on offer
    assert server.sent < 80 << 20, server.sent
    sent = server.sent
    with pytest.raises(MirrorError, match="more than the"):
        store.get(2, "state.json", tmp_path / "state.json", (local / checkpoint_name(2) / "state.json").stat().st_size)
    assert server.sent - sent < 16 << 20 and (tmp_path / "state.json").stat().st_size < 1 << 20


def test_a_dripping_server_is_cut_off_by_the_rate_of_what_arrived_not_by_the_declared_size(
    tmp_path, mirror_url, relayed
):
    """A listing and manifest declaring 2^40 bytes with a 1 byte/s drip gave ``pull`` about 12 days. The time a
    transfer may take is measured on what arrives: slower than 1 MiB/s after op_timeout, it ends. The store's clock
    here advances 10 s at each reading, so the cut comes at the fourth byte however busy the machine is (op_timeout
    30 s of the real clock bounds the operation far above that)."""
    _, options = relayed("drip", ("model.safetensors",), interval=0.01)
    store = MirrorStore(mirror_url, {**options, "op_timeout": 30})
    store.put_bytes(2, "model.safetensors", b"x" * 4096)
    for transfer in (
        lambda: store.get(2, "model.safetensors", tmp_path / "m", 1 << 40),  # declared: 1 TiB
        lambda: store.read(2, "model.safetensors", 1 << 20),
    ):
        store.clock = functools.partial(next, itertools.count(0.0, 10.0))
        with pytest.raises(MirrorError, match=r"\b[1-9] bytes in \d+\.0 s: slower than 1 MiB/s after 30 s"):
            transfer()


def test_inspect_does_not_parse_a_state_json_of_millions_of_empty_values(tmp_path, mirror_url, capsys):
    """A 60 MiB state.json of ``{}`` by the million, its digest re-signed, cost ``inspect`` 1.7 GB. It is counted
    before it is parsed, and left unsummarised; the mirror's inspect says the same."""
    import tracemalloc

    from preempt.cli.main import main

    local = tmp_path / "local"
    saved(local, [2])
    ckpt = local / checkpoint_name(2)
    junk = b"[" + b"{}," * 3_000_000 + b"{}]"
    store = MirrorStore(mirror_url)
    store.check()
    forge(store, ckpt, 2, {"state.json": junk})
    tracemalloc.start()
    main(["inspect", mirror_url])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    said = "".join(capsys.readouterr())
    assert "values; at most 2097152 expected: not summarised" in said, said
    assert peak < 20 * len(junk), peak  # a few copies of the text, never ~80 bytes per byte


def test_a_survey_reads_small_manifests_side_by_side():
    """10k tiny manifests took about 7.5 minutes of reads one after another, which a run's start paid too. A survey
    reads them eight at a time: here each read waits until four are in flight at once, which reads one after
    another would never reach (the barrier would break after its timeout)."""
    import threading

    from preempt.mirror.survey import Surveyor

    bodies = {s: Manifest(step=s, cursor=Cursor(), reason="x", created=1.0, files={}).to_json() for s in range(8)}
    barrier = threading.Barrier(4, timeout=30)

    class Store:
        display = "mem://bucket/run"

        def steps(self):
            return {s: {MANIFEST: len(b)} for s, b in bodies.items()}

        def where(self, step, name=""):
            return f"{self.display}/{checkpoint_name(step)}/{name}"

        def read(self, step, name, limit):
            barrier.wait()
            return bodies[step]

    assert sorted(Surveyor(Store()).survey().manifests) == list(range(8))  # type: ignore[arg-type]


def test_a_pull_never_downloads_more_than_the_disk_can_take(tmp_path):
    """A manifest (and a lying listing) declaring a terabyte: the bytes a pull may write are bounded by the disk it
    writes to, not by what the manifest says. The step is refused before any download, naming the need and the
    room, and the pull goes on to the next older one."""
    from preempt.checkpoint.hashed_io import FileDigest
    from preempt.errors import CorruptCheckpointError
    from preempt.mirror import pull as pull_module

    def declaring(size):
        digest = FileDigest(size, "ab" * 16)
        return Manifest(step=9, cursor=Cursor(), reason="x", created=1.0, files={"model.safetensors": digest})

    where = "s3://b/run/step_000000009/manifest.json"
    with pytest.raises(CorruptCheckpointError, match=r"declares 1048576\.0 GiB to download; .* \(keeping 256\.0 MiB"):
        pull_module._room(tmp_path, declaring(1 << 50), where, None)
    pull_module._room(tmp_path, declaring(1 << 10), where, None)


def test_a_download_cut_off_mid_way_goes_on_from_where_it_stopped(tmp_path, mirror_url, relayed):
    """A connection closed mid-body (a flaky network, a restarted proxy): the pull asks for the rest of the object,
    from the byte where it stopped, and the file verifies; s3fs's own get did the same, which the streamed download
    must keep."""
    local = tmp_path / "local"
    saved(local, [2])
    put_checkpoint(MirrorStore(mirror_url), local, 2)
    server, options = relayed("cut", ("model.safetensors",), cuts=2)
    store = MirrorStore(mirror_url, options)
    store.sleep = lambda seconds: None
    got = pull(store, tmp_path / "new")
    assert (got / "model.safetensors").read_bytes() == (local / checkpoint_name(2) / "model.safetensors").read_bytes()
    size = (got / "model.safetensors").stat().st_size
    # the whole object asked for, then the rest from where each cut left it: never from the start again
    starts = [int(r.split("=")[1].split("-")[0]) for r in server.ranges]
    assert server.cuts == 0 and len(starts) == 3 and starts[0] == 0 and 0 < starts[1] < starts[2] < size, starts


# ------------------------------------------------------------------ listings of many steps, junk among them

JUNK = b"{" + b"-" * 63  # 64 bytes named manifest.json that are not a manifest


def junk_steps(mirror_url: str, steps, most_gets: int):
    """Steps the relay lists (and the server does not hold), each with a junk manifest.json; at most ``most_gets`` of
    their GETs answered (then 403): a reader that reads them all fails fast instead of running for minutes."""
    import s3relay

    bucket = mirror_url.split("://", 1)[1].split("/", 1)[0]
    return s3relay.Forged(bucket, "run", steps, {MANIFEST: JUNK}, most_gets=most_gets)


def test_ls_of_ten_thousand_junk_steps_reads_only_the_manifests_it_shows(mirror_url, relayed, monkeypatch, capsys):
    """10,000 steps, each with a 64-byte manifest.json that is not one: ``ls URL`` made one GET after another (2,682
    in 120 s, still running). It reads, side by side, the manifests of the newest steps it shows, says how many older
    ones it left unread (``--all`` shows them), and its listing is its 10 pages."""
    from preempt.cli import remote
    from preempt.cli.main import main

    server, _ = relayed("pass", (), forged=junk_steps(mirror_url, range(10_000), most_gets=200))
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)
    assert main(["ls", mirror_url]) == 0
    said = capsys.readouterr().out
    shown = 10_000 - remote.SHOWN
    assert said.count(" corrupt\n") == remote.SHOWN and checkpoint_name(shown) in said, said
    assert checkpoint_name(shown - 1) not in said and f"{shown} older step(s) not shown" in said, said
    assert (server.pages, server.gets) == (10, remote.SHOWN)
    assert main(["ls", mirror_url, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in doc["checkpoints"]] == list(range(9_999, shown - 1, -1)), doc
    assert doc["not_shown"] == shown and {r["status"] for r in doc["checkpoints"]} == {"corrupt"}
    assert (server.pages, server.gets) == (20, 2 * remote.SHOWN)


def test_a_run_resumes_from_the_newest_valid_step_under_ten_thousand_junk_steps(tmp_path, mirror_url, relayed):
    """A run on a new machine whose mirror lists 10,000 junk steps read every manifest before it started. It reads
    the newest manifests a round at a time until one is valid (two junk steps above it, and the rest of its round),
    its uploader's retention a bounded number a pass; the junk below the run's own steps goes as debris, a thousand
    objects a request."""
    from preempt.mirror import survey, uploader

    local = tmp_path / "local"
    train(local, None, 2)
    store = MirrorStore(mirror_url)
    store.check()
    forge(store, local / checkpoint_name(2), 10_004, {})  # a genuine checkpoint, at a step above the junk
    forged = junk_steps(mirror_url, [*range(10_000), 10_005, 10_006], most_gets=200)
    server, _ = relayed("pass", (), forged=forged)
    assert train(tmp_path / "new", mirror_url, 1, {"endpoint_url": server.endpoint}) == (10_004, 10_004)
    # the pull's first round (7 junk, the genuine step from the server), one pass's retention reads, the run's own
    # step 10005 whose junk manifest it replaced
    assert server.gets <= survey.BATCHES[0] + uploader.RETENTION_READS + 2, server.gets
    assert server.deleted >= 10_000, server.deleted  # (the junk steps below the run's: debris)
    assert sorted(store.steps()) == [10_004, 10_005] and server.pages < 60, server.pages


@pytest.mark.slow
def test_a_listing_of_100000_steps_ends_with_a_result_and_a_run_resumes_under_it(
    tmp_path, mirror_url, relayed, monkeypatch, capsys
):
    """100,000 junk steps (100 pages of a listing, every page answered at once): ``ls URL`` ended after 240 s with "no
    answer within 20 s" and a run on an empty save_dir refused to start. ls shows the newest and reads 20 manifests;
    the run resumes from the genuine step above them."""
    from preempt.cli import remote
    from preempt.cli.main import main

    local = tmp_path / "local"
    train(local, None, 2)
    store = MirrorStore(mirror_url)
    store.check()
    forge(store, local / checkpoint_name(2), 100_001, {})
    server, _ = relayed("pass", (), forged=junk_steps(mirror_url, range(100_000), most_gets=500))
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)
    assert main(["ls", mirror_url]) == 0
    said = capsys.readouterr().out
    assert f"{100_001 - remote.SHOWN} older step(s) not shown" in said and " valid (latest)" in said, said
    assert (server.pages, server.gets) == (101, remote.SHOWN - 1)  # (the genuine step's objects too: 101 pages)
    assert train(tmp_path / "new", mirror_url, 1, {"endpoint_url": server.endpoint}) == (100_001, 100_001)
    assert server.gets < 200, server.gets


def test_a_listing_has_a_time_per_page_and_a_budget_of_its_pages(mirror_url, monkeypatch):
    """A listing whose pages never end and each take just under their time: each page had op_timeout and the whole
    listing none, so it ran until 2^20 objects (1,049 pages, hours). Each page is given at most what is left of the
    listing's budget (op_timeout and LIST_PAGE_SECONDS a page), and the listing ends when that is spent. The store's
    clock advances 6 s a page here (more than a page's share of the budget), whatever the machine's pace."""
    import preempt.mirror.store as store_module

    store = MirrorStore(mirror_url, {"op_timeout": 7})
    now = [0.0]
    store.clock = lambda: now[0]
    timeouts: list[float] = []

    def call_s3(method, *args, **kwargs):
        assert method == "list_objects_v2"
        timeouts.append(kwargs["timeout"])
        now[0] += 6.0
        n = len(timeouts)
        keys = [{"Key": f"run/step_{n:09d}/junk_{i:04d}", "Size": 1} for i in range(1000)]
        return {"Contents": keys, "IsTruncated": True, "NextContinuationToken": f"t{n}"}

    monkeypatch.setattr(store.fs, "call_s3", call_s3)
    with pytest.raises(MirrorError, match=r"listing not finished after 12 pages \(12000 objects\) in 72 s"):
        store.steps()
    assert len(timeouts) == 12 and max(timeouts) <= 7.0 and timeouts[-1] == 7 + 12 * 5 - 66
    assert store.list_budget(12) == 7 + 12 * store_module.LIST_PAGE_SECONDS


# ------------------------------------------------------------------ the secrets a run is handed


def test_a_secret_inside_a_json_argument_is_recorded_and_printed_nowhere(tmp_path, mirror_url, capsys):
    """A training script given ``--options '{"key": K, "secret": S}'`` (its mirror_options): S was in every manifest's
    provenance.argv, locally and in the mirror, and ``preempt inspect URL`` printed it. Every secret a run is handed
    (its mirror_options' values under secret-like keys, the AWS variables) is now scrubbed by value wherever it is:
    here inside a JSON argument, and an AWS session token inside a path argument. None is in any file of save_dir,
    any object of the mirror, the run's output, or what ls and inspect print."""
    import os

    from helpers import run_python, train_cmd

    from preempt.cli.main import main

    key, secret, token = (
        "AKIAJSONARGKEY000001",
        "jS0n/Arg+Secret/Value0123456789abcdefghij",
        "FwoGZXIvYXdzEJr-token-0123",
    )
    env = {k: v for k, v in os.environ.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    env["AWS_SESSION_TOKEN"] = token
    options = json.dumps({"key": key, "secret": secret})
    save_dir = tmp_path / "run"
    args = ["--epochs", "1", "--samples", "32", "--batch_size", "16", "--every_steps", "1", "--sync_save"]
    args += ["--mirror", mirror_url, "--options", options, "--wait_file_at", f"step:99:{tmp_path / token}"]
    done = run_python(train_cmd(save_dir, None, args), env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    forms = [(s, json.dumps(s)[1:-1]) for s in (key, secret, token)]

    def clean(text: str, where: str) -> None:
        for raw, escaped in forms:
            assert raw not in text and escaped not in text, f"{where}: {text}"

    clean(done.stdout + done.stderr, "the run's output")
    recorded = [p for p in save_dir.rglob("*") if p.is_file()]
    assert any(p.name == MANIFEST for p in recorded) and any(p.name == "train.log" for p in recorded)
    for p in recorded:
        clean(p.read_bytes().decode("latin-1"), str(p))
    argv = json.loads(next(save_dir.glob("step_*/manifest.json")).read_bytes())["provenance"]["argv"]
    assert '{"key": "***", "secret": "***"}' in argv, argv  # recorded, less its secrets
    store = MirrorStore(mirror_url)
    mirrored = store.fs.find(store.root)
    assert any(k.endswith(MANIFEST) for k in mirrored)
    for k in mirrored:
        clean(store.fs.cat_file(k).decode("latin-1"), k)
    for command in (["ls", mirror_url], ["inspect", mirror_url], ["inspect", mirror_url, "--json"]):
        assert main(command) == 0, command
        clean("".join(capsys.readouterr()), " ".join(command))
