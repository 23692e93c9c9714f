"""kvgate.ray: KV-aware request routing inside Ray Serve, backed by kvgate's Rust core.

Owns the Ray Serve side of kvgate, and nothing that scores or books: that is the
selection service (``kvgate._native.SelectionService``, the same Rust code ``kvgate
serve`` uses), owned by one deployment-scoped actor.

* ``KVAwareRequestRouter``: a ``ray.serve.request_router.RequestRouter`` named in a
  deployment's config as ``request_router_class: kvgate.ray:KVAwareRequestRouter``.
  ``choose_replicas`` reads the prompt's token ids from the request's
  ``request_token_ids`` keyword argument (where Ray Serve LLM's ingress puts them after
  pre-routing tokenization), asks the actor to select and book a replica in one step,
  and returns it. Replicas advertise their KV-event endpoints through
  ``record_routing_stats`` (``kv_event_metadata``), so nothing is configured by hand.
* ``SelectionActor``: the deployment-scoped actor (one per deployment, named
  ``kvgate:<app>:<deployment>``) that owns one selection service.
* ``track_stream``: the replica-side lifecycle of a request: prefill done at its first
  token, decode progress per chunk, freed on end, error or cancellation.
* ``RoutingTokenizer``: pre-routing tokenization with Ray Serve LLM's semantics.

Failure handling (as Ray Serve's design asks): a request without a pending request goes
to every candidate (the base router's load-based choice); missing or empty token ids
raise ``ValueError`` (an ingress answers 400); a missing native module or selection
actor raises ``KvgateUnavailableError``, a ``RuntimeError`` (503), never a silent
fallback to round-robin.

The native module is imported only inside the actor and the tokenizer: Ray pickles
actor classes by value, and a process that merely routes must not need it.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Tuple, Union

import ray
from ray import serve
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvgate._errors import KvgateUnavailableError

logger = logging.getLogger("ray.serve")

#: The keyword argument carrying the prompt's token ids (Ray Serve LLM's name).
REQUEST_TOKEN_IDS_KWARG = "request_token_ids"
#: The ``record_routing_stats`` key under which a replica advertises its KV events.
KV_EVENT_METADATA_KEY = "kv_event_metadata"
#: The namespace of the selection actors.
ACTOR_NAMESPACE = "kvgate"
#: Output progress is reported every this many chunks (and at the end).
PROGRESS_EVERY = 8

__all__ = [
    "KVAwareRequestRouter",
    "SelectionActor",
    "RoutingTokenizer",
    "KvgateUnavailableError",
    "kv_event_metadata",
    "selection_actor_name",
    "get_selection_actor",
    "track_stream",
    "REQUEST_TOKEN_IDS_KWARG",
    "KV_EVENT_METADATA_KEY",
]


def kv_event_metadata(
    endpoint: str,
    *,
    block_size: int,
    replay_endpoint: Optional[str] = None,
    dp_size: int = 1,
) -> Dict[str, Any]:
    """What a replica returns from ``record_routing_stats`` so the router subscribes to
    its engine's KV events: ``endpoint`` is rank 0's ZMQ PUB socket (``tcp://HOST:PORT``,
    rank r on PORT + r), ``replay_endpoint`` its replay ROUTER socket."""
    return {
        KV_EVENT_METADATA_KEY: {
            "endpoint": endpoint,
            "replay_endpoint": replay_endpoint,
            "block_size": int(block_size),
            "dp_size": int(dp_size),
        }
    }


def selection_actor_name(app_name: str, deployment_name: str) -> str:
    """The name of the selection actor of one deployment."""
    return f"kvgate:{app_name}:{deployment_name}"


class _Fleet:
    """A selection service and what each replica last advertised to it (shared by the
    actor and the in-process router)."""

    def __init__(self, svc: Any):
        self.svc = svc
        self._advertised: Dict[str, Any] = {}
        #: The task pulling lifecycle reports into ``svc`` (placement="local").
        self.poller: Optional[asyncio.Task] = None

    async def sync(self, members: Dict[str, Optional[Dict[str, Any]]]) -> None:
        """Adds the replicas in ``members`` (name -> kv_event_metadata or None) and
        updates changed endpoints. An advertisement never goes back to None: a router
        with an older view must not stop a replica's subscribers."""
        for name, meta in members.items():
            key = _metadata_key(meta)
            known = self._advertised.get(name, "unknown")
            if known == key or (key is None and known != "unknown"):
                continue
            if meta is None:
                await self.svc.upsert_worker(name)
            else:
                await self.svc.upsert_worker(
                    name,
                    meta.get("endpoint"),
                    meta.get("replay_endpoint"),
                    int(meta.get("dp_size") or 1),
                    meta.get("block_size"),
                )
            self._advertised[name] = key

    async def remove(self, names: List[str]) -> None:
        for name in names:
            self._advertised.pop(name, None)
            await self.svc.remove_worker(name)


