"""kvgate.ray.llm: kvgate as Ray Serve LLM's KV-aware request router.

Owns the glue between Ray Serve LLM's own KV-aware path and kvgate's selection service;
nothing here scores or books (that is ``kvgate._native.SelectionService``, the Rust
code ``kvgate serve`` routes with). One line in an ``LLMConfig`` turns it on::

    deployment_config={"request_router_config": {
        "request_router_class": "kvgate.ray.llm:KVAwareRouter"}}

with stock ``VLLMEngine`` replicas and no ai-dynamo. How Ray 2.60's path runs, and what
each piece here takes from it:

* ``KVAwareRouter`` subclasses Ray's ``ray.serve.llm.request_router.KVAwareRouter``, so
  Ray treats the deployment as KV-aware (it checks ``issubclass``): the engines publish
  vLLM's ZMQ KV events and advertise them through ``record_routing_stats`` as
  ``kv_event_metadata``; in direct-streaming mode the ``LLMRouter`` ingress tokenizes
  each body and asks the router with ``request_token_ids``; the engine wrapper sends
  each request's lifecycle (prefill complete, decode progress, completed), keyed by the
  Serve request id, to the ingress's ``KVTokenTracker.on_lifecycle_events``.
* ``_DeploymentRouting`` (one per deployment and process, shared by every router
  instance Ray makes there) holds the selection service: it subscribes to every
  replica's KV events (endpoints and block size from ``kv_event_metadata``), books each
  routed request under the Serve request id, and takes over the tracker's
  ``on_lifecycle_events`` so Ray's lifecycle drives kvgate's ledger (prefill done, decode
  progress, free). Ray's tracker otherwise idles: without ai-dynamo it has no service.
* ``build_openai_app``: Ray's ``build_openai_app`` with kvgate's router filled in and a
  deploy-time check of the environment this path needs.

Failure semantics on Ray's direct path (``choose_replica(..., _reserve=False)``, where an
exception reaches the ingress): a prompt the router cannot score raises ``ValueError``
(the ingress answers 400) and a selection service that cannot run raises
``KvgateUnavailableError``, a ``RuntimeError`` (503). A request without token ids (a body
with neither messages nor prompt, a list of prompts, a truncated body) routes by load,
as Ray's own class does; so does a process with no tracker (HAProxy's fallback router).

Bookings are freed by the engine's completion report; the service's TTL sweep
(``booking_ttl_s``) is the backstop for a request routed but never dispatched.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import random
import time
from typing import Any, Deque, Dict, List, Optional, Tuple

import ray
from ray.serve.llm.request_router import KVAwareRouter as _RayKVAwareRouter

from kvgate._errors import KvgateUnavailableError
from kvgate.ray import (
    ACTOR_NAMESPACE,
    KV_EVENT_METADATA_KEY,
    REQUEST_TOKEN_IDS_KWARG,
    SERVICE_KWARGS,
    _expected_output_tokens,
    _Fleet,
    _new_service,
    _objective,
    _objective_defaults,
)

logger = logging.getLogger("ray.serve")

__all__ = ["KVAwareRouter", "build_openai_app", "routing_stats", "DIRECT_STREAMING_ENV"]

#: What Ray Serve LLM's KV-aware path needs in the environment of ``ray start`` and of
#: the deploying process (read by Ray at import).
DIRECT_STREAMING_ENV = (
    "RAY_SERVE_ENABLE_HA_PROXY",
    "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING",
    "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY",
)
#: The engines' limits, which ``build_openai_app`` copies from each LLMConfig's
#: ``engine_kwargs`` (vLLM's name) into kvgate's ``request_router_kwargs`` (kvgate's).
_ENGINE_LIMITS = {
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "num_gpu_blocks_override": "num_gpu_blocks",
}
#: Decision times kept for ``routing_stats`` (the newest).
_DECISION_SAMPLES = 10_000
#: How often the routing stats are published while they change.
_STATS_PERIOD_S = 1.0


def _kv_token_tracker():
    """The ``KVTokenTracker`` Ray Serve LLM's ``LLMRouter`` built in this process, if any."""
    from ray.llm._internal.serve.routing_policies.kv_aware.kv_token_tracker import (
        get_kv_token_tracker,
    )

    return get_kv_token_tracker()


