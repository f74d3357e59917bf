"""dipaco.runtime: the Ctrl-C handler of every dipaco command."""

import os
import signal
import time

import pytest

from dipaco.runtime import Terminated, raise_if_interrupted, sigint_stops_training


def test_ctrl_c_raises_at_once_and_again_at_the_next_check_then_the_handler_is_put_back(sigint_from_a_terminal):
    before = signal.getsignal(signal.SIGINT)
    with sigint_stops_training():
        raise_if_interrupted()  # nothing arrived: no-op
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        with pytest.raises(KeyboardInterrupt):  # remembered, for a check after a lost exception
            raise_if_interrupted()
    assert signal.getsignal(signal.SIGINT) is before
    raise_if_interrupted()  # forgotten once the command is over


def test_an_inherited_ignored_sigint_stays_ignored():
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)  # e.g. a job started in the background with nohup
    try:
        with sigint_stops_training():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
            raise_if_interrupted()
    finally:
        signal.signal(signal.SIGINT, before)


def test_sigterm_stops_training_as_ctrl_c_does_and_is_told_apart(sigterm_by_default):
    before = signal.getsignal(signal.SIGTERM)
    with sigint_stops_training():
        with pytest.raises(Terminated):  # a KeyboardInterrupt: every Ctrl-C path handles it
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        with pytest.raises(Terminated):
            raise_if_interrupted()
    assert signal.getsignal(signal.SIGTERM) is before
    assert issubclass(Terminated, KeyboardInterrupt)


def test_a_sigterm_handler_someone_else_installed_is_kept(sigterm_by_default):
    def theirs(signum, frame):
        pass

    before = signal.signal(signal.SIGTERM, theirs)
    try:
        with sigint_stops_training():
            assert signal.getsignal(signal.SIGTERM) is theirs
    finally:
        signal.signal(signal.SIGTERM, before)
