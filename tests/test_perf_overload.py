"""perf.overload: its outcome classes, its targets, and a tiny run through the proxy (today's defaults)."""
import json

from perf.overload import REFUSALS, classify, main, targets


def test_overload_counts_the_proxys_refusals_and_grpc_unavailable_as_rejected_and_other_errors_as_errors():
    assert classify("[StatusCode.UNAVAILABLE] proxy rule overload: Triton is at capacity and 40 requests wait "
                    "already; try again") == "overload"
    assert classify("[StatusCode.UNAVAILABLE] proxy rule overload: Triton is at capacity, the request waited its "
                    "turn too long; try again") == "overload_timed_out"
    assert classify("[StatusCode.UNAVAILABLE] Exceeds maximum queue size") == "queue_full"
    assert classify("[StatusCode.UNAVAILABLE] Request timeout expired") == "timed_out"
    assert classify("[StatusCode.UNAVAILABLE] failed to connect to all addresses") == "unavailable"
    assert set(REFUSALS) >= {"overload", "overload_timed_out", "queue_full", "timed_out", "unavailable"}
    assert classify("[StatusCode.INVALID_ARGUMENT] bad input").startswith("error: ")


def test_overload_targets_are_accepted_p99_at_4x_refusal_p99_at_every_level_and_nothing_lost():
    level = lambda factor, accepted, rejected, lost: {  # noqa: E731
        "factor": factor, "lost": lost, "accepted": {"n": 1, "p99_ms": accepted},
        "rejected": {"n": 1, "p99_ms": rejected} if rejected is not None else {"n": 0}}
    met = targets([level(1, 50, None, 0), level(4, 1900, 5, 0)])
    assert met["all_met"] and met["rejected_p99_ms"]["value"] == {"1x": None, "4x": 5}
    missed = targets([level(1, 50, 30, 0), level(4, 2100, 5, 2)])
    assert not any(missed[name]["met"] for name in ("accepted_p99_ms_at_4x", "rejected_p99_ms", "lost"))
    assert not missed["all_met"]


def test_overload_via_proxy_measures_through_serve_repo_and_records_the_proxys_bounds(tmp_path):
    out = tmp_path / "overload.json"
    main(["--seconds", "1", "--factors", "4", "--serve-flags=--queue-ms 100", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["via"] == "proxy" and result["serve_flags"] == ["--queue-ms", "100"]
    assert result["queue_ms"] == 100 and result["max_in_flight"] >= 16
    assert "--max-queue-size" not in result["build_flags"]  # build-repo's defaults: no Triton queue policy
    assert result["server_ready_after"] and result["machine"]["cpus"] >= 1
    (level,) = result["levels"]
    assert level["lost"] == 0 and level["errors"] == 0, level
    # 4x capacity against a 100 ms queue: the proxy refuses some, naming its rule.
    assert level["rejected_overload"]["n"] + level["rejected_overload_timed_out"]["n"] > 0, level
    assert level["accepted"]["n"] + level["rejected"]["n"] == level["sent"]
    assert set(result["targets"]) == {"accepted_p99_ms_at_4x", "rejected_p99_ms", "lost", "all_met"}
