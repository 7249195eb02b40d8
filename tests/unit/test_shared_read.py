"""The ranks' restore together: which rank reads which bytes (``shared_read.byte_ranges``, pure), which range a rank of
one machine claims next (``shared_read.claim``, pure), and a restore's files taken from another source than the disk,
still checked against the manifest (``files.reading_from``)."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from preempt.checkpoint import files
from preempt.checkpoint.hashed_io import FileDigest
from preempt.cluster.shared_read import ByteRange, byte_ranges, claim, hashing, reading_order
from preempt.errors import CorruptCheckpointError

BLOCK = 4096


def covered(ranges: list[ByteRange], sizes: list[int]) -> list[list[int]]:
    """Each byte's owner (-1: nobody), asserting that no byte is read twice."""
    owner = [[-1] * s for s in sizes]
    for p in ranges:
        for i in range(p.offset, p.offset + p.length):
            assert owner[p.file][i] == -1, (p, i)
            owner[p.file][i] = p.owner
    return owner


@pytest.mark.parametrize(
    ("sizes", "ranks"),
    [([10 * BLOCK + 7], 2), ([3, 5 * BLOCK, 0, 2 * BLOCK + 1], 2), ([100 * BLOCK, 33], 3), ([BLOCK], 4), ([], 2)],
)
def test_every_byte_is_read_once_by_one_rank_in_aligned_ranges(sizes, ranks):
    ranges = byte_ranges(sizes, ranks, largest=4 * BLOCK, block=BLOCK)
    owner = covered(ranges, sizes)
    assert all(o >= 0 for file in owner for o in file)
    for p in ranges:
        assert p.offset % BLOCK == 0 and 0 < p.length <= 4 * BLOCK
        assert p.length % BLOCK == 0 or p.offset + p.length == sizes[p.file]  # short only at the file's end


