//! The Endpoint Picker's own metrics, registered in the gateway's registry so they
//! render with every other kvgate metric at `/metrics` (the HTTP port).
//!
//! Owns their names and labels. Must not count what the gateway counts already
//! (requests by status: `kvgate_requests_total`; decisions by rule:
//! `kvgate_routing_decisions_total`; response ends: `kvgate_response_ends_total`).

use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts};

pub struct EppMetrics {
    /// ext_proc streams ended (one per request the gateway asked about).
    pub streams: IntCounter,
    /// ext_proc streams open now.
    pub streams_open: IntGauge,
    /// Picks by model and the rule that decided (`rotation`: a request that is not
    /// routed; model "").
    pub picks: IntCounterVec,
    /// Requests answered by the picker itself (an ImmediateResponse), by HTTP status.
    pub immediate: IntCounterVec,
    /// Responses served by another endpoint than the one picked (the booking moved).
    pub served_elsewhere: IntCounterVec,
}

impl EppMetrics {
    pub fn register(registry: &prometheus::Registry) -> prometheus::Result<EppMetrics> {
        let m = EppMetrics {
            streams: IntCounter::new(
                "kvgate_epp_streams_total",
                "ext_proc streams ended (one per request the gateway asked the Endpoint Picker about)",
            )?,
            streams_open: IntGauge::new("kvgate_epp_streams_open", "ext_proc streams open now")?,
            picks: IntCounterVec::new(
                Opts::new(
                    "kvgate_epp_picks_total",
                    "Endpoints picked, by model and the rule that decided (rotation: a request that is not routed)",
                ),
                &["model", "rule"],
            )?,
            immediate: IntCounterVec::new(
                Opts::new(
                    "kvgate_epp_immediate_responses_total",
                    "Requests the Endpoint Picker answered itself (400, 413, 429, 503, ...), by status",
                ),
                &["status"],
            )?,
            served_elsewhere: IntCounterVec::new(
                Opts::new(
                    "kvgate_epp_served_elsewhere_total",
                    "Responses the gateway reports served by another endpoint than the one picked (the booking moved there)",
                ),
                &["model"],
            )?,
        };
        registry.register(Box::new(m.streams.clone()))?;
        registry.register(Box::new(m.streams_open.clone()))?;
        registry.register(Box::new(m.picks.clone()))?;
        registry.register(Box::new(m.immediate.clone()))?;
        registry.register(Box::new(m.served_elsewhere.clone()))?;
        for status in ["400", "404", "413", "429", "503"] {
            m.immediate.with_label_values(&[status]);
        }
        Ok(m)
    }
}
