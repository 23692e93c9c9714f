"""The native module on its own: the selection service fed by real KV events from mock
engines, its booking lifecycle and errors, and the tokenizer's vLLM parity."""

import asyncio
import json
import urllib.request

import pytest

import kvgate
from kvgate import KvgateUnavailableError, SelectionService, Tokenizer
from kvgate.ray import RoutingTokenizer

from conftest import PARITY, QWEN3


def post(url, body):
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def run(coro):
    return asyncio.run(coro)


def test_the_tokenizer_matches_vllm_on_every_parity_case():
    cases = json.loads(PARITY.read_text())["cases"]
    tok = RoutingTokenizer.from_dir(str(QWEN3))

    async def all_cases():
        return [await tok.tokenize(c["request"]) for c in cases]

    got = run(all_cases())
    for case, ids in zip(cases, got):
        assert ids == case["expected"]["tokens"], case["request"]


def test_ray_tokenizer_semantics_none_for_no_single_prompt_and_valueerror_on_rejection():
    tok = RoutingTokenizer.from_dir(str(QWEN3))
    assert run(tok.tokenize({"prompt": ["a", "b"]})) is None
    assert run(tok.tokenize({})) is None
    assert run(tok.tokenize(b"")) is None
    with pytest.raises(ValueError):
        run(tok.tokenize({"messages": "not a list"}))
    with pytest.raises(ValueError):
        run(tok.tokenize(b"{not json"))
    long = RoutingTokenizer.from_dir(str(QWEN3), max_model_len=8)
    with pytest.raises(ValueError, match="context length"):
        run(long.tokenize({"prompt": "word " * 100}))
    # Completions get the special tokens the engine adds; chat bodies are templated.
    chat = run(tok.tokenize({"messages": [{"role": "user", "content": "hi"}]}))
    assert chat[-3:] == [151644, 77091, 198], "the generation prompt is rendered"


def test_remote_tokenization_asks_the_engines_tokenize(engines):
    (e,) = engines(1)
    tok = RoutingTokenizer.remote(e.url)
    local = RoutingTokenizer.from_dir(str(QWEN3))
    body = {"messages": [{"role": "user", "content": "hello there"}]}
    assert run(tok.tokenize(body)) == run(local.tokenize(body))