class _Bookings:
    """Serve request id -> the ids kvgate booked under, oldest first. Ray's lifecycle
    events carry only the Serve request id, which a client may set (``x-request-id``)
    and so repeat: a second open request with the same id books under a suffixed id,
    and each lifecycle event applies to the oldest booking of that id (every completion
    frees one booking, so none is left behind)."""

    def __init__(self) -> None:
        self._by_request: Dict[str, Deque[List[Any]]] = {}
        self._serial = 0
        self._count = 0

    def open(self, request_id: str) -> str:
        queue = self._by_request.setdefault(request_id, collections.deque())
        if queue:
            self._serial += 1
            booking_id = f"{request_id}#kvgate-dup-{self._serial}"
        else:
            booking_id = request_id
        queue.append([booking_id, False])  # [booking id, prefill reported]
        self._count += 1
        return booking_id

    def drop(self, request_id: str, booking_id: str) -> None:
        """Forgets one booking (it was never dispatched)."""
        queue = self._by_request.get(request_id)
        if queue is None:
            return
        for entry in queue:
            if entry[0] == booking_id:
                queue.remove(entry)
                self._count -= 1
                break
        if not queue:
            del self._by_request[request_id]

    def first_without_prefill(self, request_id: str) -> Optional[str]:
        for entry in self._by_request.get(request_id, ()):
            if not entry[1]:
                entry[1] = True
                return entry[0]
        return None

    def oldest(self, request_id: str) -> Optional[str]:
        queue = self._by_request.get(request_id)
        return queue[0][0] if queue else None

    def close(self, request_id: str) -> Optional[str]:
        queue = self._by_request.get(request_id)
        if not queue:
            return None
        booking_id = queue.popleft()[0]
        self._count -= 1
        if not queue:
            del self._by_request[request_id]
        return booking_id

    def prune(self, is_open) -> None:
        """Forgets the bookings the service no longer holds (freed by its TTL sweep
        because their completion was lost)."""
        for request_id in list(self._by_request):
            queue = self._by_request[request_id]
            kept = collections.deque(e for e in queue if is_open(e[0]))
            self._count -= len(queue) - len(kept)
            if kept:
                self._by_request[request_id] = kept
            else:
                del self._by_request[request_id]

    def __len__(self) -> int:
        return self._count


