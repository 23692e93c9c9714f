"""Typed stubs of kvgate's native module (crates/kvgate-py/src/lib.rs)."""

from os import PathLike
from typing import Any, Dict, List, Optional, Union

from kvgate._errors import KvgateUnavailableError as KvgateUnavailableError

__version__: str

class WorkerScore:
    worker_id: str
    overlap_blocks: int
    in_flight: int
    prefill_tokens: int
    decode_blocks: float
    cost: Optional[float]

class Selection:
    worker_id: str
    overlap_blocks: int
    predicted_cached_tokens: int
    policy: str
    rule: str
    reason: str
    scores: List[WorkerScore]

class SelectionService:
    def __init__(
        self,
        block_size: int = 16,
        policy: str = "kv_aware",
        *,
        model: str = "default",
        kv_aware: Optional[Dict[str, Any]] = None,
        hash_salt: Optional[str] = None,
        kv_topic: str = "",
        index_max_blocks: Optional[int] = None,
        booking_ttl_s: float = 3600.0,
        fallback: Optional[str] = None,
        seed: Optional[int] = None,
        max_num_seqs: Optional[int] = None,
        max_num_batched_tokens: Optional[int] = None,
        num_gpu_blocks: Optional[int] = None,
    ) -> None: ...
    @property
    def block_size(self) -> int: ...
    @property
    def policy(self) -> str: ...
    async def upsert_worker(
        self,
        worker_id: str,
        kv_events_endpoint: Optional[str] = None,
        replay_endpoint: Optional[str] = None,
        dp_size: int = 1,
        block_size: Optional[int] = None,
    ) -> None: ...
    async def remove_worker(self, worker_id: str) -> bool: ...
    def workers(self) -> List[str]: ...
    def engine_limits(self) -> Dict[str, Optional[int]]: ...
    async def select(
        self,
        request_id: str,
        token_ids: List[int],
        allowed_workers: Optional[List[str]] = None,
        expected_output_tokens: Optional[int] = None,
        lora: Optional[str] = None,
        *,
        slo_ttft_ms: Optional[float] = None,
        slo_tpot_ms: Optional[float] = None,
        priority: int = 0,
    ) -> Selection: ...
    async def select_and_book(
        self,
        request_id: str,
        token_ids: List[int],
        allowed_workers: Optional[List[str]] = None,
        expected_output_tokens: Optional[int] = None,
        lora: Optional[str] = None,
        *,
        slo_ttft_ms: Optional[float] = None,
        slo_tpot_ms: Optional[float] = None,
        priority: int = 0,
    ) -> Selection: ...
    def select_and_book_now(
        self,
        request_id: str,
        token_ids: List[int],
        allowed_workers: Optional[List[str]] = None,
        expected_output_tokens: Optional[int] = None,
        lora: Optional[str] = None,
        *,
        slo_ttft_ms: Optional[float] = None,
        slo_tpot_ms: Optional[float] = None,
        priority: int = 0,
    ) -> Selection: ...
    def free_now(self, request_id: str) -> bool: ...
    async def book(
        self,
        request_id: str,
        worker_id: str,
        token_ids: List[int],
        expected_output_tokens: Optional[int] = None,
        lora: Optional[str] = None,
    ) -> None: ...
    async def prefill_done(self, request_id: str) -> bool: ...
    async def decode_progress(self, request_id: str, output_tokens: int) -> bool: ...
    async def free(self, request_id: str) -> bool: ...
    def booked_worker(self, request_id: str) -> Optional[str]: ...
    def open_requests(self) -> int: ...
    def loads(self) -> Dict[str, Dict[str, float]]: ...
    def sweep_expired(self) -> int: ...
    def close(self) -> None: ...

class Tokenizer:
    @staticmethod
    def from_dir(path: Union[str, PathLike], max_model_len: Optional[int] = None) -> Tokenizer: ...
    @staticmethod
    def remote(base_url: str, timeout_s: float = 10.0) -> Tokenizer: ...
    async def tokenize(self, kind: str, body: bytes) -> Optional[List[int]]: ...
