"""kvgate: KV-cache-aware request routing for LLM fleets.

The selection service and the tokenizer come from kvgate's Rust core (``kvgate._native``),
the same code ``kvgate serve`` routes with. ``kvgate.ray.llm`` is the router for Ray Serve
LLM (one line in an ``LLMConfig``); ``kvgate.ray`` the Ray Serve request router for apps
of your own.

The native module is imported on first use, not when ``kvgate`` is imported: Ray pickles
actor classes by value, so a process that only routes (or only unpickles) never needs it.
"""

from kvgate._errors import KvgateUnavailableError

__all__ = [
    "KvgateUnavailableError",
    "SelectionService",
    "Selection",
    "WorkerScore",
    "Tokenizer",
    "native_available",
]

_NATIVE_NAMES = {"SelectionService", "Selection", "WorkerScore", "Tokenizer"}


def __getattr__(name):
    if name in _NATIVE_NAMES:
        from kvgate import _native

        return getattr(_native, name)
    raise AttributeError(f"module 'kvgate' has no attribute {name!r}")


def native_available() -> bool:
    """Whether kvgate's native module can be imported in this process."""
    try:
        from kvgate import _native  # noqa: F401
    except ImportError:
        return False
    return True