class _DeploymentRouting:
    """One deployment's kvgate routing in one process: the selection service (created
    when the first replica advertises its block size), the replicas it has been told
    about, the bookings by Serve request id, and the lifecycle intake."""

    def __init__(self, app_name: str, deployment_name: str, service_kwargs: Dict[str, Any]):
        self.app_name = app_name
        self.deployment_name = deployment_name
        self._service_kwargs = service_kwargs
        #: The service and what each replica last advertised to it (kvgate.ray's
        #: ``_Fleet``); None until a replica advertises its block size.
        self._fleet: Optional[_Fleet] = None
        self.block_size: Optional[int] = None
        self.bookings = _Bookings()
        self._decision_seconds: Deque[float] = collections.deque(maxlen=_DECISION_SAMPLES)
        self._routed: Dict[str, int] = collections.Counter()
        self._by_load = 0
        self._lifecycle_events = 0
        self._unknown_lifecycle = 0
        self._stats_actor = None
        self._publish_scheduled = False
        self._last_publish = 0.0

    # -- replicas ----------------------------------------------------------------------

    @property
    def svc(self) -> Any:
        return self._fleet.svc if self._fleet is not None else None

    async def sync(self, replicas) -> None:
        """Tells the service about replicas whose advertised KV events changed (the
        service is made with the block size the first advertisement gives; the service
        refuses a replica that advertises another). A replica without
        ``kv_event_metadata`` yet is routed on load only."""
        members = {
            r.replica_id.unique_id: (r.routing_stats or {}).get(KV_EVENT_METADATA_KEY)
            for r in replicas
        }
        if self._fleet is None:
            first = next((m for m in members.values() if m is not None), None)
            if first is None:
                return  # no block size yet: nothing to tell
            self.block_size = int(first["block_size"])
            kwargs = {"block_size": self.block_size, "model": self.deployment_name}
            kwargs.update(self._service_kwargs)
            if first.get("max_num_batched_tokens"):
                # The step budget as the engine resolved it (Ray advertises it beside
                # the block size): it holds even where engine_kwargs left it unset.
                kwargs["max_num_batched_tokens"] = int(first["max_num_batched_tokens"])
            self._fleet = _Fleet(_new_service(kwargs, "the LLMRouter ingress"))
            logger.info(
                "kvgate: routing %s/%s with kvgate's %s policy (block size %d)",
                self.app_name, self.deployment_name, self.svc.policy, self.block_size,
            )
        await self._fleet.sync(members)

    async def forget(self, names: List[str]) -> None:
        if self._fleet is not None:
            await self._fleet.remove(names)

    # -- decisions ---------------------------------------------------------------------

    def select_and_book(
        self,
        request_id: str,
        token_ids: List[int],
        names: List[str],
        expected: Optional[int],
        objective: Dict[str, Any],
    ) -> Tuple[str, str]:
        """(chosen replica name, booking id). Raises ValueError for a prompt the
        service rejects, KvgateUnavailableError when it cannot route."""
        if self.svc is None:
            raise KvgateUnavailableError(
                "kvgate: no replica of this deployment has advertised its KV events "
                "(kv_event_metadata) yet; retry shortly"
            )
        if len(self.bookings) > 2 * self.svc.open_requests() + 1024:
            self.bookings.prune(lambda b: self.svc.booked_worker(b) is not None)
        booking_id = self.bookings.open(request_id)
        start = time.perf_counter()
        try:
            s = self.svc.select_and_book_now(booking_id, token_ids, names, expected, **objective)
        except BaseException:
            self.bookings.drop(request_id, booking_id)
            raise
        self._decision_seconds.append(time.perf_counter() - start)
        self._routed[s.worker_id] += 1
        return s.worker_id, booking_id

    def unbook(self, request_id: str, booking_id: str) -> None:
        self.bookings.drop(request_id, booking_id)
        if self.svc is not None:
            self.svc.free_now(booking_id)

    def least_loaded(self, candidates):
        """A candidate with the fewest requests in flight in kvgate's ledger (ties at
        random): for requests with nothing to score on."""
        self._by_load += 1
        loads = self.svc.loads() if self.svc is not None else {}
        in_flight = [loads.get(r.replica_id.unique_id, {}).get("in_flight", 0) for r in candidates]
        least = min(in_flight)
        return random.choice([r for r, n in zip(candidates, in_flight) if n == least])

    # -- Ray's lifecycle events ----------------------------------------------------------

    async def on_lifecycle_events(self, events: List[tuple]) -> None:
        """Takes the place of ``KVTokenTracker.on_lifecycle_events``: the engines'
        ``(hook, args)`` reports, in order, applied to kvgate's ledger."""
        for hook, args in events:
            self._lifecycle_events += 1
            request_id = args[0] if args else None
            if self.svc is None or not isinstance(request_id, str):
                self._unknown_lifecycle += 1
                continue
            if hook == "on_prefill_complete":
                booking_id = self.bookings.first_without_prefill(request_id)
                known = booking_id is not None and await self.svc.prefill_done(booking_id)
            elif hook == "on_decode_progress":
                booking_id = self.bookings.oldest(request_id)
                known = booking_id is not None and await self.svc.decode_progress(
                    booking_id, int(args[1])
                )
            elif hook == "on_request_completed":
                booking_id = self.bookings.close(request_id)
                known = booking_id is not None and self.svc.free_now(booking_id)
            else:
                logger.warning("kvgate: ignoring unknown lifecycle hook %r", hook)
                known = False
            if not known:
                self._unknown_lifecycle += 1
        self.maybe_publish()

    async def on_reservations_created(self, reservations: List[Any]) -> None:
        """Takes the place of ``KVTokenTracker.on_reservations_created``: kvgate's
        bookings are not replicated between ingress replicas (each keeps its own
        ledger), so peers' Dynamo reservations are ignored."""
        return None

    # -- what an operator (and the tests) can read -------------------------------------------

    def stats(self) -> Dict[str, Any]:
        seconds = sorted(self._decision_seconds)

        def pct(p):
            return seconds[min(len(seconds) - 1, int(p / 100 * len(seconds)))] if seconds else None

        return {
            "deployment": self.deployment_name,
            "policy": self.svc.policy if self.svc is not None else None,
            "block_size": self.block_size,
            "workers": self.svc.workers() if self.svc is not None else [],
            "engine_limits": self.svc.engine_limits() if self.svc is not None else None,
            "open_bookings": self.svc.open_requests() if self.svc is not None else 0,
            "loads": self.svc.loads() if self.svc is not None else {},
            "routed": dict(self._routed),
            "routed_by_load": self._by_load,
            "lifecycle_events": self._lifecycle_events,
            "lifecycle_events_without_booking": self._unknown_lifecycle,
            "decisions": len(seconds),
            "decision_p50_ms": pct(50) * 1e3 if seconds else None,
            "decision_p99_ms": pct(99) * 1e3 if seconds else None,
            "published_at": time.time(),
        }

    def maybe_publish(self) -> None:
        """Publishes ``stats()`` to the deployment's stats actor (``routing_stats``) at
        most once per ``_STATS_PERIOD_S``, in the background; a change within the period
        is published at its end, so the last state always arrives."""
        if self._publish_scheduled:
            return
        self._publish_scheduled = True
        wait = max(0.0, self._last_publish + _STATS_PERIOD_S - time.monotonic())
        asyncio.get_running_loop().call_later(wait, self._publish)

    def _publish(self) -> None:
        self._publish_scheduled = False
        self._last_publish = time.monotonic()
        try:
            if self._stats_actor is None:
                self._stats_actor = (
                    ray.remote(_RoutingStatsBoard)
                    .options(
                        name=_stats_actor_name(self.app_name),
                        namespace=ACTOR_NAMESPACE,
                        get_if_exists=True,
                        lifetime="detached",
                        num_cpus=0,
                    )
                    .remote()
                )
            self._stats_actor.publish.remote(os.getpid(), self.stats())
        except Exception as e:  # stats are best effort; routing goes on
            logger.warning("kvgate: routing stats not published: %s", e)


