#!/usr/bin/env python3
"""Independent checker for vLLM-style KV events (pyzmq + msgpack, no kvgate code).

It decodes the way vLLM's example subscriber does (SUB socket on the topic,
multipart [topic, seq (8 bytes big-endian), payload]; a DEALER on the replay
socket sending [b"", start_seq] and reading [b"", topic, seq, payload] until
seq == -1) and validates every event against the schema that vLLM 0.32's real
captures satisfy (fixtures/vllm-0.32/): exact field names and order per event
type, value types, token/hash counts, consecutive sequence numbers, and, when
the stream is seen from its start, cache consistency (parents and removals
refer to stored blocks).

Usage:
  # validate the real vLLM captures (the reference)
  check_events.py --capture fixtures/vllm-0.32/vllm-0.32-pub-frames.msgpack \
                  --capture fixtures/vllm-0.32/vllm-0.32-pub-frames-clear.msgpack \
                  --replay-capture fixtures/vllm-0.32/vllm-0.32-replay-from-seq1.msgpack
  # validate a running engine (optionally driving traffic into it first)
  check_events.py --sub tcp://127.0.0.1:5557 --replay tcp://127.0.0.1:5558 \
                  --drive http://127.0.0.1:8000 --requests 200

Exit status 0 when everything validates, 1 otherwise.
"""

import argparse
import json
import random
import sys
import time
import urllib.request

import msgpack

STORED_FIELDS = [
    "type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
    "lora_id", "medium", "lora_name", "extra_keys", "group_idx",
    "kv_cache_spec_kind",
]
REMOVED_FIELDS = ["type", "block_hashes", "medium", "group_idx"]
CLEARED_FIELDS = ["type"]
END_SEQ = b"\xff" * 8
U64_MAX = 2**64 - 1


class Checker:
    def __init__(self, strict_state):
        self.errors = []
        self.counts = {"batches": 0, "BlockStored": 0, "BlockRemoved": 0,
                       "AllBlocksCleared": 0, "blocks_stored": 0,
                       "blocks_removed": 0}
        self.last_seq = None
        self.cached = set()
        self.strict_state = strict_state
        self.state_warnings = 0

    def err(self, where, msg):
        self.errors.append(f"{where}: {msg}")

    def check_seq(self, seq_bytes, where):
        if len(seq_bytes) != 8:
            self.err(where, f"seq frame has {len(seq_bytes)} bytes, want 8")
            return
        seq = int.from_bytes(seq_bytes, "big")
        if self.last_seq is not None and seq != self.last_seq + 1:
            self.err(where, f"seq {seq} after {self.last_seq} (gap or reorder)")
        self.last_seq = seq

    def state_problem(self, where, msg):
        if self.strict_state:
            self.err(where, msg)
        else:
            self.state_warnings += 1

    def check_payload(self, payload, where):
        try:
            batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        except Exception as e:  # noqa: BLE001 - report any decode failure
            self.err(where, f"payload is not msgpack: {e}")
            return
        self.counts["batches"] += 1
        if not isinstance(batch, list) or len(batch) not in (2, 3):
            self.err(where, "batch must be [ts, events] or [ts, events, dp_rank]")
            return
        if not isinstance(batch[0], float):
            self.err(where, f"ts must be a float, got {type(batch[0]).__name__}")
        if len(batch) == 3 and not (batch[2] is None or isinstance(batch[2], int)):
            self.err(where, "dp_rank must be an int or nil")
        if not isinstance(batch[1], list):
            self.err(where, "events must be a list")
            return
        for i, ev in enumerate(batch[1]):
            self.check_event(ev, f"{where} event {i}")

    def check_event(self, ev, where):
        if not isinstance(ev, dict) or "type" not in ev:
            self.err(where, "event must be a map with a 'type' key")
            return
        kind = ev["type"]
        want = {"BlockStored": STORED_FIELDS, "BlockRemoved": REMOVED_FIELDS,
                "AllBlocksCleared": CLEARED_FIELDS}.get(kind)
        if want is None:
            self.err(where, f"unknown event type {kind!r}")
            return
        if list(ev.keys()) != want:
            self.err(where, f"{kind} fields {list(ev.keys())} != {want}")
            return
        self.counts[kind] += 1
        if kind == "AllBlocksCleared":
            self.cached.clear()
            return
        hashes = ev["block_hashes"]
        if not isinstance(hashes, list) or not hashes:
            self.err(where, "block_hashes must be a non-empty list")
            return
        for h in hashes:
            if not isinstance(h, int) or not 0 <= h <= U64_MAX:
                self.err(where, f"block hash {h!r} is not a u64")
        if not (ev["medium"] is None or isinstance(ev["medium"], str)):
            self.err(where, "medium must be a string or nil")
        if not isinstance(ev["group_idx"], int):
            self.err(where, "group_idx must be an int")
        if kind == "BlockRemoved":
            self.counts["blocks_removed"] += len(hashes)
            for h in hashes:
                if h in self.cached:
                    self.cached.discard(h)
                else:
                    self.state_problem(where, f"removed unknown block {h}")
            return
        bs = ev["block_size"]
        if not isinstance(bs, int) or bs <= 0:
            self.err(where, "block_size must be a positive int")
            return
        toks = ev["token_ids"]
        if not isinstance(toks, list) or not all(isinstance(t, int) and t >= 0 for t in toks):
            self.err(where, "token_ids must be a list of non-negative ints")
        elif len(toks) != len(hashes) * bs:
            self.err(where, f"{len(toks)} token ids for {len(hashes)} blocks of {bs}")
        parent = ev["parent_block_hash"]
        if parent is not None:
            if not isinstance(parent, int) or not 0 <= parent <= U64_MAX:
                self.err(where, "parent_block_hash must be a u64 or nil")
            elif parent not in self.cached:
                self.state_problem(where, f"parent {parent} not stored")
        if not (ev["lora_id"] is None or isinstance(ev["lora_id"], int)):
            self.err(where, "lora_id must be an int or nil")
        if not (ev["lora_name"] is None or isinstance(ev["lora_name"], str)):
            self.err(where, "lora_name must be a string or nil")
        ek = ev["extra_keys"]
        if not (ek is None or (isinstance(ek, list) and len(ek) == len(hashes))):
            self.err(where, "extra_keys must be nil or one entry per block")
        if not isinstance(ev["kv_cache_spec_kind"], str):
            self.err(where, "kv_cache_spec_kind must be a string")
        self.counts["blocks_stored"] += len(hashes)
        for h in hashes:
            self.cached.add(h)

    def report(self, name):
        status = "OK" if not self.errors else f"FAILED ({len(self.errors)} errors)"
        print(f"{name}: {status} {json.dumps(self.counts)} "
              f"cached_now={len(self.cached)} state_warnings={self.state_warnings}")
        for e in self.errors[:20]:
            print("  " + e)
        return not self.errors


