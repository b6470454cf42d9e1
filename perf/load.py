"""The one load engine: closed-loop, open-loop and interleaved clients, every request timed, one result shape."""
from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import numpy as np

QUANTILES = (50, 90, 95, 99)


class Sample(NamedTuple):
    """One request: when it was due (open loop; the send time in a closed loop), sent and answered (monotonic
    seconds), and its error ("" when answered)."""

    due: float
    sent: float
    done: float
    error: str

    @property
    def latency(self) -> float:
        return self.done - self.sent


def _error(exc: BaseException) -> str:
    return (f"{type(exc).__name__}: {exc}"[:300]).strip() or type(exc).__name__


def timed(send: Callable[[], object], due: float | None = None) -> tuple[Sample, object]:
    """One call of `send` (which returns the answer or raises) as a Sample, and its answer (None on an error)."""
    sent = time.monotonic()
    try:
        answer, error = send(), ""
    except Exception as exc:  # noqa: BLE001 - a failed request is a result, not a crash
        answer, error = None, _error(exc)
    return Sample(sent if due is None else due, sent, time.monotonic(), error), answer


@dataclass
class Load:
    """What a run measured: every sample in its window, the window's seconds, and the first good answer."""

    concurrency: int
    seconds: float
    samples: list[Sample] = field(default_factory=list)
    first_answer: object = None
    loadavg_1min: list[float] = field(default_factory=list)

    def summary(self, rows: int = 1) -> dict:
        """The one result shape: requests answered, errors, img/s (whole batch intervals, and over the window),
        latency quantiles and the largest (ms), the first error."""
        good = [s for s in self.samples if not s.error]
        done = [s.done for s in good]
        rate = interval_rate(done)
        return {"concurrency": self.concurrency, "seconds": round(self.seconds, 3), "requests": len(good),
                "errors": len(self.samples) - len(good),
                "images_per_s": 0.0 if np.isnan(rate) else round(rows * rate, 3),
                "images_per_s_window": round(rows * len(good) / self.seconds, 3) if self.seconds > 0 else 0.0,
                **{k: v for k, v in spread([s.latency for s in good]).items() if k != "n"},
                "first_error": next((s.error for s in self.samples if s.error), None),
                **({"loadavg_1min": self.loadavg_1min} if self.loadavg_1min else {})}


def spread(latencies: list[float]) -> dict:
    """Latencies (seconds) -> {"n", "p50_ms", "p90_ms", "p95_ms", "p99_ms", "max_ms"}; only "n" when there are none."""
    if not latencies:
        return {"n": 0}
    ms = np.asarray(latencies) * 1000
    return {"n": len(ms), **{f"p{q}_ms": round(float(np.percentile(ms, q)), 3) for q in QUANTILES},
            "max_ms": round(float(ms.max()), 3)}


def interval_rate(times: list[float], burst: float = 0.01) -> float:
    """Completions per second between the first and the last completion seen.

    A batched server answers in bursts (8 responses at once every batch); counting completions in a fixed window
    would be off by up to one burst. Dropping the first burst and dividing by the span from it to the last
    completion measures whole batch intervals only."""
    times = sorted(times)
    if len(times) < 2:
        return float("nan")
    first_burst = sum(1 for t in times if t - times[0] <= burst)
    span = times[-1] - times[0]
    return (len(times) - first_burst) / span if span > 0 else float("nan")


Connect = Callable[[int], tuple[Callable[[], object], Callable[[], None]]]


