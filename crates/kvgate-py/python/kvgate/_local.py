"""Process-wide registry of the selection services (with what the replicas advertised
and the lifecycle poller) that routers keep in this process (``placement="local"``), by
(app, deployment): every router instance of a deployment in the process shares one.

A module of its own because Ray pickles request-router classes by value: each router
instance then carries its own copy of its module's globals, so a registry there would
not be shared. Code reaches this one with an import at call time."""

from typing import Any, Dict, Tuple

SERVICES: Dict[Tuple[str, str], Any] = {}
