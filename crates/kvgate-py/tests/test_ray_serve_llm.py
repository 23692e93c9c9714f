"""kvgate.ray.llm under real Ray Serve LLM 2.60 with real vLLM (the CPU build, two
replicas of a tiny random Qwen3 with the real Qwen3 tokenizer), on Ray's direct-
streaming path: the README's snippet deployed as pasted (with this machine's CPU
settings merged into its LLMConfig), and beside it an app whose ingress cannot load
kvgate's native module. Requests arrive over HTTP through Ray's HAProxy; what the
engines cached comes from their own `usage.prompt_tokens_details.cached_tokens`, and
what kvgate booked from `kvgate.ray.llm.routing_stats`.

Slow by nature: the two deployments take 3-5 minutes to start on 2 cores."""

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from llm_stack import BLOCK_SIZE, MODEL_ID, REPO, Cluster

BROKEN = "/broken"  # the app whose ingress cannot import kvgate's native module


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    import ray

    if ray.is_initialized():  # an earlier test module's local Ray
        ray.shutdown()
    cluster = Cluster()
    try:
        # A copy of the pure-Python package first on the path, without `_native`.
        shadow = tmp_path_factory.mktemp("shadow")
        pkg = REPO / "crates" / "kvgate-py" / "python" / "kvgate"
        shutil.copytree(pkg, shadow / "kvgate", ignore=shutil.ignore_patterns("_native*", "__pycache__"))
        env = json.dumps({"PYTHONPATH": str(shadow)})
        # The broken app first, without waiting; the README's snippet then waits for itself.
        broken = subprocess.Popen(
            [sys.executable, str(Path(__file__).parent / "llm_stack.py"), "deploy",
             "--address", cluster.address, "--http-port", str(cluster.http_port),
             "--name", "broken", "--replicas", "1", "--kv-events-port-base", "15557",
             "--env", env],
            env=cluster.env,
        )
        cluster.deploy("--readme", str(REPO / "README.md"))
        assert broken.wait(timeout=900) == 0
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.stop()


def stats():
    """The snippet app's routing stats, summed over its router processes."""
    import kvgate.ray.llm

    by_process = kvgate.ray.llm.routing_stats("default")
    total = {"open_bookings": 0, "routed": {}, "lifecycle_events": 0, "decisions": 0}
    for s in by_process.values():
        total["open_bookings"] += s["open_bookings"]
        total["lifecycle_events"] += s["lifecycle_events"]
        total["decisions"] += s["decisions"]
        for w, n in s["routed"].items():
            total["routed"][w] = total["routed"].get(w, 0) + n
    return total


def settled_stats(timeout=30.0):
    """Stats once no booking is open (or the last ones seen at the timeout)."""
    deadline = time.time() + timeout
    while True:
        time.sleep(1.5)  # stats are published about once a second
        s = stats()
        if s["open_bookings"] == 0 or time.time() > deadline:
            return s


async def chat(session, base, content, *, system=None, max_tokens=4, stream=False,
               cancel_after_first=False, headers=None, body=None):
    """One chat request: (status, cached_tokens, prompt_tokens, json-or-None)."""
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": content}
    ]
    body = body if body is not None else {
        "model": MODEL_ID, "messages": messages, "max_tokens": max_tokens,
        "ignore_eos": True, "stream": stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    }
    async with session.post(f"{base}/v1/chat/completions", json=body, headers=headers) as resp:
        if resp.status != 200:
            return resp.status, None, None, await resp.text()
        if not stream:
            got = await resp.json()
            usage = got["usage"]
            return 200, usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"], got
        usage = None
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            if cancel_after_first:
                return 200, None, None, None  # leaves: the connection closes mid-stream
            event = json.loads(line[5:])
            if event.get("usage"):
                usage = event["usage"]
        return 200, usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"], None