class _RoutingStatsBoard:
    """Detached actor holding each router process's last published routing stats."""

    def __init__(self) -> None:
        self._by_process: Dict[int, Dict[str, Any]] = {}

    def publish(self, pid: int, stats: Dict[str, Any]) -> None:
        self._by_process[pid] = stats

    def read(self) -> Dict[int, Dict[str, Any]]:
        return dict(self._by_process)


def _stats_actor_name(app_name: str) -> str:
    return f"kvgate-stats:{app_name}"


def routing_stats(app_name: str) -> Dict[int, Dict[str, Any]]:
    """The last routing stats each kvgate router process of an app published (by
    process id): the deployment, open bookings, per-replica loads, requests routed per
    replica, decision time p50/p99, lifecycle events seen. Published about once a second
    while requests flow. Call from a process connected to the Ray cluster."""
    try:
        board = ray.get_actor(_stats_actor_name(app_name), namespace=ACTOR_NAMESPACE)
    except ValueError:
        return {}
    return ray.get(board.read.remote())


def _deployment_routing(app_name: str, deployment_name: str, service_kwargs) -> _DeploymentRouting:
    """The process's routing for a deployment (every router instance Ray makes for it in
    this process shares it: one ledger, one set of KV-event subscriptions)."""
    from kvgate import _local  # at call time: see kvgate/_local.py

    key = ("llm", app_name, deployment_name)
    routing = _local.SERVICES.get(key)
    if routing is None:
        routing = _DeploymentRouting(app_name, deployment_name, service_kwargs)
        _local.SERVICES[key] = routing
    return routing


