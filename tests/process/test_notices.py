"""Advance notices from the cloud and the stop measured against the kill's grace, with real training processes.

The metadata services are emulated on 127.0.0.1 by the test (``tests/helpers/metadata.py``); nothing else is ever
contacted. Each process is reached by events: a training process holds inside a step until the run is asked to stop
(``--hold_at``), or waits for a file the test makes (``--wait_file_at``), so nothing depends on the machine's speed.
"""

from __future__ import annotations

import re
import signal
import socket

import pytest
from helpers import PREEMPTED, Spawned, assert_same_final, cli_json, train_cmd
from helpers.metadata import MetadataService

from preempt.checkpoint.manager import CheckpointManager

MODEL = ["--epochs", "2", "--samples", "128", "--dropout", "0.3"]  # what the reference run trains too


def _valid_steps(save_dir) -> list[int]:
    return sorted(c.step for c in CheckpointManager(save_dir, owner=False).list() if c.status == "valid")


def _headers_as_the_platform_asks(service: MetadataService) -> None:
    """Every request carried what the platform requires; AWS's session token was asked for first, with a PUT."""
    reqs = service.requests
    assert reqs, "the emulator saw no request"
    assert all(r.status in (200, 404) for r in reqs), [(r.method, r.path, r.status) for r in reqs]
    if service.platform == "aws":
        assert (reqs[0].method, reqs[0].path) == ("PUT", "/latest/api/token"), reqs[0]
        assert reqs[0].headers.get("X-aws-ec2-metadata-token-ttl-seconds"), reqs[0].headers
        gets = [r for r in reqs if r.method == "GET"]
        assert gets and all(r.headers.get("X-aws-ec2-metadata-token") in service.tokens for r in gets), gets
    elif service.platform == "gce":
        assert all(r.headers.get("Metadata-Flavor") == "Google" for r in reqs), reqs
        assert any(r.query.get("wait_for_change") == "true" and "last_etag" in r.query for r in reqs), reqs
    else:
        assert all(r.headers.get("Metadata") == "true" for r in reqs), reqs
        assert any(r.path == "/metadata/scheduledevents" and r.query.get("api-version") for r in reqs), reqs


@pytest.mark.parametrize("platform", ["aws", "gce", "azure"])
def test_a_notice_stops_the_run_at_its_step_and_the_rerun_resumes_bit_exact(tmp_path, capsys, reference, platform):
    """The notice comes while the process is inside its 3rd step (held there until the run is asked to stop, which
    only the notice can do: no signal is sent): that step's run.step() saves and exits 75, the history names the
    notice and its deadline, and a rerun on a new machine (no notices) ends bit-exact."""
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    with MetadataService(platform, notice_in_s=120.0) as service:
        env = {**service.env(), "PREEMPT_NOTICES": platform}
        p = Spawned(train_cmd(save_dir, final, [*MODEL, "--every_steps", "5", "--hold_at", "step:3"]), env)
        assert p.wait_event("holding", point="step", n=3), p.output
        assert service.wait_requests(3), service.requests  # it has polled: it sees the notice come
        service.give_notice()
        rc = p.finish()
    assert rc == PREEMPTED, p.output
    notices = p.events_of("notice")
    assert len(notices) == 1 and notices[0]["platform"] == platform, p.events
    if platform != "gce":  # AWS and Azure say their time; GCE's preemption is 30 s after its notice
        assert notices[0]["deadline"] == pytest.approx(service.deadline, abs=1.0), (notices, service.deadline)
    else:
        assert notices[0]["deadline"] == pytest.approx(notices[0]["seen_at"] + 30.0, abs=0.01), notices
    (stop,) = p.events_of("stop")
    assert stop["step"] == 3 and stop["cause"].startswith(f"{platform} notice: "), stop
    assert 0 < stop["durable_s"] < stop["grace_s"] and stop["margin_s"] > 0, stop
    assert not p.events_of("signal_at"), p.events
    assert _valid_steps(save_dir)[-1] == 3
    _headers_as_the_platform_asks(service)
    rc, report = cli_json(capsys, "report", str(save_dir))
    assert (
        rc == 0 and report["stops"][0]["cause"] == stop["cause"] and report["stops"][0]["margin_s"] == stop["margin_s"]
    )

    again = Spawned(train_cmd(save_dir, final, MODEL))  # a new machine: no notice there
    assert again.finish() == 0, again.output
    assert again.events_of("resume", step=3), again.events
    assert_same_final(reference(MODEL), final)


