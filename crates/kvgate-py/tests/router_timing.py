"""Where the benchmark's timed routers record how long each `choose_replicas` call took,
in the process the handle's router runs in (the ingress). Code that may be pickled by
value (Ray does so for router and deployment classes) imports this module at call
time, so every copy appends to the one list."""

import gc
import time

# Each call's (start, end) on time.perf_counter, and the calling thread's CPU time
# (time.thread_time): for a call that never suspends (kvgate's local placement) the
# CPU time is the router's own work plus any garbage collection that ran inside it,
# and the rest of the wall time is the thread waiting to run (other processes, the
# GIL). For a call that awaits, it also counts whatever else ran on the thread.
CALLS = []
CPU_SECONDS = []
# This process's garbage collections, (start, end): a collection runs in whichever
# code allocates the object that crosses the collector's threshold, so some land inside
# a router's call and show as its latency.
GC_PASSES = []
_gc_started = [0.0]


def _on_gc(phase, info):
    if phase == "start":
        _gc_started[0] = time.perf_counter()
    else:
        GC_PASSES.append((_gc_started[0], time.perf_counter()))


gc.callbacks.append(_on_gc)


def take():
    """The calls so far as a JSON-able summary, and a fresh start."""
    passes = sorted(GC_PASSES)
    seconds, cpu, with_gc = [], sorted(CPU_SECONDS), []
    for start, end in CALLS:
        seconds.append(end - start)
        if any(a < end and b > start for a, b in passes):
            with_gc.append(end - start)
    CALLS.clear()
    CPU_SECONDS.clear()
    GC_PASSES.clear()
    return {
        "calls": len(seconds),
        "seconds": sorted(seconds),
        "cpu_seconds": cpu,
        "with_gc_seconds": sorted(with_gc),
        "gc_passes": len(passes),
    }