class KVAwareRouter(_RayKVAwareRouter):
    """Ray Serve LLM's ``KVAwareRouter`` with kvgate's selection service in place of
    ai-dynamo. Name it in an ``LLMConfig``'s ``deployment_config``::

        "request_router_config": {"request_router_class": "kvgate.ray.llm:KVAwareRouter"}

    Optional ``request_router_kwargs``: ``policy`` (``kv_aware``, or ``prefix_affinity``,
    ``least_loaded`` ... for comparison), ``kv_aware`` (overrides of its knobs),
    ``hash_salt``, ``booking_ttl_s`` (the backstop for a lost completion, default 3600),
    ``index_max_blocks``, ``seed``, ``max_num_seqs``, ``max_num_batched_tokens`` and
    ``num_gpu_blocks`` (the engines' batch limits and KV-cache size; ``build_openai_app``
    copies them from ``engine_kwargs``, the last from ``num_gpu_blocks_override``),
    ``slo_ttft_ms`` and ``slo_tpot_ms`` (the deployment's latency objectives: each
    request goes to a replica predicted to meet them; one whose body's vLLM
    ``priority`` is above 0 is sheddable and, when no replica is, refused: Ray's ingress
    answers 503, as for any ``RuntimeError``). The block size, the KV-event endpoints
    and the step budget the engines resolved (``max_num_batched_tokens``, over any
    kwarg) come from the replicas' ``kv_event_metadata``.
    """

    def initialize_state(self, **kwargs: Any) -> None:
        kwargs = dict(kwargs)
        self._objective_defaults = _objective_defaults(kwargs, "kvgate.ray.llm.KVAwareRouter")
        unknown = sorted(set(kwargs) - set(SERVICE_KWARGS))
        if unknown:
            raise ValueError(f"kvgate.ray.llm.KVAwareRouter: unknown request_router_kwargs {unknown}")
        self._kv_token_tracker = _kv_token_tracker()
        self._routing: Optional[_DeploymentRouting] = None
        if self._kv_token_tracker is None:
            from ray.serve._private.constants import RAY_SERVE_ENABLE_HA_PROXY

            if RAY_SERVE_ENABLE_HA_PROXY:
                # HAProxy's fallback router (in Serve's proxy): Ray's own class routes
                # by load there too.
                logger.info("kvgate: %s is routed by load in this process (Serve's "
                            "fallback router; the LLMRouter ingress routes by KV)",
                            self._deployment_id)
            else:
                # The OpenAiIngress path: nothing here sees token ids.
                logger.error(
                    "kvgate: no pre-routing tokenization in this process (%s): requests "
                    "are routed by load. KV-aware routing in Ray Serve LLM runs on its "
                    "direct-streaming path: set %s=1 for `ray start` and the deploying "
                    "process, and build the app with kvgate.ray.llm.build_openai_app.",
                    self._deployment_id, "=1, ".join(DIRECT_STREAMING_ENV),
                )
            return
        self._routing = _deployment_routing(
            self._deployment_id.app_name, self._deployment_id.name, dict(kwargs)
        )
        # Ray's lifecycle intake now feeds kvgate's ledger.
        self._kv_token_tracker.on_lifecycle_events = self._routing.on_lifecycle_events
        self._kv_token_tracker.on_reservations_created = self._routing.on_reservations_created

    def update_replicas(self, replicas) -> None:
        gone = [r for r in self._replicas if r not in {x.replica_id for x in replicas}]
        super().update_replicas(replicas)
        if gone and self._routing is not None:
            self._event_loop.create_task(self._routing.forget([r.unique_id for r in gone]))

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        if self._routing is not None:
            self._event_loop.create_task(self._routing.forget([replica_id.unique_id]))

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if not candidate_replicas:
            return []
        routing = self._routing
        token_ids = (
            pending_request.kwargs.get(REQUEST_TOKEN_IDS_KWARG) if pending_request is not None else None
        )
        if routing is None:
            return [[random.choice(candidate_replicas)]]
        await routing.sync(self._replicas.values())
        if not token_ids:
            routing.maybe_publish()
            return [[routing.least_loaded(candidate_replicas)]]
        request_id = pending_request.metadata.request_id
        names = [r.replica_id.unique_id for r in candidate_replicas]
        try:
            chosen, booking_id = routing.select_and_book(
                request_id, token_ids, names, _expected_output_tokens(pending_request),
                _objective(pending_request, self._objective_defaults),
            )
        except (ValueError, KvgateUnavailableError):
            raise  # the ingress answers 400 or 503
        except Exception as e:
            raise KvgateUnavailableError(f"kvgate selection failed: {e}") from e
        routing.maybe_publish()
        for replica, name in zip(candidate_replicas, names):
            if name == chosen:
                return [[replica]]
        # Not a candidate (cannot happen: the service chooses among them): give it up.
        routing.unbook(request_id, booking_id)
        raise KvgateUnavailableError(f"kvgate chose {chosen}, which is not a candidate")


