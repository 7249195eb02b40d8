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


def test_the_secrets_a_process_holds_are_scrubbed_by_value_wherever_they_are(caplog):
    """A secret inside a JSON argument (``--options '{"secret": S}'``) was recorded: the rule found secrets by the
    names around them only. The secrets a process holds (its mirror's credentials and options under secret-like keys,
    the AWS variables) are replaced wherever they appear: an argument, JSON inside one (escaped too), a URL's query,
    a log line and its traceback."""
    import json
    import logging
    import urllib.parse

    from preempt import _secrets

    key, secret, token = "AKIAHELDKEY000000001", "h3ld/Secret+Value/0123456789", "held-session-token-0123"
    url = "s3://AKIAURLKEY0000000001:url/Secret0123@bucket/run"
    options = {"key": key, "secret": secret, "endpoint_url": "http://127.0.0.1:9", "config_kwargs": {"x": "visible1"}}
    held = _secrets.of_mirror(url, options)
    assert key in held and secret in held and "AKIAURLKEY0000000001" in held and "url/Secret0123" not in held
    assert "http://127.0.0.1:9" not in held and "visible1" not in held  # not under a secret-like key
    environ = {"AWS_SECRET_ACCESS_KEY": "env-secret-0123456", "AWS_SESSION_TOKEN": token, "AWS_REGION": "us-east-1"}
    environ["TOKENIZERS_PARALLELISM"] = "enabled"  # named like a secret, not an object store's credential
    assert sorted(_secrets.of_environ(environ)) == sorted(["env-secret-0123456", token])
    _secrets.hold([*held, *_secrets.of_environ(environ), "short"])
    assert "short" not in _secrets.held()  # fewer than MIN_LENGTH characters: would blank other words
    argv = [
        "train.py",
        "--options",
        json.dumps(options),
        f"--note=x{token}y",
        f"http://h/?sig={urllib.parse.quote(secret, safe='')}",
    ]
    scrubbed = scrub_argv(argv)
    assert scrubbed[2] == json.dumps({**options, "key": "***", "secret": "***"}), scrubbed
    assert scrubbed[3:] == ["--note=x***y", "http://h/?sig=***"], scrubbed
    escaped = json.dumps(secret)[1:-1].replace("/", "\\/")  # JSON may escape '/'
    assert _secrets.scrub(f"a {escaped} b") == "a *** b"
    logger = logging.getLogger("preempt")
    with caplog.at_level(logging.INFO, logger="preempt"):
        try:
            raise RuntimeError(f"denied for {secret}")
        except RuntimeError:
            logger.exception("cannot reach the mirror with %s", key)
    text = caplog.text
    assert secret not in text and key not in text and "cannot reach the mirror with ***" in text, text
