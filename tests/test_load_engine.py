"""perf/load.py, the one load engine, on a stand-in server (a sleep): what a closed loop keeps and says."""
from __future__ import annotations

import threading
import time

from perf.load import closed_loop


def _slow(seconds: float):
    def connect(index: int):
        return (lambda: time.sleep(seconds) or "answer"), (lambda: None)
    return connect


def test_a_window_shorter_than_every_request_lasts_until_its_first_answer_when_measured():
    """A 1 s point on a loaded machine kept no request (each took longer): the bench wrote 0 requests and NaN."""
    load = closed_loop(_slow(0.5), 2, 0.1)
    summary = load.summary()
    assert summary["requests"] >= 1 and summary["errors"] == 0 and load.first_answer == "answer"
    assert load.seconds >= 0.4 and summary["images_per_s_window"] > 0  # the window as it was, not as asked


def test_a_window_keeps_only_what_is_answered_inside_it_when_requests_are_short():
    load = closed_loop(_slow(0.01), 3, 0.5, warmup=0.2)
    assert abs(load.seconds - 0.5) < 1e-9 and load.summary()["requests"] > 10
    assert all(s.done >= s.sent for s in load.samples)


def test_errors_are_samples_and_a_failing_client_ends_the_stretched_window_when_it_fails():
    calls = threading.Lock()

    def connect(index: int):
        def send():
            with calls:
                time.sleep(0.3)
            raise RuntimeError("refused")
        return send, (lambda: None)
    summary = closed_loop(connect, 1, 0.05).summary()
    assert summary["requests"] == 0 and summary["errors"] >= 1 and summary["first_error"] == "RuntimeError: refused"
