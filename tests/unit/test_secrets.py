"""Secrets never printed or recorded (preempt._secrets): credentials in URLs, secrets on a command line."""

from __future__ import annotations

import sys

import pytest

from preempt._secrets import scrub_argv, userinfo
from preempt.cluster.environment import Environment, provenance

SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"


@pytest.mark.parametrize(
    ("url", "found"),
    [
        (f"s3://AKID:{SECRET}@bucket/run", f"AKID:{SECRET}"),
        ("s3://AKID:plain@bucket/run?x=1", "AKID:plain"),
        ("s3://bucket/user@host/run", ""),  # an '@' in the path, no credentials
        ("s3://bucket/run", ""),
        ("not a url", ""),
    ],
)
def test_userinfo_runs_to_the_last_at_sign_when_a_secret_holds_a_slash(url, found):
    assert userinfo(url) == found


def test_argv_scrubbed_by_the_rule():
    """a script given its mirror options on the command line recorded the secret in every
    manifest's provenance.argv (in the mirror too, and in ``preempt inspect URL``)."""
    argv = [
        "train.py",
        "--mirror",
        f"s3://AKID:{SECRET}@bucket/run",
        "--mirror-option",
        f"secret={SECRET}",
        "--mirror_options",
        f'{{"key": "AKID", "secret": "{SECRET}"}}',
        f"--aws-secret-access-key={SECRET}",
        "--api-key",
        "sk-123456",
        "--hf_token",
        "hf_abc",
        f"aws_secret_access_key={SECRET}",
        "--password=hunter2",
        "--keep_last",
        "3",
        "--lr=0.1",
        "batch_size=8",
    ]
    got = scrub_argv(argv)
    assert got == [
        "train.py",
        "--mirror",
        "s3://***@bucket/run",
        "--mirror-option",
        "***",
        "--mirror_options",
        "***",
        "--aws-secret-access-key=***",
        "--api-key",
        "***",
        "--hf_token",
        "***",
        "aws_secret_access_key=***",
        "--password=***",
        "--keep_last",
        "3",
        "--lr=0.1",
        "batch_size=8",
    ]
    assert not any(p in " ".join(got) for p in (*SECRET.split("/"), "sk-123456", "hf_abc", "hunter2"))


def test_a_manifest_records_the_scrubbed_command_line(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py", "--mirror", f"s3://AKID:{SECRET}@bucket/run", "--token", "t0k3n"])
    recorded = provenance(Environment.from_env())["argv"]
    assert recorded == ["train.py", "--mirror", "s3://***@bucket/run", "--token", "***"]
