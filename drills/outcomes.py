"""What a drill under traffic reports from its requests' outcomes (drills.traffic): failed, lost, wrong, the
good answers' p99 around the fault, the longest wait, and recovery counted three ways (see summary)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SHED = "Exceeds maximum queue size"


@dataclass
class Outcome:
    stream: str
    sent: float       # seconds since the fault (negative: before it)
    waited: float
    result: str       # ok, wrong, error, lost
    detail: str = ""


def summary(outcomes: list[Outcome], comes_back: bool) -> dict:
    failed = [o for o in outcomes if o.result == "error"]
    good = [o for o in outcomes if o.result == "ok"]
    around = sorted(o.waited for o in good if -5 <= o.sent <= 15)
    errors: dict[str, int] = {}
    for o in failed:
        key = o.detail[:90]
        errors[key] = errors.get(key, 0) + 1
    result = {
        "sent": len(outcomes), "ok": len(good), "wrong": sum(o.result == "wrong" for o in outcomes),
        "lost": sum(o.result == "lost" for o in outcomes), "failed": len(failed),
        "failed_sent_before_fault": sum(o.sent < 0 for o in failed),
        "failed_sent_after_fault": sum(o.sent >= 0 for o in failed),
        "last_failure_answered_after_s": round(max((o.sent + o.waited for o in failed), default=0.0), 2),
        "good_p99_around_fault_s": round(float(np.percentile(around, 99)), 3) if around else None,
        "longest_wait_s": round(max((o.waited for o in outcomes), default=0.0), 2),
        "longest_wait_by_stream_s": {stream: round(max(o.waited for o in outcomes if o.stream == stream), 2)
                                     for stream in sorted({o.stream for o in outcomes})},
        # Refused at once because the model's queue was full (the bound doing its job under overload).
        "failed_queue_full": sum(SHED in o.detail for o in failed),
        "errors": dict(sorted(errors.items(), key=lambda item: -item[1])[:6]),
    }
    if comes_back:
        answering, clean, unshed = {}, {}, {}
        for stream in sorted({o.stream for o in outcomes}):
            ours = [o for o in outcomes if o.stream == stream]
            # Recovery as the issue counts it: the first correct answer to a request sent after the fault.
            after = [o.sent + o.waited for o in ours if o.result == "ok" and o.sent >= 0]
            answering[stream] = round(min(after), 2) if after else None
            # Stricter: the first correct answer to a request sent after this stream's last failure
            # (0: it never failed; None: it was still failing when the drill ended).
            clean[stream] = _clean_after([o for o in ours if o.result == "ok" or o.sent < 0], ours)
            # The same, counting queue-full refusals as no failure: at ~100 % of capacity the backlog a
            # fault leaves never drains (arrivals = service), so the bound keeps refusing the excess.
            unshed[stream] = _clean_after([o for o in ours if o.result == "ok" or o.sent < 0 or SHED in o.detail],
                                          ours)
        result["answering_again_after_s"] = answering
        result["first_correct_after_s"] = None if None in answering.values() else max(answering.values())
        result["no_failures_after_s"] = clean
        # Recovery, the headline: every stream answers correctly and fails no more.
        first = result["first_correct_after_s"]
        result["recovery_s"] = None if None in clean.values() or first is None else max(first, *clean.values())
        result["recovery_but_queue_full_s"] = (None if None in unshed.values() or first is None
                                               else max(first, *unshed.values()))
    return result


def _clean_after(fine: list[Outcome], ours: list[Outcome]) -> float | None:
    """First correct answer to a request sent after the last one not in `fine` (0: none; None: still failing)."""
    fine_ids = {id(o) for o in fine}
    last_bad = max((o.sent for o in ours if id(o) not in fine_ids), default=None)
    later = [o.sent + o.waited for o in ours if o.result == "ok" and last_bad is not None and o.sent > last_bad]
    return round(min(later), 2) if later else (0.0 if last_bad is None else None)
