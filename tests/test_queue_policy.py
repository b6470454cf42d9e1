"""A bounded queue (build-repo --max-queue-size): overflow is rejected at once, the rest answered."""
import threading

import numpy as np
import tritonclient.grpc as grpcclient

from common.modelconfig import read_config
from support import SMALL, build


def test_bounded_queue_rejects_overflow_and_answers_the_rest_when_requests_burst(tmp_path, start_server):
    repo = tmp_path / "repo"
    build(repo, "--max-batch-size", "1", "--max-queue-size", "1", "--queue-timeout-ms", "60000")
    policy = read_config(repo / SMALL).dynamic_batching.default_queue_policy
    assert (policy.max_queue_size, policy.default_timeout_microseconds) == (1, 60_000_000)
    images = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
    outcomes, gate = [], threading.Barrier(12)
    server = start_server(repo)
    def send():
        client = grpcclient.InferenceServerClient(server.grpc_url)
        tensor = grpcclient.InferInput("IMAGE", list(images.shape), "FP32")
        tensor.set_data_from_numpy(images)
        gate.wait()
        try:
            outcomes.append(client.infer(SMALL, [tensor]).as_numpy("LOGITS").shape)
        except Exception as exc:  # noqa: BLE001 - the outcome is what we check
            outcomes.append(str(exc))
    threads = [threading.Thread(target=send) for _ in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert grpcclient.InferenceServerClient(server.grpc_url).is_server_ready()
    answered = [o for o in outcomes if o == (1, 1000)]
    rejected = [o for o in outcomes if isinstance(o, str)]
    assert len(outcomes) == 12 and len(answered) + len(rejected) == 12  # one answer each, nothing lost
    # 12 requests at once, one ~20+ ms inference at a time, room for one waiting: most must bounce.
    assert answered and rejected
    assert all("queue size" in message.lower() for message in rejected), rejected[:2]


def test_default_build_sets_no_queue_policy_so_the_batcher_keeps_prefetching(repository):
    """A queue policy turns Triton 2.51's prefetching off, and with it comes the 500 ms wait at low load."""
    for model in (SMALL, f"{SMALL}_preprocess"):
        assert not read_config(repository / model).dynamic_batching.HasField("default_queue_policy"), model


def test_queue_bounds_are_written_when_asked_for(tmp_path):
    build(tmp_path / "repo", "--max-queue-size", "128", "--queue-timeout-ms", "10000")
    policy = read_config(tmp_path / "repo" / SMALL).dynamic_batching.default_queue_policy
    assert (policy.max_queue_size, policy.default_timeout_microseconds) == (128, 10_000_000)


def test_unbounded_queue_when_asked_for_with_zeros(tmp_path):
    build(tmp_path / "repo", "--max-queue-size", "0", "--queue-timeout-ms", "0")
    assert not read_config(tmp_path / "repo" / SMALL).dynamic_batching.HasField("default_queue_policy")


def test_live_batching_override_keeps_the_queue_bounds():
    from perf.loadgen import batching_override

    policy = {"max_queue_size": 128, "default_timeout_microseconds": 10_000_000}
    base = {"max_batch_size": 8, "dynamic_batching": {"max_queue_delay_microseconds": 0,
                                                      "default_queue_policy": policy}}
    changed = batching_override(base, 4, 500)
    assert changed["dynamic_batching"]["default_queue_policy"] == policy
    assert changed["dynamic_batching"]["max_queue_delay_microseconds"] == 500
