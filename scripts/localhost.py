"""What the benchmark scripts beside this file share: a free loopback port, a percentile."""
import socket


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(xs, q):
    """The q-quantile of xs (nearest rank, 0 <= q <= 1)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]
