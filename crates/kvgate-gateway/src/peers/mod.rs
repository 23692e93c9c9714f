//! Replicas that agree: this gateway's load reports to its peer replicas, and theirs to
//! it.
//!
//! Split by job, in two layers. Below the gateway, `peer_link` (its own folder): `wire`
//! (what travels), `hub` (this replica's side: identity, latest report, followed peers,
//! settled choices), `client` (asking a peer: requests, the index bootstrap). Here,
//! above it: `publish` and `follow` (the report streams), `leader` (choices made at the
//! leader, asked and served), `endpoints` (the `/peer/v1` handlers; their token is
//! checked at the front door).
//!
//! Owns this replica's identity (name, incarnation), the report it publishes (the
//! load it booked per worker, by worker URL, for every model), the report stream it
//! serves at `GET /peer/v1/loads`, following each peer's stream (static URLs, or the
//! addresses of a DNS name re-resolved periodically) and handing what arrives to the
//! model's ledger, which holds it beside this replica's own bookings
//! (`kvgate_core::peer_loads`). Also the index bootstrap over the same links: serving
//! a snapshot of one worker rank's index entries with the event sequence number they
//! reflect (`POST /peer/v1/index`), and the callback a new replica's KV-event
//! subscribers use to ask its peers for one before replaying the engine's buffer. And
//! the transport of decisions made at a leader (`peers.decisions: leader`): which
//! connected replica leads (the longest running), asking it to choose
//! (`POST /peer/v1/decide`), serving such requests, and the `settled` ids by which a
//! replica's reports tell the leader that a choice it made is now in the replica's own
//! bookings. It must not choose workers itself (the model's selection service does,
//! here and at the leader) or change this replica's own bookings, and it never forwards
//! a peer's load to another peer (each replica reports only what it booked, so nothing
//! is counted twice).
//!
//! Why a leader: reports make every replica see the others' load within `publish_ms`,
//! but requests that reach several replicas at the same instant are decided
//! concurrently, each blind to the others' choices, so they herd onto the same
//! worker however short the reporting interval (measured on the Mooncake trace, whose
//! requests arrive in bursts: docs/BENCHMARKS.md, "Replicas that agree"). One replica
//! deciding for all puts those decisions in order, as a single router would, for one
//! loopback or in-cluster round trip each (the choice is a few microseconds of work;
//! the asker sends the prompt's block keys, not its text). The leader holds each
//! choice as the asker's booking until the asker's report shows it; a leader that does
//! not answer within `decide_timeout_ms` is skipped for a second while every replica
//! decides alone on the reported loads, as with `decisions: local`.
//!
//! Why reports of totals over HTTP, not per-booking messages over ZeroMQ: a report is
//! this replica's whole booked load per worker, sent when it changes (checked every
//! `publish_ms`) and at least every `heartbeat_ms`. A lost, repeated or reordered
//! report cannot leave drift, a late joiner is complete after one report, and a
//! restarted replica's report replaces its old run's bookings by construction; the
//! size is one line per worker, not per request. HTTP rides the listener that is
//! already exposed (no second port in a Kubernetes Service), reuses the admin token
//! for authentication, and a closed connection says at once that a peer is gone
//! (killed process: its bookings drop immediately; silent peer: after `expiry_ms`).
//! The `zeromq` crate's SUB socket neither reports a lost peer nor reconnects (the
//! KV-event subscriber needs its own link watch for that).

pub mod endpoints;
pub mod follow;
pub mod leader;
pub mod publish;