def long_text(tag, words=500):
    return f"Document {tag}. " + " ".join(f"clause {tag}-{i} applies" for i in range(words // 3))


def run(coro):
    return asyncio.run(coro)


async def until_routing(session, base):
    """Until kvgate has a service (the replicas advertised their KV events)."""
    deadline = time.time() + 60
    while time.time() < deadline:
        status, _, _, _ = await chat(session, base, "warm up")
        if status == 200:
            return
        await asyncio.sleep(1.0)
    raise AssertionError(f"the app never routed: last status {status}")


def test_the_readme_snippet_serves_with_kvgate_routing(stack):
    async def scenario():
        async with aiohttp.ClientSession() as s:
            await until_routing(s, stack.url())
            status, _, prompt, got = await chat(s, stack.url(), "Say hello.")
            assert status == 200 and prompt > 0 and got["choices"]

    run(scenario())
    s = settled_stats()
    assert s["decisions"] >= 1 and s["open_bookings"] == 0, s


def test_a_cached_prompt_returns_to_its_holder(stack):
    async def scenario():
        async with aiohttp.ClientSession() as s:
            await until_routing(s, stack.url())
            for tag in ("a", "b", "c", "d"):
                text = long_text(tag)
                status, _, prompt, _ = await chat(s, stack.url(), text)
                assert status == 200
                await asyncio.sleep(0.5)  # the engine's KV events reach the index
                status, cached, prompt, _ = await chat(s, stack.url(), text)
                # All but the last partial block (and the engine's last-token rule) hit.
                assert cached >= prompt - 2 * BLOCK_SIZE, (tag, cached, prompt)

    run(scenario())


def test_a_shared_system_prompt_does_not_herd(stack):
    """A burst of 32 requests sharing one long system prompt, more than one replica's
    batch (16 sequences, which kvgate.ray.llm.build_openai_app passes on from the
    LLMConfig's engine_kwargs): once the holder's batch is full its lead ends, so part of
    the burst goes to the other replica although only one holds the prompt."""
    before = stats()["routed"]

    async def scenario():
        system = long_text("bank-policy", 700)
        async with aiohttp.ClientSession() as s:
            await until_routing(s, stack.url())
            return await asyncio.gather(
                *(chat(s, stack.url(), f"Customer {i} asks about card {i * 7919}.",
                       system=system, max_tokens=48) for i in range(32))
            )

    results = run(scenario())
    assert all(r[0] == 200 for r in results)
    after = settled_stats()
    routed = {w: n - before.get(w, 0) for w, n in after["routed"].items()}
    assert len(routed) == 2 and min(routed.values()) >= 6, routed
    # And the replicas still reuse the shared prompt: most prompt tokens hit.
    assert sum(r[1] for r in results) >= 0.6 * sum(r[2] for r in results)


def test_no_booking_is_left_after_a_burst_with_cancellations(stack):
    async def scenario():
        async with aiohttp.ClientSession() as s:
            await until_routing(s, stack.url())
            sem = asyncio.Semaphore(8)

            async def one(i):
                async with sem:
                    return await chat(s, stack.url(), long_text(f"burst-{i % 6}", 300) + f" q{i}",
                                      max_tokens=64, stream=True, cancel_after_first=(i % 5 == 0))

            return await asyncio.gather(*(one(i) for i in range(40)))

    results = run(scenario())
    assert all(r[0] == 200 for r in results), [r for r in results if r[0] != 200]
    s = settled_stats(timeout=60)
    assert s["open_bookings"] == 0, s
    assert s["lifecycle_events"] > 0, s


def test_a_duplicate_client_request_id_leaves_no_booking(stack):
    async def scenario():
        async with aiohttp.ClientSession() as s:
            await until_routing(s, stack.url())
            headers = {"x-request-id": "same-id-from-a-client"}
            return await asyncio.gather(
                *(chat(s, stack.url(), long_text(f"dup-{i}", 200), max_tokens=32, headers=headers)
                  for i in range(4))
            )

    assert all(r[0] == 200 for r in run(scenario()))
    assert settled_stats()["open_bookings"] == 0


def test_a_body_without_messages_is_400(stack):
    async def scenario():
        async with aiohttp.ClientSession() as s:
            await until_routing(s, stack.url())
            return await chat(s, stack.url(), "", body={"model": MODEL_ID, "max_tokens": 4})

    status, _, _, text = run(scenario())
    assert status == 400, (status, text)
    assert settled_stats()["open_bookings"] == 0


def test_kv_routing_without_the_selection_service_is_503(stack):
    async def scenario():
        async with aiohttp.ClientSession() as s:
            statuses = []
            for _ in range(3):
                status, _, _, text = await chat(s, stack.url(BROKEN), "Say hello.")
                statuses.append(status)
            return statuses

    assert run(scenario()) == [503, 503, 503]


def test_the_builder_passes_the_engines_batch_limits_to_kvgate():
    """build_openai_app tells kvgate's router the engines' max_num_seqs,
    max_num_batched_tokens and KV-cache size (num_gpu_blocks_override) from
    engine_kwargs, unless its kwargs set them; another router's config is left alone."""
    from kvgate.ray.llm import _pass_engine_limits

    ours = "kvgate.ray.llm:KVAwareRouter"
    rc = {"request_router_class": ours}
    _pass_engine_limits(rc, {"max_num_seqs": 16, "dtype": "bfloat16",
                             "num_gpu_blocks_override": 256})
    assert rc["request_router_kwargs"] == {"max_num_seqs": 16, "num_gpu_blocks": 256}
    rc = {"request_router_class": ours, "request_router_kwargs": {"max_num_seqs": 8}}
    _pass_engine_limits(rc, {"max_num_seqs": 16, "max_num_batched_tokens": 512})
    assert rc["request_router_kwargs"] == {"max_num_seqs": 8, "max_num_batched_tokens": 512}
    other = {"request_router_class": "ray.serve.llm.request_router:KVAwareRouter"}
    _pass_engine_limits(other, {"max_num_seqs": 16})
    assert "request_router_kwargs" not in other


def test_the_step_budget_each_engine_advertises_reaches_kvgate():
    """Ray's replicas advertise the step budget their engine resolved (the
    kv_event_metadata's max_num_batched_tokens, beside the block size): kvgate's time
    model takes it even where engine_kwargs left it unset, and the stats show it."""
    from types import SimpleNamespace

    from kvgate.ray.llm import _DeploymentRouting

    meta = {"endpoint": None, "replay_endpoint": None, "block_size": BLOCK_SIZE,
            "dp_rank": 0, "max_num_batched_tokens": 2048}
    replica = SimpleNamespace(replica_id=SimpleNamespace(unique_id="r1"),
                              routing_stats={"kv_event_metadata": meta})
    routing = _DeploymentRouting("app", "deployment", {"max_num_seqs": 16})
    asyncio.run(routing.sync([replica]))
    try:
        want = {"max_num_seqs": 16, "max_num_batched_tokens": 2048, "num_gpu_blocks": None}
        assert routing.svc.engine_limits() == want
        assert routing.stats()["engine_limits"] == want
    finally:
        routing.svc.close()


def test_the_builder_refuses_to_deploy_without_the_direct_streaming_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE")}
    code = (
        "import kvgate.ray.llm\n"
        "try:\n"
        "    kvgate.ray.llm.build_openai_app({'llm_configs': []})\n"
        "except ValueError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING=1" in out.stdout, out
    assert "RAY_SERVE_ENABLE_HA_PROXY=1" in out.stdout, out


def test_duplicate_ids_book_apart_and_each_completion_frees_one():
    from kvgate.ray.llm import _Bookings

    b = _Bookings()
    first, second = b.open("r"), b.open("r")
    assert first == "r" and second != first
    assert b.first_without_prefill("r") == first
    assert b.first_without_prefill("r") == second
    assert b.first_without_prefill("r") is None
    assert b.close("r") == first and b.close("r") == second and b.close("r") is None
    assert len(b) == 0
    third = b.open("x")
    b.drop("x", third)
    assert len(b) == 0 and b.close("x") is None
    # Bookings the service freed on its own (TTL: their completion was lost) are pruned.
    kept, lost = b.open("y"), b.open("z")
    b.prune(lambda booking_id: booking_id != lost)
    assert len(b) == 1 and b.oldest("z") is None and b.oldest("y") == kept
