"""Ray's drain of a node read as a notice (preempt.cluster.ray_notice): the reading, the thread, with a fake GCS."""

from __future__ import annotations

import pickle
import sys
import threading

from preempt.cluster.notices import Platform
from preempt.cluster.ray_notice import RayWatcher, in_ray_worker, parse_ray
from preempt.errors import PeerLost, Preempted

NODE = "ab" * 28


def test_a_drain_of_this_node_is_a_notice_with_its_deadline():
    n = parse_ray({NODE: 1_800_000_030_500, "cd" * 28: 0}, NODE, now=1_800_000_000.0)
    assert n is not None and n.platform is Platform.RAY
    assert n.deadline == 1_800_000_030.5 and n.left(1_800_000_000.0) == 30.5
    assert n.cause.startswith("ray notice: node abababababab draining")


def test_a_drain_without_deadline_and_another_nodes_drain():
    n = parse_ray({NODE: 0}, NODE, now=5.0)
    assert n is not None and n.deadline is None
    assert parse_ray({"cd" * 28: 1}, NODE, now=5.0) is None
    assert parse_ray({}, NODE, now=5.0) is None


def test_the_watcher_calls_once_when_its_node_drains_and_keeps_its_own_bug():
    answers = [{}, {"cd" * 28: 9}, {NODE: 2_000}]
    seen: list = []
    got = threading.Event()

    def read():
        return answers.pop(0) if len(answers) > 1 else answers[0]

    w = RayWatcher(lambda n: (seen.append(n), got.set()), node_id=NODE, every_s=0.001, read=read).start()
    assert got.wait(10)
    w.close()
    assert len(seen) == 1 and seen[0].deadline == 2.0 and w.notice is seen[0]

    called = threading.Event()

    def broken(notice):
        called.set()
        raise KeyError("bug")

    w = RayWatcher(broken, node_id=NODE, every_s=0.001, read=lambda: {NODE: 0}).start()
    assert called.wait(10)  # close() joins the thread: the error is kept by then
    try:
        w.close()
    except KeyError:
        pass
    else:
        raise AssertionError("the watcher's own error was not raised by close()")


def test_a_gcs_that_does_not_answer_is_said_once():
    troubles: list[str] = []
    calls = threading.Event()

    def read():
        calls.set()
        raise ConnectionError("GCS unreachable")

    w = RayWatcher(lambda n: None, node_id=NODE, read=read, on_trouble=troubles.append).start()
    assert calls.wait(10)
    w.close()
    assert troubles == ["ConnectionError: GCS unreachable"]


def test_no_ray_imported_is_no_ray_worker():
    if "ray" not in sys.modules:
        assert not in_ray_worker()


def test_the_leaving_exceptions_pickle_whole():
    """Ray Train sends a worker's exception to its controller pickled."""
    lost = pickle.loads(pickle.dumps(PeerLost(1, 2, "the agreement at a safe point", RuntimeError("reset"))))
    assert (lost.code, lost.rank, lost.world_size, str(lost)) == (
        80,
        1,
        2,
        str(PeerLost(1, 2, "the agreement at a safe point", RuntimeError("reset"))),
    )
    e = pickle.loads(pickle.dumps(Preempted(75, 15, "/ck", requeued=True, cause="ray notice", timing={"a": 1.0})))
    got = (e.code, e.signum, e.checkpoint, e.requeued, e.cause, e.timing)
    assert got == (75, 15, "/ck", True, "ray notice", {"a": 1.0})


def test_the_driver_s_word_is_a_notice_without_deadline_and_a_drain_comes_first():
    got: list = []
    done = threading.Event()
    w = RayWatcher(
        lambda n: (got.append(n), done.set()), node_id=NODE, every_s=0.001, read=dict, read_stop=lambda: "SIGTERM"
    ).start()
    assert done.wait(10)
    w.close()
    assert got[0].platform is Platform.RAY and got[0].deadline is None
    assert got[0].cause == "ray notice: the driver was stopped (SIGTERM)"

    got.clear()
    done.clear()
    w = RayWatcher(
        lambda n: (got.append(n), done.set()),
        node_id=NODE,
        every_s=0.001,
        read=lambda: {NODE: 5_000},
        read_stop=lambda: "SIGTERM",
    ).start()
    assert done.wait(10)
    w.close()
    assert got[0].deadline == 5.0  # the drain's deadline, not the driver's none


def test_an_injected_gcs_reads_no_driver_word():
    w = RayWatcher(lambda n: None, node_id=NODE, read=dict)
    assert w.read_stop() is None
