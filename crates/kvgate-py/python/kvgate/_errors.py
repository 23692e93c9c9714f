"""Exceptions shared by the native module and the pure-Python parts."""


class KvgateUnavailableError(RuntimeError):
    """Routing cannot happen now: no candidate worker, no KV event source, or the
    native module or the selection actor is missing. An ingress answers HTTP 503."""