def test_notices_are_off_by_default(tmp_path):
    """The endpoint variables of all three platforms set, no notices asked for: no request, the run completes."""
    with MetadataService("aws") as aws, MetadataService("gce") as gce, MetadataService("azure") as azure:
        env = {**aws.env(), **gce.env(), **azure.env(), "PREEMPT_NOTICES": ""}  # (unset, whatever pytest's is)
        p = Spawned(train_cmd(tmp_path / "run", None, [*MODEL, "--epochs", "1"]), env)
        assert p.finish() == 0, p.output
    assert aws.requests == [] and gce.requests == [] and azure.requests == []
    assert not p.events_of("notices_down") and not p.events_of("notice")


def test_an_unreachable_service_is_one_warning_and_the_run_completes(tmp_path):
    """Nothing listens at the endpoint: one ``notices_down`` event (its warning), the loop goes on, the run
    completes; held at its 2nd step until the test saw that event, so the watcher has tried while it trained."""
    with socket.socket() as s:  # a port of 127.0.0.1 that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    go = tmp_path / "go"
    env = {"PREEMPT_NOTICES": "aws", "AWS_EC2_METADATA_SERVICE_ENDPOINT": f"http://127.0.0.1:{port}"}
    p = Spawned(train_cmd(tmp_path / "run", None, [*MODEL, "--wait_file_at", f"step:2:{go}"]), env)
    assert p.wait_event("notices_down"), p.output
    go.touch()
    assert p.finish() == 0, p.output
    assert len(p.events_of("notices_down")) == 1, p.events
    # and the user reads it once
    assert len(re.findall(r"notices=aws: the metadata service at .* does not answer", p.output)) == 1, p.output
    assert p.events_of("complete"), p.events


def test_a_kubelet_kill_before_the_stop_is_durable_keeps_the_last_checkpoint(tmp_path, capsys, reference):
    """An emulated kubelet, with a grace (PREEMPT_GRACE_S) shorter than a checkpoint takes: the warning comes at the
    first checkpoint, before any signal; then SIGTERM, and SIGKILL once the grace is over while the stop's checkpoint
    is still being written (the process waits before its manifest). The periodic checkpoint before it is intact, the
    rerun says how many steps were lost and why, resumes from it and ends bit-exact."""
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    never = tmp_path / "never"  # the stop's commit waits for it: the kill comes first
    args = [*MODEL, "--every_steps", "3", "--sync_save", "--hold_at", "step:5", "--slow_commit", "0.05"]  # >= 0.05 s
    args += ["--wait_file_at", f"before_manifest:2:{never}"]
    p = Spawned(train_cmd(save_dir, final, args), {"PREEMPT_GRACE_S": "0.01"})
    warned = p.wait_event("grace_short")  # at the first checkpoint (step 3), timed: over 0.01 s
    assert warned is not None and warned["step"] == 3 and warned["grace_s"] == 0.01, p.output
    assert warned["stop_s"] > warned["grace_s"], warned
    assert p.wait_event("holding", point="step", n=5), p.output
    p.signal(signal.SIGTERM)  # the kubelet: SIGTERM, then SIGKILL when the grace is over
    assert p.wait_event("waiting", point="before_manifest", n=2), p.output  # the stop's checkpoint: not durable
    stopping = p.events_of("stopping")
    assert len(stopping) == 1 and stopping[0]["step"] == 5 and stopping[0]["cause"] == "SIGTERM", p.events
    p.signal(signal.SIGKILL)
    assert p.finish() == -signal.SIGKILL, p.output
    assert _valid_steps(save_dir) == [3], p.output  # the stop's write never damaged or replaced it
    rc, report = cli_json(capsys, "report", str(save_dir))
    assert rc == 0 and report["stops"][0]["killed_during_stop"] is True and report["stops"][0]["how"] == "killed", (
        report
    )

    again = Spawned(train_cmd(save_dir, final, MODEL))
    assert again.finish() == 0, again.output
    (resumed,) = again.events_of("resume")
    assert resumed["step"] == 3 and resumed["crashed"]["died_at"] == 5 and resumed["crashed"]["during_stop"], resumed
    assert re.search(
        r"the previous process died during its stop on SIGTERM \(killed before the stop's checkpoint was durable:"
        r" its grace 0\.01 s, .*\) at step 5: the 2 step\(s\) since step 3 will be recomputed",
        again.output,
    ), again.output
    assert_same_final(reference(MODEL), final)