def _clients(connect: Connect, indices, window: dict, load: Load, lock: threading.Lock,
             ready: threading.Barrier | None = None, count: list | None = None) -> None:
    """Closed-loop client threads: each opens its client, then (once `ready` is passed, `window` set) sends its next
    request when its last is answered, from window["start"] until window["end"] or until `count` requests are handed
    out; samples answered inside [window["measure"], window["end"]] are kept. A window that would keep none (a loaded
    machine, a short point: every request longer than the window) lasts until the first answer, so that a point
    measures something whatever the machine's speed; window["end"] then says when it ended."""

    def client(index: int) -> None:
        try:
            send, close = connect(index)
        except BaseException:
            if ready is not None:
                ready.abort()  # the run fails at once rather than waiting for this client
            raise
        try:
            if ready is not None:
                ready.wait()
            interval = window.get("interval", 0.0)
            next_send = window["start"] + index % len(indices) * interval / len(indices)
            while time.monotonic() < window["start"]:
                time.sleep(0.001)
            while time.monotonic() < window["end"] or (count is None and not load.samples and not window.get("over")):
                if interval:  # paced: this client's next request waits for its turn
                    time.sleep(max(0.0, min(next_send, window["end"]) - time.monotonic()))
                    next_send += interval
                    if time.monotonic() >= window["end"]:
                        return
                if count is not None:
                    with lock:
                        if count[0] <= 0:
                            return
                        count[0] -= 1
                sample, answer = timed(send)
                with lock:
                    late = sample.done > window["end"] and count is None and not load.samples and \
                        sample.sent >= window["measure"] and not window.get("over")
                    if late:  # the first answer of a window that kept none: the window ends with it
                        window["end"], window["over"] = sample.done, True
                    if window["measure"] <= sample.done <= window["end"]:
                        load.samples.append(sample)
                    if load.first_answer is None and not sample.error:
                        load.first_answer = answer
        finally:
            close()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in indices]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _process(connect: Connect, indices, window: dict, queue) -> None:
    load = Load(len(indices), 0.0)
    _clients(connect, indices, window, load, threading.Lock())
    queue.put(load.samples)


def closed_loop(connect: Connect, concurrency: int, seconds: float | None = None, *, requests: int | None = None,
                warmup: float = 0.0, processes: int = 0, rate: float | None = None,
                at_measure: Callable[[], None] | None = None) -> Load:
    """`concurrency` clients, each sending its next request the instant its last is answered: for `warmup` then
    `seconds` (samples of the second part kept), or until `requests` are sent. `connect(index)` opens one client
    in its own thread -> (send, close); send() returns the answer or raises. With `processes` the clients are
    spread over that many spawned processes (`connect` must pickle; gRPC and fork do not mix). With `rate`, the
    clients together send at most that many requests a second, each in its turn. `at_measure` is called as the kept
    window begins (e.g. to read the server's counters)."""
    load, lock = Load(concurrency, seconds or 0.0), threading.Lock()
    before = os.getloadavg()[0]
    if processes:
        ctx, procs = mp.get_context("spawn"), min(processes, concurrency)
        queue = ctx.Queue()
        start = time.monotonic() + 2.5 + 0.3 * procs  # spawn + imports + each client's connect
        window = {"start": start, "measure": start + warmup, "end": start + warmup + seconds,
                  "interval": concurrency / rate if rate else 0.0}
        workers = [ctx.Process(target=_process, args=(connect, range(i, concurrency, procs), window, queue))
                   for i in range(procs)]
        for worker in workers:
            worker.start()
        time.sleep(max(0.0, window["measure"] - time.monotonic()))
        if at_measure:
            at_measure()
        load.samples = [s for _ in workers for s in queue.get()]
        for worker in workers:
            worker.join()
    else:
        window: dict = {}

        def start_clock() -> None:  # once every client has connected, before any is released
            now = time.monotonic()
            window.update(start=now, measure=now + warmup, interval=concurrency / rate if rate else 0.0,
                          end=now + warmup + seconds if seconds is not None else float("inf"))

        ready = threading.Barrier(concurrency + 1, action=start_clock)
        count = [requests] if requests is not None else None
        runner = threading.Thread(target=_clients, args=(connect, range(concurrency), window, load, lock, ready, count))
        runner.start()
        ready.wait()
        now = window["start"]
        time.sleep(warmup)
        if at_measure:
            at_measure()
        runner.join()
        if seconds is None:
            load.seconds = time.monotonic() - now
        elif window.get("over"):  # stretched to its first answer
            load.seconds = window["end"] - window["measure"]
    load.loadavg_1min = [round(before, 2), round(os.getloadavg()[0], 2)]
    return load


