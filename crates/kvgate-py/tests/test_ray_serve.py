"""kvgate.ray under real Ray Serve (a local Ray started here, loopback only): engine
replicas each front a `kvgate mock-engine` with real ZeroMQ KV events advertised through
`record_routing_stats`; an ingress tokenizes before routing; requests arrive over HTTP."""

import asyncio
import json
import shutil
import time
from pathlib import Path

import aiohttp
import pytest
import ray
from ray import serve

import kvgate.ray as kray
from conftest import free_port
from serve_app import build_app

APP = "kv"  # placement="local": the service in the ingress process (the default)
ACTOR_APP = "kvactor"  # placement="actor": the service in the deployment's actor
BROKEN = "broken"
SLO = "slo"  # a TTFT objective no replica can meet (router kwargs)


@pytest.fixture(scope="module")
def serve_url(tmp_path_factory):
    ray.init(
        # Replicas import the test application (serve_app.py) from this directory.
        runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).parent)}},
        num_cpus=4,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        namespace="kvgate-tests",
        log_to_driver=False,
    )
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    # Engines that batch 16 sequences a step (vLLM on a small device), and a router told so.
    serve.run(
        build_app(
            router_kwargs={"block_size": 16, "max_num_seqs": 16},
            engine_args=["--max-num-seqs", "16"],
        ),
        name=APP,
        route_prefix=f"/{APP}",
    )
    serve.run(
        build_app(router_kwargs={"block_size": 16, "placement": "actor"}),
        name=ACTOR_APP,
        route_prefix=f"/{ACTOR_APP}",
    )
    serve.run(
        build_app(router_kwargs={"block_size": 16, "slo_ttft_ms": 0.001}, replicas=1),
        name=SLO,
        route_prefix=f"/{SLO}",
    )
    # An ingress whose process cannot import kvgate's native module: a copy of the
    # pure-Python package first on its path, without `_native`.
    shadow = tmp_path_factory.mktemp("shadow")
    pkg = Path(kray.__file__).parents[1]  # kvgate/ (kvgate.ray is kvgate/ray/__init__.py)
    shutil.copytree(pkg, shadow / "kvgate", ignore=shutil.ignore_patterns("_native*", "__pycache__"))
    serve.run(
        build_app(
            replicas=1,
            tokenize=False,
            ingress_env={"PYTHONPATH": f"{shadow}:{Path(__file__).parent}"},
        ),
        name=BROKEN,
        route_prefix=f"/{BROKEN}",
    )
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    for app in (APP, ACTOR_APP, BROKEN, SLO):
        try:
            ray.kill(kray.get_selection_actor(app, "Engine"))
        except ValueError:
            pass
    ray.shutdown()


def actor():
    return kray.get_selection_actor(ACTOR_APP, "Engine")


async def bookings(session, url, app):
    """(open request bookings, per-replica loads) of an app's selection service."""
    if app == ACTOR_APP:
        return await actor().open_requests.remote(), await actor().loads.remote()
    async with session.get(f"{url}/{app}/kvgate_loads") as resp:
        got = await resp.json()
    return got["open_requests"], got["loads"]