def test_shares_are_contiguous_balanced_to_a_block_and_exchanged_round_by_round():
    sizes = [6 * BLOCK, 10 * BLOCK]
    ranges = byte_ranges(sizes, 2, largest=2 * BLOCK, block=BLOCK)
    # rank 0: the first 8 blocks of the stream, rank 1 the last 8
    assert [(p.file, p.offset // BLOCK, p.owner) for p in ranges] == [
        (0, 0, 0), (1, 2, 1),
        (0, 2, 0), (1, 4, 1),
        (0, 4, 0), (1, 6, 1),
        (1, 0, 0), (1, 8, 1),
    ]  # fmt: skip
    shares = [sum(p.length for p in ranges if p.owner == r) for r in range(2)]
    assert shares == [8 * BLOCK, 8 * BLOCK]


def test_a_cut_inside_a_block_moves_to_its_start():
    ranges = byte_ranges([9 * BLOCK + 100], 2, largest=BLOCK * 64, block=BLOCK)
    assert [(p.offset, p.length, p.owner) for p in ranges] == [(0, 4 * BLOCK, 0), (4 * BLOCK, 5 * BLOCK + 100, 1)]


def test_one_rank_reads_everything():
    sizes = [5, 3 * BLOCK]
    ranges = byte_ranges(sizes, 1, largest=BLOCK, block=BLOCK)
    assert {p.owner for p in ranges} == {0} and all(o == 0 for f in covered(ranges, sizes) for o in f)


@pytest.mark.parametrize(("ranks", "largest"), [(0, BLOCK), (2, BLOCK + 1), (2, 0)])
def test_bad_arguments_name_the_field(ranks, largest):
    with pytest.raises(ValueError, match="ranks|largest"):
        byte_ranges([BLOCK], ranks, largest=largest, block=BLOCK)


def digest_of(data: bytes) -> FileDigest:
    return FileDigest(len(data), xxhash.xxh3_128_hexdigest(data))


def test_read_all_takes_what_a_source_gives_and_checks_its_digest(tmp_path):
    on_disk, given = b"a" * 5000, b"b" * 300
    (tmp_path / "disk.bin").write_bytes(on_disk)
    listed = {"disk.bin": digest_of(on_disk), "given.bin": digest_of(given)}  # given.bin is not on the disk
    asked = []

    def source(where, entries, names):
        asked.append((where, list(names)))
        return {"given.bin": (np.frombuffer(given, dtype=np.uint8), digest_of(given))}

    with files.reading_from(source):
        got = files.read_all(tmp_path, listed, ["disk.bin", "given.bin"])
    assert asked == [(tmp_path, ["disk.bin", "given.bin"])]
    assert bytes(got["disk.bin"]) == on_disk and bytes(got["given.bin"]) == given
    # outside the block the source is not asked
    with pytest.raises(CorruptCheckpointError, match="given.bin: missing"):
        files.read_all(tmp_path, listed, ["disk.bin", "given.bin"])


def test_a_given_file_of_another_digest_is_damage(tmp_path):
    listed = {"given.bin": digest_of(b"right")}

    def source(where, entries, names):
        return {"given.bin": (np.frombuffer(b"wrong", dtype=np.uint8), digest_of(b"wrong"))}

    with files.reading_from(source), pytest.raises(CorruptCheckpointError, match="xxh3 mismatch"):
        files.read_all(tmp_path, listed, ["given.bin"])


def test_files_in_memory_all_ranks_map_are_hashed_once_the_largest_first_to_the_least_loaded_rank():
    assert hashing([10, 700, 300, 5], 2) == [1, 0, 1, 1]
    assert hashing([4, 4], 3) == [0, 1] and hashing([], 2) == [] and hashing([9, 1], 1) == [0, 0]


def test_a_rank_reads_its_own_share_from_the_front_first():
    assert claim(0, [(0, 3), (0, 3)]) == (0, 0)
    assert claim(1, [(3, 3), (1, 3)]) == (1, 1)


def test_a_rank_done_with_its_share_takes_the_last_range_of_the_share_with_the_most_left():
    """A rank the device serves more slowly does not hold the others up: what it has not begun is read by another."""
    assert claim(0, [(3, 3), (1, 5), (2, 4)]) == (1, 4)
    assert claim(2, [(1, 4), (1, 4), (2, 2)]) == (0, 3)  # equals: the lowest rank's


def test_a_shares_first_range_is_never_taken_and_nothing_is_claimed_twice():
    """Every rank with a share reads a part of it (its first range), however slowly it starts."""
    assert claim(0, [(2, 2), (0, 1)]) is None
    assert claim(0, [(2, 2), (0, 2)]) == (1, 1)
    assert claim(1, [(0, 0), (4, 4)]) is None


@pytest.mark.parametrize("order", [[0, 0, 0, 1, 1, 0, 1], [1, 1, 1, 1, 1, 0, 0], [0, 1, 0, 1, 0, 1, 0]])
def test_whatever_the_order_of_the_claims_every_range_is_read_once(order):
    left = [(0, 4), (0, 3)]
    taken = []
    for rank in order + [0, 1] * 8:
        got = claim(rank, left)
        if got is None:
            continue
        r, i = got
        taken.append((r, i))
        first, end = left[r]
        left[r] = (i + 1, end) if r == rank else (first, i)
    assert sorted(taken) == [(0, i) for i in range(4)] + [(1, i) for i in range(3)]


def test_a_share_is_read_by_the_ranges_offsets_so_that_every_file_is_hashed_from_its_beginning_early():
    """Rank 0's share holds a whole file and the head of the next: it reads both heads first, so that the ranks that
    hash them can begin as soon as the first ranges are in, rather than once every share is read."""
    largest = 4 * BLOCK
    ranges = byte_ranges([12 * BLOCK, 20 * BLOCK], 2, largest=largest, block=BLOCK)
    first, second = reading_order(ranges, 2)
    assert [(p.file, p.offset) for p in first] == [(0, 0), (1, 0), (0, largest), (0, 2 * largest)]
    assert [(p.file, p.offset) for p in second] == [(1, 4 * BLOCK), (1, 8 * BLOCK), (1, 12 * BLOCK), (1, 16 * BLOCK)]
    assert sorted(first + second, key=ranges.index) == ranges
