"""Signals during training are requests to stop between steps; the same signal twice stops at once."""

from __future__ import annotations

import os
import signal

import pytest

from diffusion_pipe.train.loop import _StopSignals


def test_signal_is_noted_and_the_same_one_again_stops_at_once():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    stops = _StopSignals(announce=False)
    try:
        assert stops.signal is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert stops.signal == signal.SIGTERM  # noted, nothing raised: the step goes on
        os.kill(os.getpid(), signal.SIGINT)  # under torchrun Ctrl-C brings both: still one request
        assert stops.signal == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
        assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    finally:
        stops.close()
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
