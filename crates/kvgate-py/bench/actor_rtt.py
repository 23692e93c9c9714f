"""What one Ray actor call costs on this machine: the round trip of an empty method, a
read, a select-and-book with a 1,500-token prompt and a free, 300 calls each, on a
selection actor (placement="actor"). The reason kvgate.ray keeps the selection service
in the router's process by default (docs/BENCHMARKS.md, "Inside Ray Serve").

    python crates/kvgate-py/bench/actor_rtt.py
"""

import asyncio
import time

import ray

import kvgate.ray as kray

CALLS = 300


async def measure(actor) -> None:
    await actor.sync_workers.remote({"w1": None, "w2": None})
    ids = list(range(1500))
    calls = [
        ("ready (empty method)", lambda i: actor.ready.remote()),
        ("open_requests", lambda i: actor.open_requests.remote()),
        ("select_and_book", lambda i: actor.select_and_book.remote(f"r{i}", ids, ["w1", "w2"], 32)),
        ("free", lambda i: actor.free.remote(f"r{i}")),
    ]
    for name, call in calls:
        ms = []
        for i in range(CALLS):
            start = time.perf_counter()
            await call(i)
            ms.append((time.perf_counter() - start) * 1e3)
        ms.sort()
        print(f"{name}: p50 {ms[CALLS // 2]:.3f} ms, p99 {ms[int(CALLS * 0.99)]:.3f} ms")


def main() -> None:
    ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    # least_loaded: a service that needs no KV events for this measurement.
    actor = kray.get_selection_actor(
        "rtt", "bench", {"placement": "actor", "block_size": 16, "policy": "least_loaded"}
    )
    try:
        asyncio.run(measure(actor))
    finally:
        ray.kill(actor)
        ray.shutdown()


if __name__ == "__main__":
    main()
