"""Advance notices and the grace, part by part: each platform's answer read (pure), where the grace comes from, what
a stop costs against it, the options and variables that ask for them, what ``preempt report`` makes of the markers,
and the watcher's thread against the emulated services on 127.0.0.1 (never another address)."""

from __future__ import annotations

import calendar
import email.utils
import json
import logging
import socket
import threading
import time

import pytest
from helpers.metadata import MetadataService

from preempt.cli.timeline import build, render
from preempt.cluster import grace, notices
from preempt.cluster.environment import Environment
from preempt.cluster.notices import NoticeError, Platform
from preempt.errors import Preempted
from preempt.run.config import RunConfig, integration_config
from preempt.run.stopping import stop_under_way

NOW = 1_796_000_000.0


# ---------------------------------------------------------------- the answers, read


def test_aws_instance_action():
    assert notices.parse_aws(404, b"Not Found", NOW) is None
    body = json.dumps({"action": "terminate", "time": "2026-12-01T12:02:00Z"}).encode()
    n = notices.parse_aws(200, body, NOW)
    assert n is not None and n.platform is Platform.AWS and n.what == "spot instance-action: terminate"
    assert n.deadline == calendar.timegm((2026, 12, 1, 12, 2, 0, 0, 0, 0)) and n.seen_at == NOW
    assert n.cause == "aws notice: spot instance-action: terminate"
    for status, bad in (
        (500, b""),
        (200, b"not json"),
        (200, b'{"action": "stop"}'),
        (200, b'{"action": 1, "time": 2}'),
    ):
        with pytest.raises(NoticeError):
            notices.parse_aws(status, bad, NOW)
    with pytest.raises(NoticeError, match="2026-12-01T12:02:00Z"):
        notices.parse_aws(200, b'{"action": "stop", "time": "tomorrow"}', NOW)


def test_gce_preempted_and_maintenance():
    assert notices.parse_gce_preempted(200, b"FALSE", NOW) is None
    n = notices.parse_gce_preempted(200, b"TRUE\n", NOW)
    assert n is not None and n.deadline == NOW + notices.GCE_PREEMPT_S and n.what == "instance preempted"
    with pytest.raises(NoticeError):
        notices.parse_gce_preempted(200, b"MAYBE", NOW)
    with pytest.raises(NoticeError):
        notices.parse_gce_preempted(403, b"Missing Metadata-Flavor:Google header.", NOW)
    assert notices.parse_gce_maintenance(200, b"NONE", NOW) is None
    assert notices.parse_gce_maintenance(200, b"MIGRATE_ON_HOST_MAINTENANCE", NOW) is None  # a live migration
    m = notices.parse_gce_maintenance(200, b"TERMINATE_ON_HOST_MAINTENANCE", NOW)
    assert m is not None and m.deadline is None and "TERMINATE_ON_HOST_MAINTENANCE" in m.what


def _azure(*events: dict) -> bytes:
    return json.dumps({"DocumentIncarnation": 3, "Events": list(events)}).encode()


def test_azure_scheduled_events_of_this_vm():
    at = email.utils.formatdate(NOW + 30, usegmt=True)
    mine = {"EventType": "Preempt", "Resources": ["vm1"], "EventStatus": "Scheduled", "NotBefore": at}
    other = {**mine, "Resources": ["vm2"]}
    freeze = {**mine, "EventType": "Freeze"}
    assert notices.parse_azure(200, _azure(), NOW, "vm1") is None
    assert notices.parse_azure(200, _azure(other, freeze), NOW, "vm1") is None  # another VM's; a pause
    n = notices.parse_azure(200, _azure(other, mine), NOW, "vm1")
    assert n is not None and n.deadline == NOW + 30 and n.what == "scheduled event Preempt"
    started = {**mine, "EventType": "Terminate", "EventStatus": "Started", "NotBefore": ""}
    first = notices.parse_azure(200, _azure(mine, started), NOW, "vm1")
    assert first is not None and first.what == "scheduled event Terminate" and first.deadline is None
    assert notices.parse_azure(200, _azure(other), NOW, None) is not None  # the name unknown: any VM's counts
    for status, bad in ((400, b"{}"), (200, b"[]"), (200, b"{"), (200, _azure({**mine, "NotBefore": "soon"}))):
        with pytest.raises(NoticeError):
            notices.parse_azure(status, bad, NOW, "vm1")