def _new_service(service_kwargs: Dict[str, Any], where: str):
    try:
        from kvgate import _native
    except ImportError as e:
        raise KvgateUnavailableError(
            f"kvgate's native module cannot be imported in {where}: {e}"
        ) from e
    return _native.SelectionService(**service_kwargs)


class SelectionActor:
    """One per deployment. With ``placement="actor"`` it owns the deployment's
    selection service (prefix index fed by every replica's KV events, the load ledger,
    the policy): every router of the deployment asks it, so their bookings meet in one
    ledger. In either placement it is where replicas report their requests' lifecycle
    (first token, output progress, end); routers that keep the service in their own
    process (``placement="local"``) pull those reports with ``poll_lifecycle``."""

    #: Lifecycle reports kept for routers that poll (oldest dropped first).
    LOG_SIZE = 100_000

    def __init__(self, placement: str = "actor", **service_kwargs: Any):
        self._fleet = (
            _Fleet(_new_service(service_kwargs, "the selection actor"))
            if placement == "actor"
            else None
        )
        self._log: "collections.deque" = collections.deque(maxlen=self.LOG_SIZE)
        self._seq = 0

    def _service(self):
        if self._fleet is None:
            raise KvgateUnavailableError(
                "this deployment's routers keep the selection service in their own "
                "process (placement='local'); the actor only relays lifecycle reports"
            )
        return self._fleet.svc

    async def sync_workers(self, members: Dict[str, Optional[Dict[str, Any]]]) -> None:
        self._service()
        await self._fleet.sync(members)

    async def remove_workers(self, names: List[str]) -> None:
        if self._fleet is not None:
            await self._fleet.remove(names)

    async def select_and_book(
        self,
        request_id: str,
        token_ids: List[int],
        allowed_workers: List[str],
        expected_output_tokens: Optional[int],
        objective: Optional[Dict[str, Any]] = None,
    ) -> Dict[str, Any]:
        s = await self._service().select_and_book(
            request_id, token_ids, allowed_workers, expected_output_tokens, **(objective or {})
        )
        return {
            "worker_id": s.worker_id,
            "overlap_blocks": s.overlap_blocks,
            "predicted_cached_tokens": s.predicted_cached_tokens,
            "rule": s.rule,
            "reason": s.reason,
        }

    def _record(self, event: Tuple) -> None:
        self._seq += 1
        self._log.append((self._seq,) + event)

    async def free(self, request_id: str) -> bool:
        """Ends a request's booking (a router's completion callback)."""
        return await self._apply(("free", request_id, 0))

    async def report(self, batch: List[Tuple[str, str, int]]) -> None:
        """Lifecycle reports from one replica, in order: (method, request id, value)."""
        for event in batch:
            await self._apply(tuple(event))

    async def _apply(self, event: Tuple[str, str, int]) -> bool:
        """Logs a lifecycle report for polling routers and applies it to the service
        this actor owns, if any."""
        self._record(event)
        return self._fleet is not None and await _apply_lifecycle(self._fleet.svc, *event)

    def poll_lifecycle(self, after: int) -> Tuple[int, List[Tuple]]:
        """Lifecycle reports with a sequence number above ``after``, and the last
        sequence number (a poller that fell behind the log gets what is left)."""
        # Sequence numbers are consecutive: the newest `seq - after` reports, read from
        # the log's right end (cheap however long the log is).
        missing = min(max(self._seq - after, 0), len(self._log))
        return self._seq, [self._log[-k] for k in range(missing, 0, -1)]

    def open_requests(self) -> int:
        return self._service().open_requests()

    def loads(self) -> Dict[str, Dict[str, float]]:
        return self._service().loads()

    def workers(self) -> List[str]:
        return self._service().workers()

    def ready(self) -> bool:
        return True


