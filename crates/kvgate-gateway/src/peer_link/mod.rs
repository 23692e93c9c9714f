//! The link between replicas, below the gateway's shared state: what travels between
//! them (`wire`), this replica's side of it (`hub`: identity, latest report, followed
//! peers, settled choices) and asking a peer (`client`: the request every peer call
//! carries, one bounded exchange, the start-up name check, the index bootstrap the
//! models' KV-event subscribers use). The gateway holds the hub and hands the bootstrap
//! to its selection services; what runs on top of the gateway (reports published and
//! followed, the leader's choices, the endpoints) is in `peers`. Must not import the
//! gateway.

pub mod client;
pub mod hub;
pub mod wire;