def test_a_cached_prompt_is_routed_back_to_its_engine(engines):
    a, b = engines(2)
    tok = Tokenizer.from_dir(str(QWEN3))
    body = {"model": "m", "prompt": "the shared context " * 60, "max_tokens": 1}

    async def scenario():
        svc = SelectionService(block_size=16)
        for name, e in (("a", a), ("b", b)):
            await svc.upsert_worker(name, e.kv_endpoint, e.replay_endpoint, 1, 16)
        ids = await tok.tokenize("completion", json.dumps(body).encode())
        # Engine b computes the prompt; its KV events reach the index.
        await asyncio.to_thread(post, b.url + "/v1/completions", body)
        for _ in range(100):
            s = await svc.select("probe", ids, ["a", "b"])
            if s.worker_id == "b" and s.overlap_blocks >= len(ids) // 16:
                break
            await asyncio.sleep(0.05)
        assert s.worker_id == "b", s
        assert s.predicted_cached_tokens >= (len(ids) // 16) * 16
        assert s.rule == "cached", s  # the rule that decided, as explain names it
        assert {x.worker_id for x in s.scores} == {"a", "b"}
        # Booked on b, the engine confirms the prediction.
        s = await svc.select_and_book("r1", ids, ["a", "b"], 1)
        assert s.worker_id == "b" and svc.booked_worker("r1") == "b"
        usage = (await asyncio.to_thread(post, b.url + "/v1/completions", body))["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= s.predicted_cached_tokens
        assert await svc.free("r1") and not await svc.free("r1")
        # Only a allowed: a.
        assert (await svc.select("r2", ids, ["a"])).worker_id == "a"
        svc.close()

    run(scenario())


def test_bookings_follow_the_request_lifecycle_and_end_once():
    async def scenario():
        svc = SelectionService(block_size=16, policy="least_loaded")
        await svc.upsert_worker("w")
        await svc.select_and_book("r", list(range(64)), None, -5)  # negative: unknown length
        load = svc.loads()["w"]
        assert load["in_flight"] == 1 and load["prefill_tokens"] == 64
        assert await svc.prefill_done("r")
        assert svc.loads()["w"]["prefill_tokens"] == 0
        assert await svc.decode_progress("r", 10)
        assert await svc.free("r")
        assert svc.open_requests() == 0 and svc.loads()["w"]["in_flight"] == 0
        assert not await svc.prefill_done("r")
        # The same on the calling thread (what a Ray Serve router uses).
        s = svc.select_and_book_now("n", [7] * 32, ["w"], 16)
        assert s.worker_id == "w" and svc.open_requests() == 1
        assert svc.free_now("n") and not svc.free_now("n")
        with pytest.raises(ValueError):
            svc.select_and_book_now("n", [], None)
        # A re-route replaces the booking.
        await svc.upsert_worker("v")
        await svc.select_and_book("q", [1] * 32, ["w"], 0)
        await svc.select_and_book("q", [1] * 32, ["v"], 0)
        assert svc.open_requests() == 1 and svc.booked_worker("q") == "v"
        await svc.free("q")

    run(scenario())


def test_errors_are_python_exceptions_with_the_right_class():
    async def scenario():
        svc = SelectionService(block_size=16)
        await svc.upsert_worker("w")
        with pytest.raises(ValueError, match="empty"):
            await svc.select("r", [], None)
        # kv_aware without any KV event source: 503, not a silent fallback.
        with pytest.raises(KvgateUnavailableError, match="KV event source"):
            await svc.select("r", [1, 2, 3], None)
        with pytest.raises(KvgateUnavailableError):
            await svc.select("r", [1, 2, 3], ["nobody"])
        with pytest.raises(ValueError, match="block size 32"):
            await svc.upsert_worker("x", "tcp://127.0.0.1:5557", None, 1, 32)
        with pytest.raises(ValueError, match="unknown policy"):
            SelectionService(policy="best")
        with pytest.raises(ValueError, match="at least 1"):
            SelectionService(max_num_seqs=0)
        with pytest.raises(ValueError, match="the load bound is gone"):
            SelectionService(kv_aware={"balance_abs_threshold": 16})
        SelectionService(max_num_seqs=16, max_num_batched_tokens=2048, num_gpu_blocks=256)
        with pytest.raises(ValueError, match="at least 1"):
            SelectionService(num_gpu_blocks=0)
        # The TTL backstop frees bookings that never ended.
        short = SelectionService(block_size=16, policy="round_robin", booking_ttl_s=0.05)
        await short.upsert_worker("w")
        await short.select_and_book("stuck", [1] * 16, None, None)
        await asyncio.sleep(0.2)
        short.sweep_expired()
        assert short.open_requests() == 0

    run(scenario())
    assert issubclass(KvgateUnavailableError, RuntimeError)
    assert kvgate.native_available()


def test_objectives_and_priorities_steer_or_shed():
    """A request's latency objectives and priority (what the gateway reads from its
    headers): predicted to be met, the policy's choice stands; met nowhere, a sheddable
    request (priority below 0) is refused before it is booked and any other goes to the
    closest miss. The time model predicts with the limits it was given."""
    async def scenario():
        svc = SelectionService(block_size=16, policy="least_loaded", max_num_seqs=16,
                               max_num_batched_tokens=2048)
        assert svc.engine_limits() == {"max_num_seqs": 16, "max_num_batched_tokens": 2048,
                                       "num_gpu_blocks": None}
        await svc.upsert_worker("w")
        await svc.upsert_worker("v")
        easy = svc.select_and_book_now("easy", [1] * 64, None, 16, slo_ttft_ms=60_000)
        assert easy.rule not in ("objective", "objective_missed"), easy.rule
        with pytest.raises(KvgateUnavailableError, match="latency objective"):
            svc.select_and_book_now("shed", [2] * 64, None, 16, slo_ttft_ms=0.001, priority=-1)
        assert svc.booked_worker("shed") is None
        late = await svc.select_and_book("late", [3] * 64, None, 16, slo_ttft_ms=0.001)
        assert late.rule == "objective_missed" and svc.booked_worker("late") is not None
        with pytest.raises(ValueError, match="slo_tpot_ms"):
            svc.select_and_book_now("bad", [4] * 64, None, slo_tpot_ms=-1)

    run(scenario())


def test_a_ray_request_objective_is_the_deployments_and_the_bodys_priority():
    """kvgate.ray's routers: the deployment's objectives (router kwargs, checked at
    deploy time) and the body's vLLM priority (lower is earlier) negated into kvgate's
    (below 0 sheddable), whether Ray hands the body as a dict or a namespace."""
    from types import SimpleNamespace

    from kvgate.ray import _objective, _objective_defaults

    kwargs = {"slo_ttft_ms": 500, "policy": "kv_aware"}
    defaults = _objective_defaults(kwargs, "test")
    assert defaults == {"slo_ttft_ms": 500.0} and kwargs == {"policy": "kv_aware"}
    for bad in (0, -1, "500", True, float("inf")):
        with pytest.raises(ValueError, match="slo_tpot_ms"):
            _objective_defaults({"slo_tpot_ms": bad}, "test")

    def pending(*args):
        return SimpleNamespace(args=args, kwargs={})

    assert _objective(pending(SimpleNamespace(priority=2)), defaults) == {
        "slo_ttft_ms": 500.0, "priority": -2}
    assert _objective(pending({"priority": -3}), {}) == {"priority": 3}
    assert _objective(pending({"priority": 0}), defaults) == defaults
    assert _objective(pending(SimpleNamespace(messages=[])), {}) == {}
    assert _objective(pending(), defaults) == defaults


def test_the_lifecycle_log_returns_what_a_poller_missed_in_order():
    from kvgate.ray import SelectionActor

    relay = SelectionActor(placement="local")  # relays only: no native service needed
    relay._log = __import__("collections").deque(maxlen=5)

    async def reports():
        for i in range(8):
            await relay.free(f"r{i}")

    run(reports())
    assert relay.poll_lifecycle(6) == (8, [(7, "free", "r6", 0), (8, "free", "r7", 0)])
    # A poller behind the log's start gets what is left, oldest first.
    assert [e[0] for e in relay.poll_lifecycle(0)[1]] == [4, 5, 6, 7, 8]
    assert relay.poll_lifecycle(8) == (8, [])