def check_pub_capture(path):
    c = Checker(strict_state=False)
    with open(path, "rb") as f:
        msgs = msgpack.unpackb(f.read(), raw=True)
    for i, m in enumerate(msgs):
        where = f"{path}#{i}"
        if len(m) != 3:
            c.err(where, f"{len(m)} frames, want [topic, seq, payload]")
            continue
        c.check_seq(m[1], where)
        c.check_payload(m[2], where)
    return c.report(path)


def check_replay_frames(msgs, name, c):
    ended = False
    for i, m in enumerate(msgs):
        where = f"{name}#{i}"
        if ended:
            c.err(where, "message after the end marker")
        if len(m) not in (3, 4) or m[0] != b"":
            c.err(where, "replay message must be ['', (topic,)? seq, payload]")
            continue
        seq, payload = m[-2], m[-1]
        if seq == END_SEQ:
            if payload != b"":
                c.err(where, "end marker must have an empty payload")
            ended = True
            continue
        c.check_seq(seq, where)
        c.check_payload(payload, where)
    if not ended:
        c.err(name, "no end marker (seq = -1)")


def check_replay_capture(path):
    c = Checker(strict_state=False)
    with open(path, "rb") as f:
        msgs = msgpack.unpackb(f.read(), raw=True)
    check_replay_frames(msgs, path, c)
    return c.report(path)


def drive(base, n, seed):
    """Send completions with token-id prompts sharing prefixes (forces hits/evictions)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000, 100000) for _ in range(rng.randrange(32, 400))]
                for _ in range(8)]
    for i in range(n):
        prompt = list(rng.choice(prefixes)) + [rng.randrange(1000, 100000)
                                               for _ in range(rng.randrange(1, 300))]
        body = json.dumps({"prompt": prompt, "max_tokens": rng.randrange(1, 40),
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(base + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()
        if i == n // 2:
            urllib.request.urlopen(urllib.request.Request(
                base + "/reset_prefix_cache", data=b"", method="POST"), timeout=30).read()


def check_live(args):
    import zmq

    ctx = zmq.Context()
    ok = True
    live = Checker(strict_state=False)
    if args.sub:
        sub = ctx.socket(zmq.SUB)
        sub.connect(args.sub)
        sub.setsockopt(zmq.SUBSCRIBE, args.topic.encode())
        time.sleep(0.3)  # let the subscription reach the publisher
    if args.drive:
        drive(args.drive, args.requests, args.seed)
    if args.sub:
        deadline = time.time() + args.timeout
        while time.time() < deadline:
            if not sub.poll(int(args.idle * 1000)):
                break
            frames = sub.recv_multipart()
            if len(frames) != 3:
                live.err("live", f"{len(frames)} frames, want 3")
                continue
            if frames[0] != args.topic.encode():
                live.err("live", f"topic {frames[0]!r}")
            live.check_seq(frames[1], f"live seq {int.from_bytes(frames[1], 'big')}")
            live.check_payload(frames[2], "live")
        ok &= live.report(f"PUB {args.sub}")
        if live.counts["batches"] == 0:
            print("  no batches received on the PUB socket")
            ok = False
    if args.replay:
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(args.replay)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        msgs = []
        while dealer.poll(int(args.timeout * 1000)):
            m = dealer.recv_multipart()
            msgs.append(m)
            if len(m) >= 3 and m[-2] == END_SEQ:
                break
        # From seq 0 the whole history is visible: state checks are strict.
        c = Checker(strict_state=True)
        check_replay_frames(msgs, f"REPLAY {args.replay}", c)
        ok &= c.report(f"REPLAY {args.replay} from seq 0")
    ctx.destroy(linger=0)
    return ok


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--capture", action="append", default=[],
                   help="msgpack file of [topic, seq, payload] PUB messages")
    p.add_argument("--replay-capture", action="append", default=[],
                   help="msgpack file of replay answers ['', topic, seq, payload]")
    p.add_argument("--sub", help="PUB endpoint to subscribe to, e.g. tcp://127.0.0.1:5557")
    p.add_argument("--replay", help="replay ROUTER endpoint, e.g. tcp://127.0.0.1:5558")
    p.add_argument("--topic", default="kv")
    p.add_argument("--drive", help="engine base URL to send traffic to first")
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--idle", type=float, default=2.0,
                   help="stop reading the PUB socket after this many idle seconds")
    args = p.parse_args()
    ok = True
    for path in args.capture:
        ok &= check_pub_capture(path)
    for path in args.replay_capture:
        ok &= check_replay_capture(path)
    if args.sub or args.replay:
        ok &= check_live(args)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