class OpenLoop:
    """Requests sent at `rate` per second whether or not earlier ones were answered, as real users send them: a
    pacer hands request `index`, due at `due`, to a pool worker, which calls send(index, due) (it returns the answer
    or raises); until stop(), or after `requests`. `lag` is the worst delay between a request's due time and its
    start: above a few ms the pool, not the server, held requests back."""

    def __init__(self, send: Callable[[int, float], object], rate: float, requests: int | None = None,
                 workers: int = 400):
        self.send, self.rate, self.requests = send, rate, requests
        self.samples: list[Sample] = []
        self.lag, self.sending_s = 0.0, 0.0
        self._stop = threading.Event()
        # Enough workers that none waits for a free one even with a full queue behind a fault: a request's wait is
        # the server's, not ours (`lag` checks it).
        self._pool = ThreadPoolExecutor(max_workers=workers)
        self._pacer = threading.Thread(target=self._pace, daemon=True)

    def start(self) -> "OpenLoop":
        self.started = time.monotonic()
        self._pacer.start()
        return self

    def _pace(self) -> None:
        n = 0
        while not self._stop.is_set() and (self.requests is None or n < self.requests):
            due = self.started + n / self.rate
            if self._stop.wait(max(0.0, due - time.monotonic())):
                break
            self._pool.submit(self._one, n, due)
            n += 1
        self.sending_s = time.monotonic() - self.started  # how long handing every request out took
    def _one(self, index: int, due: float) -> None:
        self.lag = max(self.lag, time.monotonic() - due)
        sample, _ = timed(lambda: self.send(index, due), due)
        self.samples.append(sample)

    def stop(self, wait: bool = True) -> list[Sample]:
        """Stops sending; with `wait`, returns once every request sent has its outcome."""
        if self.requests is None:
            self._stop.set()
        self._pacer.join()
        self._pool.shutdown(wait=wait)
        return list(self.samples)


def interleaved(sends: dict[str, Callable[[], object]], seconds: float | None = None, *, rounds: int | None = None,
                warmup: float = 0.0, warm_rounds: int = 0) -> dict[str, Load]:
    """One client taking each of `sends` in turn, request by request, the order reversed every round, so that every
    way sees the same moments of the machine: their difference is theirs, not the minute's. For `warmup` then
    `seconds`, or `warm_rounds` then `rounds`; the kept samples per way."""
    loads = {name: Load(1, seconds or 0.0) for name in sends}
    before, begin = os.getloadavg()[0], time.monotonic()
    measure, end = begin + warmup, begin + warmup + seconds if seconds is not None else float("inf")
    index = 0
    while time.monotonic() < end and (rounds is None or index < warm_rounds + rounds):
        for name in (list(sends) if index % 2 == 0 else list(sends)[::-1]):
            sample, _ = timed(sends[name])
            if sample.sent >= measure and index >= warm_rounds:
                loads[name].samples.append(sample)
        index += 1
    for found in loads.values():
        found.loadavg_1min = [round(before, 2), round(os.getloadavg()[0], 2)]
    return loads


def in_process(step: Callable[[], object], rows: int, seconds: float, *, min_runs: int = 1,
               sync: Callable[[], object] = lambda: None, sync_every: int = 1) -> float:
    """The same clock for work run in this process, no server: `step()` once to warm (kernel selection, graphs),
    then again and again for `seconds` (at least `min_runs` times), `sync` (a device's queue drained) every
    `sync_every` runs and before the clock stops; `rows` per step, per second."""
    step()
    sync()
    done, begin = 0, time.perf_counter()
    while time.perf_counter() - begin < seconds or done < min_runs:
        step()
        done += 1
        if done % sync_every == 0:
            sync()
    sync()
    return rows * done / (time.perf_counter() - begin)
