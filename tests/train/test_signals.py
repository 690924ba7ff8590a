"""Signals during training are requests to stop between steps; a later one stops at once."""

from __future__ import annotations

import os
import signal
import time

import pytest

from diffusion_pipe.train.loop import _StopSignals


def handlers():
    return signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)


def test_signal_is_noted_and_a_later_one_stops_at_once():
    before = handlers()
    stops = _StopSignals(announce=False, same_request_s=0.2)
    try:
        assert stops.signal is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert stops.signal == signal.SIGTERM  # noted, nothing raised: the step goes on
        # one Ctrl-C under a launcher arrives twice, from the terminal and passed on: still one request
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stops.signal == signal.SIGTERM
        time.sleep(0.3)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        assert handlers() == before
    finally:
        stops.close()
    assert handlers() == before
