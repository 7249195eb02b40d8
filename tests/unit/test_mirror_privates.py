"""s3fs's private parts, which the mirror reads in preempt/mirror/store.py alone (S3FS_PRIVATE there).

Checked against the installed s3fs, so that an s3fs release that drops or reshapes one fails here, naming it, and
not in a user's transfer; a store made on such a release refuses at once with the names.
"""

from __future__ import annotations

import re

import pytest

s3fs = pytest.importorskip("s3fs", reason="s3fs is not installed (pip install -e '.[mirror]')")

from preempt.errors import MirrorError  # noqa: E402
from preempt.mirror.store import S3FS_PRIVATE, MirrorStore, s3fs_missing  # noqa: E402

# no request is made: s3fs connects at its first call, and these tests make none
URL, OPTIONS = "s3://bucket/run", {"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s3cr3t-value"}


def test_the_installed_s3fs_has_every_private_part_the_mirror_reads() -> None:
    store = MirrorStore(URL, OPTIONS)
    assert isinstance(store.fs, s3fs.S3FileSystem)
    assert s3fs_missing(store.fs) == [], f"s3fs {s3fs.__version__}"
    # the errors of a cut-off transfer include the one a body cut off mid-read raises (aiohttp's payload error)
    assert any(e.__name__ == "ClientPayloadError" for e in s3fs.core.S3_RETRYABLE_ERRORS)


@pytest.mark.parametrize("name", S3FS_PRIVATE)
def test_a_store_on_an_s3fs_without_one_refuses_at_once_naming_it(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    owner, _, attribute = name.rpartition(".")
    target = {"S3FileSystem": s3fs.S3FileSystem, "s3fs.core": s3fs.core}[owner]
    monkeypatch.delattr(target, attribute)
    with pytest.raises(MirrorError, match=rf"s3fs \S+ lacks {re.escape(name)}, which the mirror reads"):
        MirrorStore(URL, OPTIONS)