def build_openai_app(builder_config: Dict[str, Any]):
    """Ray Serve LLM's ``build_openai_app`` with kvgate routing every model whose
    ``LLMConfig`` names no request router, after checking, at deploy time, that Ray's
    direct-streaming path is on (without it the stock ingress never tokenizes, and
    KV-aware routing cannot happen)."""
    missing = [v for v in DIRECT_STREAMING_ENV if os.environ.get(v) != "1"]
    if missing:
        raise ValueError(
            "kvgate.ray.llm: KV-aware routing in Ray Serve LLM runs on Ray's direct-"
            "streaming path, where the ingress tokenizes before routing. Set "
            + ", ".join(f"{v}=1" for v in missing)
            + " in the environment of `ray start` and of the process that deploys the app."
        )
    from ray.llm._internal.serve.core.ingress.builder import LLMServingArgs
    from ray.serve.llm import build_openai_app as ray_build_openai_app

    args = LLMServingArgs.model_validate(builder_config)
    for config in args.llm_configs:
        deployment_config = config.deployment_config
        if not deployment_config.get("request_router_config"):
            deployment_config["request_router_config"] = {
                "request_router_class": f"{__name__}:KVAwareRouter"
            }
        _pass_engine_limits(deployment_config["request_router_config"], config.engine_kwargs)
    return ray_build_openai_app(args)


def _pass_engine_limits(router_config: Any, engine_kwargs: Optional[Dict[str, Any]]) -> None:
    """Tells kvgate's router the engines' limits from their ``engine_kwargs`` (those its
    ``request_router_kwargs`` do not set already): ``max_num_seqs``,
    ``max_num_batched_tokens`` and the KV-cache size ``num_gpu_blocks_override`` (as
    ``num_gpu_blocks``); other routers untouched."""
    get = router_config.get if isinstance(router_config, dict) else lambda k, d=None: getattr(router_config, k, d)
    router_class = get("request_router_class")
    if not (isinstance(router_class, str) and router_class == f"{__name__}:KVAwareRouter"):
        return
    limits = {
        ours: engine_kwargs[theirs]
        for theirs, ours in _ENGINE_LIMITS.items()
        if (engine_kwargs or {}).get(theirs)
    }
    if not limits:
        return
    kwargs = dict(get("request_router_kwargs") or {})
    for k, v in limits.items():
        kwargs.setdefault(k, int(v))
    if isinstance(router_config, dict):
        router_config["request_router_kwargs"] = kwargs
    else:
        router_config.request_router_kwargs = kwargs
