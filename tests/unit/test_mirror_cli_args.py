"""What a command's DIR names (a local path, exactly as before, or a mirror's URL) and ``--mirror-option`` pairs
(preempt.cli.where). Pure: no server, no disk."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from preempt.cli.main import build_parser
from preempt.cli.where import Url, is_url, mirror_options, place


@pytest.mark.parametrize(
    "text",
    [
        "s3://bucket/runs/a",
        "S3://b/p",
        "gs://b",
        "file:///tmp/x",
        "az://c/d",
        "s3a://b/p/step_000000001",
        "x+y.z-1://h",
    ],
)
def test_a_scheme_and_two_slashes_make_a_url_kept_as_typed(text):
    got = place(text)
    assert is_url(got) and isinstance(got, Url) and got == text  # Path would fold "//"


@pytest.mark.parametrize(
    "text", ["runs/exp1", "/abs/dir", "s3:/one-slash", "./s3://x", "1s3://b", "C:\\runs", "dir:with:colons", "-"]
)
def test_anything_else_is_the_local_path_it_always_was(text):
    got = place(text)
    assert not is_url(got) and got == Path(text) and type(got) is type(Path(text))


def test_mirror_options_values_are_json_or_the_string():
    assert mirror_options(None) == {}
    got = mirror_options(
        [
            "endpoint_url=http://127.0.0.1:9000",
            "anon=true",
            "default_block_size=8388608",
            'config_kwargs={"read_timeout": 30}',
            "secret=a=b==",  # only the first '=' splits
            "key=",
            ' profile = "123"',  # JSON string: how to pass digits as a string
        ]
    )
    assert got == {
        "endpoint_url": "http://127.0.0.1:9000",
        "anon": True,
        "default_block_size": 8388608,
        "config_kwargs": {"read_timeout": 30},
        "secret": "a=b==",
        "key": "",
        "profile": "123",
    }


@pytest.mark.parametrize("bad", ["just-a-secret-value", "=value-without-key", "  =hidden9"])
def test_a_pair_without_key_is_refused_without_repeating_it(bad):
    with pytest.raises(argparse.ArgumentTypeError) as e:
        mirror_options(["anon=true", bad])
    assert "--mirror-option #2: expected KEY=VALUE" in str(e.value)
    assert bad.strip(" =") not in str(e.value)


def test_the_parser_takes_urls_and_options_where_it_should():
    parser = build_parser()
    args = parser.parse_args(["ls", "s3://b/run", "--mirror-option", "anon=true", "--mirror-option", "k=v"])
    assert is_url(args.dir) and args.mirror_option == ["anon=true", "k=v"]
    args = parser.parse_args(["verify", "runs/x", "latest"])
    assert args.dir == Path("runs/x") and not is_url(args.dir) and args.mirror_option is None
    args = parser.parse_args(["pull", "s3://b/run", "new/dir", "--step", "12", "--json"])
    assert is_url(args.dir) and args.save_dir == Path("new/dir") and args.step == 12 and args.json
    for command in (["prune", "x", "--keep-last", "1"], ["export", "x", "--out", "y"]):
        with pytest.raises(SystemExit):
            parser.parse_args([*command, "--mirror-option", "a=b"])  # a mirror's option means nothing there