async def _apply_lifecycle(svc: Any, method: str, request_id: str, value: int) -> bool:
    """Applies one lifecycle report (``track_stream``'s vocabulary) to a selection
    service; False when it holds no booking with that id or the method is unknown."""
    if method == "prefill_done":
        return await svc.prefill_done(request_id)
    if method == "decode_progress":
        return await svc.decode_progress(request_id, int(value))
    if method == "free":
        return await svc.free(request_id)
    return False


def _metadata_key(meta: Optional[Dict[str, Any]]) -> Optional[Tuple]:
    if meta is None:
        return None
    return (
        meta.get("endpoint"),
        meta.get("replay_endpoint"),
        meta.get("dp_size") or 1,
        meta.get("block_size"),
    )


def get_selection_actor(
    app_name: str,
    deployment_name: str,
    service_kwargs: Optional[Dict[str, Any]] = None,
    actor_options: Optional[Dict[str, Any]] = None,
):
    """The deployment's selection actor; with ``service_kwargs``, created on first use
    (detached: it outlives any one router process; it is restarted if it dies, and its
    index then rebuilds from the engines' replay buffers)."""
    name = selection_actor_name(app_name, deployment_name)
    if service_kwargs is None:
        return ray.get_actor(name, namespace=ACTOR_NAMESPACE)
    options = {
        "name": name,
        "namespace": ACTOR_NAMESPACE,
        "get_if_exists": True,
        "lifetime": "detached",
        "num_cpus": 0,
        "max_restarts": -1,
        "max_concurrency": 1000,
    }
    options.update(actor_options or {})
    return ray.remote(SelectionActor).options(**options).remote(**service_kwargs)


