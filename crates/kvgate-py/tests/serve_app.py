"""A Ray Serve application for the tests and the benchmark: an OpenAI ingress that
tokenizes before routing, and engine replicas that each front a `kvgate mock-engine`
with real ZeroMQ KV events, advertised through `record_routing_stats`.

`build_app(router_class, router_kwargs)` builds it with any request router (kvgate's,
Ray's PowerOfTwoChoices, Ray's PrefixCacheAffinityRouter), so the benchmark compares
routers on one application."""

import json
import subprocess
import time
import urllib.request
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

import aiohttp
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

import kvgate.ray as kray
from kvgate import KvgateUnavailableError

from conftest import QWEN3, free_port, kvgate_bin


def error(status: int, message: str, type_: str, code: str, retry_after: Optional[int] = None):
    headers = {"Retry-After": str(retry_after)} if retry_after else None
    return JSONResponse(
        {"error": {"message": message, "type": type_, "code": code}}, status, headers=headers
    )


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
class Engine:
    def __init__(self, block_size: int, engine_args: List[str]):
        self.block_size = block_size
        port, kv, replay = free_port(), free_port(), free_port()
        self.proc = subprocess.Popen(
            [kvgate_bin(), "mock-engine", "--port", str(port), "--kv-events-port", str(kv),
             "--replay-port", str(replay), "--tokenizer", str(QWEN3), "--model", "m",
             "--block-size", str(block_size), "--log", "warn", *engine_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        self.url = f"http://127.0.0.1:{port}"
        self.kv = f"tcp://127.0.0.1:{kv}"
        self.replay = f"tcp://127.0.0.1:{replay}"
        self.name = serve.get_replica_context().replica_id.unique_id
        deadline = time.time() + 60
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1):
                    break
            except OSError:
                if time.time() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("the mock engine did not start")
                time.sleep(0.1)
        self.session: Optional[aiohttp.ClientSession] = None

    def record_routing_stats(self) -> Dict[str, Any]:
        return kray.kv_event_metadata(
            self.kv, replay_endpoint=self.replay, block_size=self.block_size
        )

    async def _engine_stream(self, path: str, body: Dict[str, Any]):
        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
        async with self.session.post(self.url + path, json=body) as resp:
            if resp.status != 200:
                yield b"data: " + json.dumps(await resp.json()).encode()
                return
            async for line in resp.content:
                if line.strip():
                    yield line

    async def __call__(self, request: SimpleNamespace, request_token_ids=None):
        # An SSE comment naming the replica (clients ignore comment lines).
        yield f": replica={self.name}\n\n".encode()
        async for line in kray.track_stream(self._engine_stream(request.path, request.body)):
            yield line + b"\n"

    def __del__(self):
        self.proc.kill()


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
class Ingress:
    """OpenAI-style ingress: tokenizes before routing (Ray Serve LLM's order) and maps
    routing errors to HTTP: ValueError -> 400, KvgateUnavailableError -> 503."""

    def __init__(self, engine: DeploymentHandle, tokenize: bool = True):
        self.engine = engine
        self.tokenizer = kray.RoutingTokenizer.from_dir(str(QWEN3)) if tokenize else None

    async def __call__(self, request: Request):
        if request.url.path.endswith("/kvgate_loads"):
            # The bookings of a router that keeps its service in this process.
            svc = kray.local_service(serve.get_replica_context().app_name, "Engine")
            if svc is None:
                return JSONResponse({"open_requests": None, "loads": None})
            return JSONResponse({"open_requests": svc.open_requests(), "loads": svc.loads()})
        if request.url.path.endswith("/router_stats"):
            import router_timing

            return JSONResponse(router_timing.take())
        path = "/v1/chat/completions" if request.url.path.endswith("/chat/completions") else "/v1/completions"
        try:
            body = await request.json()
        except ValueError:
            return error(400, "the body is not valid JSON", "invalid_request_error", "malformed_json")
        if not isinstance(body, dict):
            return error(400, "the body must be a JSON object", "invalid_request_error", "malformed_json")
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        started = time.perf_counter()
        ids = None
        if self.tokenizer is not None:
            try:
                ids = await self.tokenizer.tokenize(
                    body, "chat" if path.endswith("chat/completions") else "completion"
                )
            except ValueError as e:
                return error(400, str(e), "invalid_request_error", "untokenizable")
        tokenized = time.perf_counter()
        # The routed request, shaped as Ray Serve LLM's request models are where
        # routers read it: `messages` or `prompt`, `max_tokens` and vLLM's `priority`,
        # as attributes.
        routed = SimpleNamespace(
            path=path, body=body, max_tokens=body.get("max_tokens"), priority=body.get("priority", 0)
        )
        if "messages" in body:
            routed.messages = body["messages"]
        else:
            routed.prompt = body.get("prompt")
        stream = self.engine.options(stream=True).remote(routed, request_token_ids=ids)
        try:
            first = await stream.__anext__()
        except ValueError as e:
            return error(400, str(e), "invalid_request_error", "missing_tokens")
        except (KvgateUnavailableError, RuntimeError) as e:
            return error(503, str(e), "server_error", "routing_unavailable", retry_after=1)
        first_item = time.perf_counter()
        timing = f": tokenize_ms={(tokenized - started) * 1e3:.3f} first_item_ms={(first_item - tokenized) * 1e3:.3f}\n\n"

        async def relay():
            yield timing.encode()
            yield first
            try:
                async for chunk in stream:
                    yield chunk
            except Exception as e:  # a stream that breaks ends with an error event
                err = {"error": {"message": str(e), "type": "server_error", "code": "upstream_error"}}
                yield f"data: {json.dumps(err)}\n\n".encode()

        return StreamingResponse(relay(), media_type="text/event-stream")


def build_app(
    router_class: str = "kvgate.ray:KVAwareRequestRouter",
    router_kwargs: Optional[Dict[str, Any]] = None,
    *,
    replicas: int = 2,
    block_size: int = 16,
    engine_args: Optional[List[str]] = None,
    tokenize: bool = True,
    ingress_env: Optional[Dict[str, str]] = None,
):
    engine = Engine.options(
        num_replicas=replicas,
        request_router_config=RequestRouterConfig(
            request_router_class=router_class,
            request_router_kwargs=router_kwargs if router_kwargs is not None else {"block_size": block_size},
            request_routing_stats_period_s=0.5,
        ),
    ).bind(block_size, engine_args or [])
    ingress = Ingress
    if ingress_env:
        ingress = Ingress.options(
            ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": ingress_env}}
        )
    return ingress.bind(engine, tokenize)


# -- routers timed where they choose (the benchmark's "router overhead") ----------------

# Each `choose_replicas` call's duration goes to router_timing.CALLS in the process
# the handle's router runs in (the ingress), read and cleared through `/router_stats`.


async def _timed_choose(router_super, candidate_replicas, pending_request):
    start, cpu_start = time.perf_counter(), time.thread_time()
    try:
        return await router_super.choose_replicas(candidate_replicas, pending_request)
    finally:
        import router_timing

        router_timing.CALLS.append((start, time.perf_counter()))
        router_timing.CPU_SECONDS.append(time.thread_time() - cpu_start)


# Routers timed where they choose. Ray pickles router classes by value, so the timings
# go to router_timing.CALLS through an import at call time (see router_timing.py).
class TimedKvgate(kray.KVAwareRequestRouter):
    async def choose_replicas(self, candidate_replicas, pending_request=None):
        return await _timed_choose(super(), candidate_replicas, pending_request)


from ray.serve._private.request_router.pow_2_router import (  # noqa: E402
    PowerOfTwoChoicesRequestRouter,
)


class TimedPow2(PowerOfTwoChoicesRequestRouter):
    async def choose_replicas(self, candidate_replicas, pending_request=None):
        return await _timed_choose(super(), candidate_replicas, pending_request)


try:  # Ray's text-prefix-tree router (importable without vLLM from this path; needs pyarrow)
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (  # noqa: E402
        PrefixCacheAffinityRouter,
    )

    class TimedPrefixTree(PrefixCacheAffinityRouter):
        async def choose_replicas(self, candidate_replicas, pending_request=None):
            return await _timed_choose(super(), candidate_replicas, pending_request)

except ImportError:  # pragma: no cover
    TimedPrefixTree = None
