"""Where the benchmark's timed routers record how long each `choose_replicas` call took,
in the process the handle's router runs in (the ingress). Code that may be pickled by
value (Ray does so for router and deployment classes) imports this module at call
time, so every copy appends to the one list."""

SECONDS = []
