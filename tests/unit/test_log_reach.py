"""preempt's lines reach the user whatever the script does to logging, each once (``preempt._log``): nothing set up,
``basicConfig(level=WARNING)`` as transformers' example scripts do, ``basicConfig(level=INFO)``, a console handler of
the application's at WARNING, logs to a file only, the preempt logger quieted on purpose."""

from __future__ import annotations

import io
import logging

import pytest

from preempt import _log


class Err:
    """What was written to sys.stderr (pytest's capture, read through capsys)."""

    def __init__(self, capsys: pytest.CaptureFixture[str]) -> None:
        self.capsys = capsys
        self.text = ""

    def getvalue(self) -> str:
        self.text += self.capsys.readouterr().err
        return self.text


@pytest.fixture
def fresh_logging(capsys):
    """The root and preempt loggers bare (pytest's own capture handlers off the root), restored afterwards; what
    reaches sys.stderr is read through capsys."""
    root, ours = logging.getLogger(), _log.log
    saved = (list(root.handlers), root.level, list(ours.handlers), ours.level, ours.propagate)
    root.handlers[:] = []
    ours.handlers[:] = []
    ours.setLevel(logging.NOTSET)
    ours.propagate = True
    yield Err(capsys)
    root.handlers[:] = []  # (pytest's capture handler of the test's call, which the test took off)
    root.handlers[:], ours.handlers[:] = saved[0], saved[2]
    root.setLevel(saved[1])
    ours.setLevel(saved[3])
    ours.propagate = saved[4]


def bare() -> None:
    """Takes pytest's capture handlers off the root logger (they are put there for each phase of a test)."""
    logging.getLogger().handlers[:] = []


def app_console(level: int = logging.NOTSET) -> io.StringIO:
    """The application's own console handler on the root logger, writing to a buffer of its own."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setLevel(level)
    handler.setFormatter(logging.Formatter("APP %(levelname)s %(message)s"))
    logging.getLogger().addHandler(handler)
    return out


def say() -> None:
    _log.setup()
    _log.log.info("resumed from step 7")
    _log.log.warning("a warning")


def test_nothing_set_up_prints_preempts_own_lines(fresh_logging):
    bare()
    say()
    assert fresh_logging.getvalue().splitlines() == ["[preempt] resumed from step 7", "[preempt] warning: a warning"]


def test_a_root_logger_at_warning_still_shows_the_info_lines_through_the_apps_handler(fresh_logging):
    bare()
    logging.getLogger().setLevel(logging.WARNING)
    app = app_console()
    say()
    assert app.getvalue().splitlines() == ["APP INFO resumed from step 7", "APP WARNING a warning"]
    assert fresh_logging.getvalue() == ""  # not twice


def test_an_app_console_at_warning_leaves_the_info_lines_to_preempts_handler(fresh_logging):
    bare()
    app = app_console(logging.WARNING)
    say()
    assert app.getvalue().splitlines() == ["APP WARNING a warning"]
    assert fresh_logging.getvalue().splitlines() == ["[preempt] resumed from step 7"]  # each line once


def test_logs_to_a_file_only_still_reach_the_console(fresh_logging, tmp_path):
    bare()
    logging.basicConfig(level=logging.WARNING, filename=tmp_path / "app.log")
    say()
    assert fresh_logging.getvalue().splitlines() == ["[preempt] resumed from step 7", "[preempt] warning: a warning"]
    assert "resumed from step 7" in (tmp_path / "app.log").read_text()


def test_a_level_set_on_the_preempt_logger_or_given_is_kept(fresh_logging):
    bare()
    _log.log.setLevel(logging.WARNING)  # the application quiets preempt on purpose
    say()
    assert fresh_logging.getvalue().splitlines() == ["[preempt] warning: a warning"]
    _log.setup("ERROR")  # log_level= / PREEMPT_LOG_LEVEL
    _log.log.warning("quiet now")
    assert "quiet now" not in fresh_logging.getvalue()


def test_setup_twice_attaches_one_handler(fresh_logging):
    bare()
    _log.setup()
    _log.setup()
    say()
    assert fresh_logging.getvalue().count("resumed from step 7") == 1