async def chat(session, url, content, *, max_tokens=8, cancel_after_first=False, prefix="/" + APP,
               priority=None):
    """One streamed chat request; returns (status, replica, cached_tokens, prompt_tokens, body)."""
    body = {"model": "m", "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "ignore_eos": True}
    if priority is not None:
        body["priority"] = priority  # vLLM's: lower is handled earlier
    async with session.post(f"{url}{prefix}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            return resp.status, None, None, None, await resp.json(), resp.headers
        replica, usage = None, None
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith(": replica="):
                replica = line.split("=", 1)[1]
            elif line.startswith("data:") and line != "data: [DONE]":
                if cancel_after_first:
                    return 200, replica, None, None, None, resp.headers
                event = json.loads(line[5:])
                if event.get("usage"):
                    usage = event["usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"] if usage else None
        return 200, replica, cached, usage and usage["prompt_tokens"], None, resp.headers


def run(coro):
    return asyncio.run(coro)


async def until_advertised(session, url, app, n=2):
    """Until the app's service knows its replicas' KV-event endpoints."""
    deadline = time.time() + 30
    while time.time() < deadline:
        await chat(session, url, "warm up", prefix=f"/{app}")
        try:
            _, loads = await bookings(session, url, app)
        except ValueError:
            loads = None
        if loads and len(loads) >= n:
            return
        await asyncio.sleep(0.3)
    raise AssertionError("the replicas never reached the selection service")


@pytest.mark.parametrize("app", [APP, ACTOR_APP])
def test_a_prompt_cached_on_one_replica_is_routed_back_to_it(serve_url, app):
    async def scenario():
        async with aiohttp.ClientSession() as s:
            # Replicas register within a routing-stats period of the first request.
            await until_advertised(s, serve_url, app)
            await asyncio.sleep(1.0)
            content = f"Summarise the following report for {app}. " + "quarterly revenue grew " * 120
            status, first, _, _, _, _ = await chat(s, serve_url, content, prefix=f"/{app}")
            assert status == 200 and first
            await asyncio.sleep(0.5)  # the engine's KV events reach the index
            for _ in range(3):
                status, replica, cached, prompt, _, _ = await chat(
                    s, serve_url, content, prefix=f"/{app}"
                )
                assert replica == first
                assert cached >= 0.9 * prompt, (cached, prompt)

    run(scenario())


def test_a_shared_prefix_does_not_herd(serve_url):
    """32 requests at once on one system prompt, twice a replica's batch: once the
    holder's batch is full its lead ends, so the other replica takes part of the burst."""

    async def scenario():
        system = "You are a support agent for a bank. Policies follow. " + "policy clause " * 150
        async with aiohttp.ClientSession() as s:
            await until_advertised(s, serve_url, APP)
            results = await asyncio.gather(
                *(chat(s, serve_url, f"{system} Customer {i} asks about card {i * 7919}.",
                       max_tokens=64) for i in range(32))
            )
        replicas = [r[1] for r in results]
        assert all(r[0] == 200 for r in results)
        counts = {r: replicas.count(r) for r in set(replicas)}
        assert len(counts) == 2 and min(counts.values()) >= 6, counts

    run(scenario())


@pytest.mark.parametrize("app", [APP, ACTOR_APP])
def test_no_bookings_remain_after_a_burst_with_client_cancellations(serve_url, app):
    async def scenario():
        async with aiohttp.ClientSession() as s:
            await until_advertised(s, serve_url, app)
            results = await asyncio.gather(
                *(chat(s, serve_url, f"burst request {i} " + "filler " * (20 + i),
                       max_tokens=48, cancel_after_first=(i % 5 == 0), prefix=f"/{app}")
                  for i in range(40)),
                return_exceptions=True,
            )
            failed = [r if isinstance(r, Exception) else r[:5] for r in results
                      if isinstance(r, Exception) or r[0] != 200]
            assert not failed, failed
            deadline = time.time() + 20
            while time.time() < deadline:
                open_, loads = await bookings(s, serve_url, app)
                if open_ == 0 and all(l["in_flight"] == 0 for l in loads.values()):
                    return
                await asyncio.sleep(0.2)
        raise AssertionError(f"bookings left: {open_}, loads {loads}")

    run(scenario())


def test_a_request_without_token_ids_is_a_400_with_an_openai_error(serve_url):
    async def scenario():
        async with aiohttp.ClientSession() as s:
            await until_advertised(s, serve_url, APP)
            # A list of prompts has no single prompt: no token ids to route on.
            body = {"model": "m", "prompt": ["one", "two"], "max_tokens": 2}
            async with s.post(f"{serve_url}/{APP}/v1/completions", json=body) as resp:
                assert resp.status == 400
                err = (await resp.json())["error"]
                assert err["code"] == "missing_tokens" and "token ids" in err["message"]
            # A body the engine would reject: 400 from the tokenizer.
            body = {"model": "m", "messages": "not a list"}
            async with s.post(f"{serve_url}/{APP}/v1/chat/completions", json=body) as resp:
                assert resp.status == 400
                err = (await resp.json())["error"]
                assert err["type"] == "invalid_request_error" and err["code"] == "untokenizable"

    run(scenario())


def test_a_missing_native_module_is_a_503_not_a_silent_fallback(serve_url):
    async def scenario():
        async with aiohttp.ClientSession() as s:
            status, _, _, _, err, headers = await chat(s, serve_url, "hello", prefix=f"/{BROKEN}")
        assert status == 503, err
        assert headers.get("Retry-After") == "1"
        assert "native module" in err["error"]["message"], err

    run(scenario())


@pytest.mark.parametrize("app", [APP, ACTOR_APP])
def test_a_booking_sees_its_first_token_and_ends_with_the_stream(serve_url, app):
    """Booked when routed (prefill tokens charged), prefill done at the first token
    (reported by the replica), freed at the end."""
    async def scenario():
        async with aiohttp.ClientSession() as s:
            await until_advertised(s, serve_url, app)
            body = {"model": "m", "max_tokens": 400, "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"long answer {app} " + "x " * 300}]}
            async with s.post(f"{serve_url}/{app}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                seen = []
                async for raw in resp.content:
                    if raw.startswith(b"data:"):
                        break
                # Mid-stream: one booking, its prefill done.
                deadline = time.time() + 10
                while time.time() < deadline:
                    open_, loads = await bookings(s, serve_url, app)
                    seen.append((open_, loads))
                    busy = [l for l in loads.values() if l["in_flight"] == 1]
                    if open_ == 1 and busy and busy[0]["prefill_tokens"] == 0:
                        break
                    await asyncio.sleep(0.05)
                else:
                    raise AssertionError(f"prefill never marked done: {seen[-3:]}")
                async for _ in resp.content:
                    pass
            deadline = time.time() + 10
            while time.time() < deadline:
                open_, loads = await bookings(s, serve_url, app)
                if open_ == 0:
                    return
                await asyncio.sleep(0.05)
            raise AssertionError(f"the booking outlived its stream: {open_}, {loads}")

    run(scenario())


def test_a_deployments_objective_sheds_by_the_bodys_priority(serve_url):
    """End to end through Ray Serve: a deployment's TTFT objective (router kwargs) that no
    replica is predicted to meet refuses a request whose body's vLLM priority makes it
    sheddable (503 from the ingress, naming the objective) and serves one at the
    default priority on the closest miss."""

    async def go():
        async with aiohttp.ClientSession() as s:
            await until_advertised(s, serve_url, SLO, n=1)
            shed = await chat(s, serve_url, "whenever you can", prefix=f"/{SLO}", priority=1)
            served = await chat(s, serve_url, "right away", prefix=f"/{SLO}")
            return shed, served

    shed, served = run(go())
    assert shed[0] == 503, shed
    assert "latency objective" in shed[4]["error"]["message"], shed
    assert served[0] == 200, served
