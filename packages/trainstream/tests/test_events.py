"""The decision log goes through logging.getLogger("trainstream"): what a library user sees without configuring
logging, with verbose=True, and with a logging configuration of their own; never the same event twice."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
from trainstream._events import EventLog

SCRIPT = """
import logging, sys
from trainstream._events import EventLog
setup = sys.argv[1]
if setup == "basic-info":
    logging.basicConfig(level=logging.INFO, format="app %(name)s %(levelname)s %(message)s")
elif setup == "file":
    logging.basicConfig(level=logging.INFO, filename=sys.argv[2])
log = EventLog(verbose=sys.argv[-1] == "verbose")
log.add("plan", "a decision")
log.add("optimizer", "a CPU detail", level=logging.DEBUG)
log.add("error", "a failure")
print("in the log:", len(log), file=sys.stdout)
"""


def _run(*args: str) -> tuple[str, str]:
    done = subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "in the log: 3\n"  # every event is kept for memory_report(), printed or not
    return done.stdout, done.stderr


def test_without_logging_configured_only_failures_are_printed():
    _out, err = _run("none", "quiet")
    assert err == "trainstream error: a failure\n"


def test_verbose_prints_decisions_once_on_stderr_but_no_detail():
    _out, err = _run("none", "verbose")
    assert err == "trainstream plan: a decision\ntrainstream error: a failure\n"


@pytest.mark.parametrize("verbose", ["quiet", "verbose"])
def test_an_application_s_console_logging_prints_each_event_once(verbose):
    _out, err = _run("basic-info", verbose)
    assert err == "app trainstream INFO plan: a decision\napp trainstream WARNING error: a failure\n"


def test_a_log_file_gets_the_events_and_verbose_still_prints_them(tmp_path):
    path = tmp_path / "app.log"
    _out, err = _run("file", str(path), "verbose")
    assert err == "trainstream plan: a decision\ntrainstream error: a failure\n"
    assert path.read_text() == "INFO:trainstream:plan: a decision\nWARNING:trainstream:error: a failure\n"
    _out, err = _run("file", str(path), "quiet")
    assert err == ""  # logging is configured: the application decides where failures go


def test_records_carry_the_event_and_details_log_at_debug(caplog):
    with caplog.at_level(logging.DEBUG, logger="trainstream"):
        log = EventLog()
        plan = log.add("plan", "a decision")
        detail = log.add("optimizer", "a CPU detail", level=logging.DEBUG)
    records = {r.getMessage(): r for r in caplog.records if r.name == "trainstream"}
    assert records["plan: a decision"].levelno == logging.INFO
    assert records["plan: a decision"].trainstream_event is plan
    assert records["optimizer: a CPU detail"].levelno == logging.DEBUG and detail.level == logging.DEBUG
    assert log.lines()[0].endswith("plan: a decision")  # memory_report()'s form keeps the time