def test_endpoints_from_the_variables_or_the_platforms_own():
    assert notices.endpoint(Platform.AWS, None) == ("169.254.169.254", 80, "")
    assert notices.endpoint(Platform.GCE, None) == ("metadata.google.internal", 80, "")
    assert notices.endpoint(Platform.AWS, "http://127.0.0.1:8080/") == ("127.0.0.1", 8080, "")
    assert notices.endpoint(Platform.GCE, "127.0.0.1:9") == ("127.0.0.1", 9, "")
    assert notices.endpoint(Platform.AZURE, "http://127.0.0.1:7/base/") == ("127.0.0.1", 7, "/base")
    with pytest.raises(ValueError, match="AWS_EC2_METADATA_SERVICE_ENDPOINT"):
        notices.endpoint(Platform.AWS, "https://127.0.0.1")


# ---------------------------------------------------------------- the grace


def test_torchrun_shutdown_timeout_from_the_agents_command_line():
    python = "/usr/bin/python3"
    assert grace.torchrun_timeout([python, "-m", "torch.distributed.run", "--shutdown-timeout", "7", "t.py"]) == 7
    assert grace.torchrun_timeout([python, "/bin/torchrun", "--standalone", "--shutdown_timeout=9", "t.py"]) == 9
    assert grace.torchrun_timeout(["torchrun", "--nproc-per-node", "2", "t.py", "--shutdown-timeout", "4"]) is None
    assert grace.torchrun_timeout([python, "t.py", "--shutdown-timeout", "4"]) is None  # not torchrun
    assert grace.torchrun_timeout(["torchrun", "--shutdown-timeout", "x", "t.py"]) is None
    assert grace.from_torchrun(None, None).seconds == grace.TORCHRUN_DEFAULT_S == 30
    g = grace.from_torchrun(["torchrun", "t.py"], (12.0, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"))
    assert g.seconds == 12 and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=12" in g.source
    assert grace.from_torchrun(["torchrun", "--shutdown-timeout", "5", "t.py"], (12.0, "X")).seconds == 5


def test_the_grace_chosen_in_order():
    torchrun = grace.from_torchrun(None, None)
    assert grace.choose(option=None, variable=None) is None
    assert grace.choose(option=10, variable=20, torchrun=torchrun, kill_wait=5).seconds == 10  # type: ignore[union-attr]
    assert grace.choose(option=None, variable=20, torchrun=torchrun, kill_wait=5).seconds == 20  # type: ignore[union-attr]
    g = grace.choose(option=None, variable=None, torchrun=torchrun, kill_wait=5)
    assert g is not None and g.seconds == 5 and "KillWait" in g.source  # the kill that comes first
    g = grace.choose(option=None, variable=None, torchrun=torchrun, kill_wait=60)
    assert g is not None and g.seconds == 30 and "torchrun" in g.source


def test_what_a_stop_costs_and_the_warning():
    cost = grace.StopCost(save_s=8.0, nbytes=3 << 30, step_s=0.5, upload_s=20.0)
    assert cost.seconds == 28.5 and cost.fits(30) and not cost.fits(28)
    g = grace.Grace(10.0, "grace=10", "grace=")
    text = grace.advice(cost, g)
    for said in (
        "takes 28 s",
        "comes 10 s after",
        "grace=10",
        "3.0 GiB",
        "--signal=TERM@N",
        "carry_unchanged",
        "faster disk",
    ):
        assert said in text, (said, text)


# ---------------------------------------------------------------- asked for


def test_options_and_variables():
    assert RunConfig().notices is None and RunConfig().grace is None  # off by default
    assert RunConfig(notices="gce", grace=45).notices == "gce"
    with pytest.raises(ValueError, match="notices: expected one of aws, gce, azure"):
        RunConfig(notices="oracle")
    for bad in (0, -1, float("inf"), "30", True):
        with pytest.raises(ValueError, match="grace: expected"):
            RunConfig(grace=bad)
    assert integration_config("PreemptCallback", notices="aws", grace=90.0).grace == 90.0  # the integrations' path
    env = Environment.from_env(
        {
            "PREEMPT_NOTICES": "Azure",
            "PREEMPT_GRACE_S": "25",
            "PREEMPT_AZURE_METADATA_ENDPOINT": "http://127.0.0.1:1/",
            "GCE_METADATA_HOST": "127.0.0.1:2",
            "AWS_EC2_METADATA_SERVICE_ENDPOINT": "http://127.0.0.1:3",
            "TORCHELASTIC_RUN_ID": "x",
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7",
            "LOCAL_RANK": "1",
        }
    )
    assert (env.notices, env.grace_s, env.local_rank, env.torchelastic) == ("azure", 25.0, 1, True)
    assert env.torchrun_shutdown_timeout == (7.0, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT") and not env.problems
    bad = Environment.from_env({"PREEMPT_NOTICES": "ibm", "PREEMPT_GRACE_S": "-3", "GCE_METADATA_HOST": "http://x/"})
    assert (bad.notices, bad.grace_s, bad.gce_metadata_host) == (None, None, None) and len(bad.problems) == 3


# ---------------------------------------------------------------- what the report makes of it


def test_report_shows_each_stops_margin_and_a_kill_during_a_stop():
    lines = [
        {"t": 100.0, "event": "start", "step": 0, "pid": 1},
        {"t": 101.0, "event": "notice", "step": 9, "platform": "aws", "deadline": 220.0},
        {"t": 101.1, "event": "stopping", "step": 10, "cause": "aws notice: spot", "grace_s": 118.9, "stop_s": 2.0},
        {
            "t": 103.0,
            "event": "stop",
            "step": 10,
            "cause": "aws notice: spot",
            "durable_s": 2.1,
            "grace_s": 118.9,
            "margin_s": 116.8,
        },
        {"t": 110.0, "event": "resume", "step": 10, "pid": 2},
        {"t": 111.0, "event": "stopping", "step": 12, "cause": "SIGTERM", "grace_s": 0.5, "stop_s": 3.0},
        {"t": 120.0, "event": "resume", "step": 10, "pid": 3, "crashed": {"died_at": 12, "during_stop": True}},
        {
            "t": 121.0,
            "event": "stop",
            "step": 11,
            "cause": "SIGTERM",
            "durable_s": 9.0,
            "grace_s": 5.0,
            "margin_s": -4.0,
        },
    ]
    report = build(lines)
    stops = report.to_json()["stops"]
    assert [s["margin_s"] for s in stops] == [116.8, None, -4.0]
    assert stops[0]["cause"] == "aws notice: spot" and stops[0]["grace_s"] == 118.9 and stops[0]["durable_s"] == 2.1
    assert [s["killed_during_stop"] for s in stops] == [False, True, False]
    text = "\n".join(render(report, "runs/x"))
    assert "stopped: aws notice: spot (margin 1m56s)" in text
    assert "killed during its stop on SIGTERM (its checkpoint not durable, grace 0.50 s)" in text
    assert "(margin -4.00 s)" in text
    assert report.processes[1].lost_steps == 2  # the steps since the checkpoint it resumed from


def test_a_stop_under_way_is_the_last_word_of_a_killed_process():
    stopping = {"event": "stopping", "step": 5, "cause": "SIGTERM"}
    assert stop_under_way([{"event": "start"}, stopping]) == stopping
    assert stop_under_way([stopping, {"event": "stop"}]) is None
    assert stop_under_way([stopping, {"event": "resume"}]) is None
    assert stop_under_way([stopping, {"event": "restoring"}]) is None  # the next process, killed in its restore
    assert stop_under_way([{"event": "checkpoint"}]) is None


# ---------------------------------------------------------------- the thread, against the emulated services


@pytest.mark.parametrize("platform", ["aws", "gce", "azure"])
def test_the_watcher_sees_the_notice_once_and_stops(platform):
    seen: list[notices.Notice] = []
    came = threading.Event()

    def on_notice(n: notices.Notice) -> None:
        seen.append(n)
        came.set()

    with MetadataService(platform, notice_in_s=60.0) as service:
        given = next(iter(service.env().values()))
        address = notices.endpoint(Platform(platform), given)
        watcher = notices.Watcher(Platform(platform), address, on_notice, every_s=0.05).start()
        assert service.wait_requests(3), service.requests
        assert not came.is_set()
        service.give_notice()
        assert came.wait(30), service.requests
        watcher.close()
        asked = len(service.requests)
    assert len(seen) == 1 and seen[0].platform.value == platform
    if platform != "gce":
        assert seen[0].deadline == pytest.approx(service.deadline, abs=1.0)
    assert len(service.requests) == asked  # nothing after the notice or the close


def test_an_unreachable_service_is_said_once_and_close_cuts_a_hanging_get(caplog):
    caplog.set_level(logging.INFO, logger="preempt")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    troubles: list[str] = []
    down = notices.Watcher(Platform.AWS, ("127.0.0.1", port, ""), lambda n: None, on_trouble=troubles.append)
    down.retry_s = 0.01
    down.start()
    deadline = time.monotonic() + 30
    while down.requests < 3 and time.monotonic() < deadline:  # the thread keeps trying, quietly
        time.sleep(0.01)
    down.close()
    assert down.requests >= 3 and len(troubles) == 1 and "ConnectionRefusedError" in troubles[0]
    assert caplog.text.count("does not answer as expected") == 1

    with MetadataService("gce") as service:  # a GET that hangs until the value changes is cut off by close()
        watcher = notices.Watcher(Platform.GCE, ("127.0.0.1", service.port, ""), lambda n: None, hang_s=30).start()
        assert service.wait_requests(3)
        t0 = time.monotonic()
        watcher.close(timeout=10)
        # cut off, not waited for: well under the GET's 30 s hang however busy the machine is
        assert time.monotonic() - t0 < 20 and not watcher._thread.is_alive()


def test_a_bug_in_the_watcher_is_raised_by_close():
    def broken(n: notices.Notice) -> None:
        raise RuntimeError("a bug")

    with MetadataService("aws") as service:
        service.give_notice()
        watcher = notices.Watcher(Platform.AWS, ("127.0.0.1", service.port, ""), broken).start()
        watcher._thread.join(30)
        with pytest.raises(RuntimeError, match="a bug"):
            watcher.close()


def test_slurm_grace_time_of_the_partition_is_said_beside_kill_wait():
    import subprocess

    from preempt.cluster import slurm

    def scontrol(stdout: str, returncode: int = 0):
        def run(cmd, **kw):
            assert cmd[-4:] == ["show", "partition", "-o", "gpu"], cmd
            return subprocess.CompletedProcess(cmd, returncode, stdout, "")

        return run

    line = "PartitionName=gpu AllowGroups=ALL DefaultTime=NONE GraceTime=120 Hidden=NO MaxTime=UNLIMITED"
    assert slurm.grace_time("gpu", run=scontrol(line)) == 120.0
    assert slurm.grace_time("gpu", run=scontrol("PartitionName=gpu")) is None
    assert slurm.grace_time("gpu", run=scontrol("", returncode=1)) is None
    g = grace.choose(option=None, variable=None, kill_wait=30.0, grace_time=120.0)
    assert g is not None and g.seconds == 30.0 and "GraceTime 2m00s more" in g.source, g


def test_the_stopper_measures_each_save_against_the_grace_and_warns_once(tmp_path, caplog):
    """Pure of time: a fake clock. A save that fits says nothing; the first that does not (here with the mirror's
    upload added) warns once, with both figures, and writes one grace_short marker; the stop's timing is its margin."""
    from helpers import FakeClock

    from preempt.run.loop_state import LoopState
    from preempt.run.stopping import Stopper
    from preempt.run.write_decisions import SaveRecord

    clock, markers = FakeClock(), []
    stopper = Stopper(RunConfig(grace=10.0), Environment(), tmp_path, clock)
    stopper.start(lambda event, **fields: markers.append((event, fields)), lambda: 0)
    assert stopper.grace is not None and stopper.grace.source == "grace=10" and stopper.watcher is None
    clock.advance(1.0)
    stopper.measured(SaveRecord(10, "steps", 0.1, 4.0, tmp_path), 1 << 30)  # 4 s: fits in 10 s
    clock.advance(2.0)
    stopper.measured(SaveRecord(20, "steps", 0.1, 4.0, tmp_path), 1 << 30)  # a step of (2 - 0.1) / 10 s now
    assert markers == [] and "a stop now takes" not in caplog.text
    stopper.uploaded(7.0)  # the mirror's upload: 4 + 0.19 + 7 > 10
    stopper.measured(SaveRecord(30, "steps", 0.1, 4.0, tmp_path), 1 << 30)
    stopper.measured(SaveRecord(40, "steps", 0.1, 5.0, tmp_path), 1 << 30)
    assert [m[0] for m in markers] == ["grace_short"] and caplog.text.count("a stop now takes") == 1
    assert markers[0][1]["stop_s"] > 10 and markers[0][1]["grace_s"] == 10.0, markers
    assert "its upload to the mirror 7.00 s" in caplog.text
    stopper.flag.request(15)  # SIGTERM
    stopper.stopping(40)
    assert markers[-1] == ("stopping", {"step": 40, "cause": "SIGTERM", "grace_s": 10.0, "stop_s": 12.0}), markers
    clock.advance(3.0)
    loop = LoopState()
    with pytest.raises(Preempted) as e:
        stopper.stop(loop, checkpoint=tmp_path / "step_000000040")
    assert e.value.timing == {"durable_s": 3.0, "grace_s": 10.0, "margin_s": 7.0}, e.value.timing
    assert e.value.cause == "SIGTERM"