def _expected_output_tokens(pr: PendingRequest) -> Optional[int]:
    """The request's output cap (``max_completion_tokens`` / ``max_tokens``), if any."""
    sources: List[Any] = [pr.kwargs]
    if pr.args:
        sources.append(pr.args[0])
    for src in sources:
        for field in ("max_completion_tokens", "max_tokens"):
            v = src.get(field) if isinstance(src, dict) else getattr(src, field, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


#: Router kwargs naming a deployment's latency objectives in milliseconds (what the
#: gateway's model defaults ``slo_ttft_ms`` / ``slo_tpot_ms`` are).
OBJECTIVE_KWARGS = ("slo_ttft_ms", "slo_tpot_ms")
#: Router kwargs passed through to the selection service (both routers; kvgate.ray's
#: also takes ``block_size`` and ``kv_topic``, which Ray Serve LLM's metadata gives).
SERVICE_KWARGS = (
    "policy", "kv_aware", "hash_salt", "booking_ttl_s", "index_max_blocks", "seed",
    "max_num_seqs", "max_num_batched_tokens", "num_gpu_blocks",
)


def _objective_defaults(kwargs: Dict[str, Any], where: str) -> Dict[str, float]:
    """Takes the objective kwargs out of ``kwargs``; a value that is not a positive
    number is a ``ValueError`` at deploy time, not a 400 per request."""
    out = {}
    for k in OBJECTIVE_KWARGS:
        v = kwargs.pop(k, None)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
            raise ValueError(f"{where}: {k} must be a positive number of milliseconds, got {v!r}")
        out[k] = float(v)
    return out


def _objective(pr: PendingRequest, defaults: Dict[str, float]) -> Dict[str, Any]:
    """The selection kwargs of a request's objective: the deployment's latency objectives
    and the body's vLLM ``priority`` (lower is handled earlier) negated into kvgate's
    (higher is more important, below 0 sheddable), as the gateway reads a body. Ray's
    request carries no HTTP headers to the router, so there is no per-request
    objective here."""
    body = pr.args[0] if pr.args else None
    p = body.get("priority") if isinstance(body, dict) else getattr(body, "priority", None)
    if isinstance(p, int) and not isinstance(p, bool) and p != 0:
        return {**defaults, "priority": -max(-(1 << 30), min(1 << 30, p))}
    return defaults


def local_service(app_name: str, deployment_name: str):
    """The selection service a ``placement="local"`` router of this deployment keeps in
    this process, if any (loads, open requests: for metrics and tests)."""
    from kvgate import _local  # at call time: see kvgate/_local.py

    fleet = _local.SERVICES.get((app_name, deployment_name))
    return fleet.svc if fleet is not None else None


class KVAwareRequestRouter(RequestRouter):
    """Routes each request to the replica whose engine holds the most of its prompt's
    KV cache, weighed against the prefill and decode work each replica carries.

    ``request_router_kwargs``: ``block_size`` (the engines'), ``policy`` (``kv_aware``;
    ``prefix_affinity``, ``least_loaded`` ... for comparison), ``kv_aware`` (weights,
    e.g. ``{"overlap_weight": 4.0}``), ``hash_salt``, ``kv_topic``, ``booking_ttl_s``,
    ``index_max_blocks``, ``seed``, ``max_num_seqs`` and ``max_num_batched_tokens`` (the
    engines' batch limits, vLLM's flags: a cached prefix stops drawing requests to a
    replica whose batch is full), ``num_gpu_blocks`` (their KV-cache size in blocks,
    which the time model reads as a limit too); ``slo_ttft_ms`` and ``slo_tpot_ms``
    (the deployment's latency objectives: each request goes to a replica predicted to
    meet them, and one whose body's vLLM ``priority`` is above 0, sheddable, is refused
    with ``KvgateUnavailableError`` when none is); ``actor_options``: Ray actor options
    for the selection actor (``resources``, ``runtime_env``, ...); ``placement``:

    * ``"local"`` (default): the selection service lives in this router's process
      (selection is a local call, well under a millisecond); it subscribes to the
      replicas' KV events itself and pulls the replicas' lifecycle reports from the
      deployment's actor in the background. Several router processes each keep their
      own ledger (their KV index is the same: every one reads every engine's events).
    * ``"actor"``: the deployment's actor owns the one service; every routing decision
      is an actor call (about 5 ms on a busy 2-core machine; see docs/BENCHMARKS.md),
      and every router's bookings meet in one ledger.
    """

    #: How often a local router pulls lifecycle reports while it has open requests.
    LIFECYCLE_POLL_S = 0.05

    def initialize_state(self, **kwargs: Any) -> None:
        self._service_kwargs = {
            "block_size": int(kwargs.pop("block_size", 16)),
            "policy": str(kwargs.pop("policy", "kv_aware")),
        }
        for k in (*SERVICE_KWARGS, "kv_topic"):
            if k in kwargs:
                self._service_kwargs[k] = kwargs.pop(k)
        self._objective_defaults = _objective_defaults(kwargs, "KVAwareRequestRouter")
        self._actor_options = dict(kwargs.pop("actor_options", None) or {})
        self._placement = str(kwargs.pop("placement", "local"))
        if self._placement not in ("local", "actor"):
            raise ValueError(
                f"KVAwareRequestRouter: placement must be 'local' or 'actor', got {self._placement!r}"
            )
        if kwargs:
            raise ValueError(
                f"KVAwareRequestRouter: unknown request_router_kwargs {sorted(kwargs)}"
            )
        self._actor = None
        self._fleet: Optional[_Fleet] = None
        self._synced: Dict[str, Optional[Tuple]] = {}
        self._known_replicas: set = set()

    # -- where the selection service lives -------------------------------------------

    def _selection_actor(self):
        if self._actor is None:
            self._actor = get_selection_actor(
                self._deployment_id.app_name,
                self._deployment_id.name,
                {"placement": self._placement, **self._service_kwargs},
                self._actor_options,
            )
        return self._actor

    def _local_fleet(self) -> _Fleet:
        """The process's service for this deployment: every router instance of the
        deployment in this process (Ray makes one per handle options) shares it, so
        they share one ledger and one set of KV-event subscriptions."""
        if self._fleet is None:
            from kvgate import _local  # at call time: see kvgate/_local.py

            key = (self._deployment_id.app_name, self._deployment_id.name)
            fleet = _local.SERVICES.get(key)
            if fleet is None:
                fleet = _Fleet(_new_service(self._service_kwargs, "the router's process"))
                _local.SERVICES[key] = fleet
            self._fleet = fleet
        return self._fleet

    async def _poll_lifecycle(self) -> None:
        """Applies the replicas' lifecycle reports (first token, progress, end) to the
        local service; the request ids it does not hold are ignored."""
        svc = self._fleet.svc
        seq = None
        while True:
            try:
                actor = self._selection_actor()
                if seq is None:
                    seq, _ = await actor.poll_lifecycle.remote(1 << 62)
                last, events = await actor.poll_lifecycle.remote(seq)
                seq = last
                for _, method, rid, value in events:
                    await _apply_lifecycle(svc, method, rid, value)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the actor restarts: start over from its log's end
                logger.warning("kvgate: lifecycle reports unavailable: %s", e)
                seq = None
                await asyncio.sleep(1.0)
            busy = svc.open_requests() > 0
            await asyncio.sleep(self.LIFECYCLE_POLL_S if busy else 10 * self.LIFECYCLE_POLL_S)

    def _changed_members(self) -> Optional[Dict[str, Any]]:
        """The replicas the service has not seen advertised as they are now (None when
        there are none, the common case: no allocation then)."""
        changed = None
        for rid, replica in self._replicas.items():
            meta = (replica.routing_stats or {}).get(KV_EVENT_METADATA_KEY)
            name = rid.unique_id
            if name not in self._synced or self._synced[name] != _metadata_key(meta):
                if changed is None:
                    changed = {}
                changed[name] = meta
        return changed

    async def _sync_members(self, sync, changed: Dict[str, Any]) -> None:
        """Tells the service about the changed replicas."""
        await sync(changed)
        for name, meta in changed.items():
            self._synced[name] = _metadata_key(meta)

    def _forget(self, names: List[str]) -> None:
        for name in names:
            self._synced.pop(name, None)
        if self._fleet is not None:
            self._run_soon(self._fleet.remove(names))
        elif self._actor is not None:
            self._actor.remove_workers.remote(names)

    def _run_soon(self, coro) -> None:
        """Runs a coroutine on the router's loop, from any thread."""
        loop = self._event_loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            loop.create_task(coro)
        else:
            asyncio.run_coroutine_threadsafe(coro, loop)

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        current = {r.replica_id.unique_id for r in replicas}
        gone = [name for name in self._known_replicas if name not in current]
        self._known_replicas = current
        if gone:
            self._forget(gone)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._known_replicas.discard(replica_id.unique_id)
        self._forget([replica_id.unique_id])

    # -- routing ---------------------------------------------------------------------

    @staticmethod
    def _fail(pr: PendingRequest, err: Exception, candidates: List[RunningReplica]):
        """Fails the request with ``err`` (raised to the caller of the handle) and lets
        Ray's routing loop see the request as done."""
        if not pr.future.done():
            pr.future.set_exception(err)
        return [candidates[:1]]

    async def choose_replicas(
        self,
        candidate_replicas: List[RunningReplica],
        pending_request: Optional[PendingRequest] = None,
    ) -> List[List[RunningReplica]]:
        try:
            return await self._choose(candidate_replicas, pending_request)
        except Exception as e:
            # Ray's routing loop only logs an exception from here, and the request would
            # wait forever: fail it (503) instead.
            logger.exception("kvgate: routing failed")
            if pending_request is None or not candidate_replicas:
                raise
            return self._fail(
                pending_request,
                KvgateUnavailableError(f"kvgate routing failed: {e}"),
                candidate_replicas,
            )

    async def _choose(
        self,
        candidate_replicas: List[RunningReplica],
        pending_request: Optional[PendingRequest],
    ) -> List[List[RunningReplica]]:
        if pending_request is None or not candidate_replicas:
            # Nothing to score on: the base router's load-based choice among all.
            return [candidate_replicas]
        try:
            if self._placement == "local":
                fleet = self._local_fleet()
                if fleet.poller is None or fleet.poller.done():
                    fleet.poller = asyncio.get_running_loop().create_task(self._poll_lifecycle())
            else:
                actor = self._selection_actor()
        except KvgateUnavailableError as e:
            return self._fail(pending_request, e, candidate_replicas)
        token_ids = pending_request.kwargs.get(REQUEST_TOKEN_IDS_KWARG)
        if not token_ids:
            return self._fail(
                pending_request,
                ValueError(
                    "KV-aware routing needs the prompt's token ids in the "
                    f"'{REQUEST_TOKEN_IDS_KWARG}' argument and this request has none"
                ),
                candidate_replicas,
            )
        request_id = pending_request.metadata.internal_request_id
        names = [r.replica_id.unique_id for r in candidate_replicas]
        expected = _expected_output_tokens(pending_request)
        objective = _objective(pending_request, self._objective_defaults)
        # From here the request may hold a booking: if it is cancelled or fails before
        # dispatch, free it; once dispatched, Ray's completion callback frees it.
        pending_request.future.add_done_callback(
            lambda fut, rid=request_id: self._on_routed_or_dropped(fut, rid)
        )
        for attempt in range(3):
            try:
                # Per request on the router's event loop: the token ids go as they came
                # (no copy) and membership is checked without building anything.
                changed = self._changed_members()
                if self._placement == "local":
                    if changed:
                        await self._sync_members(fleet.sync, changed)
                    # On this thread: the selection is cheaper than a hop to the runtime.
                    s = fleet.svc.select_and_book_now(
                        request_id, token_ids, names, expected, **objective
                    )
                    chosen = s.worker_id
                    free = fleet.svc.free
                else:
                    if changed:
                        await self._sync_members(lambda m: actor.sync_workers.remote(m), changed)
                    chosen = (
                        await actor.select_and_book.remote(
                            request_id, token_ids, names, expected, objective
                        )
                    )["worker_id"]
                    free = actor.free.remote
                break
            except ray.exceptions.TaskCancelledError:
                # The actor call was cancelled. If this routing task is being cancelled
                # (the caller left), stop; otherwise the request still waits for a
                # replica: ask again rather than leave it without a routing task.
                task = asyncio.current_task()
                if task is not None and getattr(task, "cancelling", lambda: 0)():
                    raise asyncio.CancelledError() from None
                logger.warning("kvgate: a selection call was cancelled; asking again")
                if attempt == 2:
                    return self._fail(
                        pending_request,
                        KvgateUnavailableError("kvgate selection calls keep being cancelled"),
                        candidate_replicas,
                    )
            except ValueError as e:
                return self._fail(pending_request, ValueError(str(e)), candidate_replicas)
            except KvgateUnavailableError as e:
                return self._fail(pending_request, e, candidate_replicas)
            except Exception as e:  # the actor is missing, died, or cannot import the core
                return self._fail(
                    pending_request,
                    KvgateUnavailableError(f"kvgate selection is unavailable: {e}"),
                    candidate_replicas,
                )
        replica = next((r for r, n in zip(candidate_replicas, names) if n == chosen), None)
        if replica is None:
            # The candidate left while we chose: give the booking up and choose again.
            self._run_soon(_call(free, request_id))
            return []
        return [[replica]]

    def _free(self, request_id: str) -> None:
        if self._fleet is not None:
            self._fleet.svc.free_now(request_id)
        elif self._actor is not None:
            self._actor.free.remote(request_id)

    def _on_routed_or_dropped(self, fut: asyncio.Future, request_id: str) -> None:
        # A request cancelled (or failed) before dispatch never reaches a replica, so
        # no completion will free its booking: free it here.
        if fut.cancelled() or fut.exception() is not None:
            self._free(request_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        # Ray calls this once per dispatched request, on success, error or cancellation.
        self._free(internal_request_id)


async def _call(f, *args):
    r = f(*args)
    if asyncio.iscoroutine(r) or isinstance(r, asyncio.Future) or hasattr(r, "__await__"):
        await r


# -- the replica side ------------------------------------------------------------------

_replica_actor_cache: Dict[Tuple[str, str], Tuple[Any, float]] = {}
#: How long a replica remembers that its deployment has no selection actor (not routed
#: by kvgate) before looking again.
_NO_ACTOR_RECHECK_S = 30.0


class _LifecycleReporter:
    """Sends a replica's lifecycle reports to the selection actor in order, one call in
    flight at a time: reports made meanwhile go together in the next call, so a busy
    replica makes a few calls per second rather than several per request."""

    def __init__(self, actor: Any):
        self.actor = actor
        self._queue: List[Tuple[str, str, int]] = []
        self._task: Optional[asyncio.Task] = None

    def report(self, method: str, request_id: str, value: int = 0) -> None:
        self._queue.append((method, request_id, value))
        if self._task is None or self._task.done():
            try:
                self._task = asyncio.get_running_loop().create_task(self._deliver())
            except RuntimeError:  # no running loop (interpreter shutdown): the TTL covers it
                pass

    async def _deliver(self) -> None:
        while self._queue:
            batch, self._queue = self._queue, []
            try:
                await self.actor.report.remote(batch)
            except Exception as e:  # the actor restarts; its TTL sweep covers the loss
                logger.warning("kvgate: %d lifecycle reports dropped: %s", len(batch), e)


def _replica_reporter():
    """This replica's deployment's lifecycle reporter (to its selection actor), or None
    when there is no actor (looked up again after ``_NO_ACTOR_RECHECK_S``: a lookup is a
    blocking GCS call)."""
    ctx = serve.get_replica_context()
    key = (ctx.app_name, ctx.deployment)
    cached = _replica_actor_cache.get(key)
    now = time.monotonic()
    if cached is not None and (cached[0] is not None or now - cached[1] < _NO_ACTOR_RECHECK_S):
        return cached[0]
    try:
        reporter = _LifecycleReporter(get_selection_actor(ctx.app_name, ctx.deployment))
    except ValueError:  # no actor by that name
        reporter = None
    _replica_actor_cache[key] = (reporter, now)
    return reporter


def _count_sse_tokens(chunk: Union[bytes, str]) -> int:
    """Output tokens in an OpenAI SSE chunk: one per ``data:`` event that is not
    ``[DONE]`` (engines stream one token per event)."""
    text = chunk.decode("utf-8", "replace") if isinstance(chunk, (bytes, bytearray)) else str(chunk)
    return sum(
        1
        for line in text.splitlines()
        if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]")
    )


async def track_stream(
    stream: AsyncIterator[Any],
    *,
    count_tokens: Callable[[Any], int] = _count_sse_tokens,
) -> AsyncIterator[Any]:
    """Wraps a replica's response stream and reports its lifecycle to the selection
    actor: prefill done at the first token, cumulative output tokens every
    ``PROGRESS_EVERY`` chunks, and the end (finished, failed or cancelled) in a
    ``finally``. Use inside a deployment method that a ``KVAwareRequestRouter``
    routes to::

        async def __call__(self, body, request_token_ids=None):
            async for chunk in kvgate.ray.track_stream(self.engine_stream(body)):
                yield chunk

    Reports are queued and sent in batches with one call in flight: the stream never
    waits on the router."""
    try:
        request_id = serve.context._get_serve_request_context()._internal_request_id
        reporter = _replica_reporter()
    except Exception as e:  # not inside a Serve replica
        logger.debug("kvgate: no lifecycle tracking for this request: %s", e)
        reporter = None
    if reporter is None:  # not routed by kvgate
        async for chunk in stream:
            yield chunk
        return
    produced = 0
    chunks = 0
    first = True
    try:
        async for chunk in stream:
            produced += count_tokens(chunk)
            chunks += 1
            if first and produced > 0:
                first = False
                reporter.report("prefill_done", request_id)
            elif chunks % PROGRESS_EVERY == 0:
                reporter.report("decode_progress", request_id, produced)
            yield chunk
    finally:
        reporter.report("free", request_id)


# -- pre-routing tokenization ----------------------------------------------------------


class RoutingTokenizer:
    """Pre-routing tokenization with Ray Serve LLM's semantics, run by kvgate's Rust
    tokenizer (vLLM parity): chat bodies are rendered with the chat template and the
    generation prompt and tokenized without added special tokens; completion bodies
    get the special tokens. ``tokenize`` returns None for a body with no single prompt
    (a list of prompts, an empty body) and raises ``ValueError`` when the engine would
    reject it. Local (``from_dir``) or through a replica's ``/tokenize``
    (``remote``)."""

    def __init__(self, native_tokenizer: Any):
        self._tok = native_tokenizer

    @classmethod
    def from_dir(cls, path: str, max_model_len: Optional[int] = None) -> "RoutingTokenizer":
        from kvgate import _native

        return cls(_native.Tokenizer.from_dir(path, max_model_len))

    @classmethod
    def remote(cls, base_url: str, timeout_s: float = 10.0) -> "RoutingTokenizer":
        from kvgate import _native

        return cls(_native.Tokenizer.remote(base_url, timeout_s))

    async def tokenize(
        self, body: Union[Dict[str, Any], bytes, str, None], kind: Optional[str] = None
    ) -> Optional[List[int]]:
        """The prompt token ids of an OpenAI body. ``kind``: "chat" or "completion";
        None detects it (``messages`` present means chat)."""
        if body is None:
            return None
        if isinstance(body, dict):
            if not body:
                return None
            data = json.dumps(body).encode()
            detected = "chat" if "messages" in body else "completion"
        else:
            data = body.encode() if isinstance(body, str) else bytes(body)
            if not data.strip():
                return None
            try:
                parsed = json.loads(data)
            except ValueError as e:
                raise ValueError(f"the body is not valid JSON: {e}") from None
            if isinstance(parsed, dict) and not parsed:
                return None
            detected = "chat" if isinstance(parsed, dict) and "messages" in parsed else "completion"
        return await self._tok.tokenize(kind or detected, data)
