//! A request's latency objectives and priority, read once per request before it is
//! routed: the headers `x-slo-ttft-ms` and `x-slo-tpot-ms` (llm-d's
//! `x-llm-d-slo-ttft-ms` and `x-llm-d-slo-tpot-ms` too), else the model's defaults
//! (`slo_ttft_ms`, `slo_tpot_ms`); the priority from `x-priority` (higher is more
//! important, below 0 sheddable: llm-d's convention), else from the body's `priority`
//! as vLLM reads it (lower is handled earlier), negated. The body is passed on
//! unchanged, so vLLM still schedules by its own `priority`. Owns the parsing only;
//! the selection service judges choices against the objective
//! (`kvgate_core::objective`).

use std::time::Duration;

use axum::http::HeaderMap;
use kvgate_core::Objective;

use crate::config::ModelConfig;
use crate::errors::ApiError;

/// Request headers naming a TTFT objective in milliseconds (kvgate's, then llm-d's).
pub const TTFT_HEADERS: [&str; 2] = ["x-slo-ttft-ms", "x-llm-d-slo-ttft-ms"];
/// Request headers naming a TPOT objective in milliseconds.
pub const TPOT_HEADERS: [&str; 2] = ["x-slo-tpot-ms", "x-llm-d-slo-tpot-ms"];
/// Request header naming the priority (an integer; below 0: sheddable).
pub const PRIORITY_HEADER: &str = "x-priority";

/// The objective of a request to `model` with `headers` and the body's `priority`
/// field; 400 for a header that is not a positive number (or an integer priority).
pub fn objective_of(
    model: &ModelConfig,
    headers: &HeaderMap,
    body_priority: Option<i64>,
) -> Result<Objective, ApiError> {
    let ms = |names: [&str; 2], default: Option<u64>| -> Result<Option<Duration>, ApiError> {
        for name in names {
            if let Some(v) = headers.get(name) {
                let parsed = v.to_str().ok().and_then(|s| s.trim().parse::<f64>().ok());
                return match parsed.and_then(Objective::millis) {
                    Some(d) => Ok(Some(d)),
                    None => Err(ApiError::bad_request(
                        "invalid_objective",
                        format!("header {name} must be a positive number of milliseconds"),
                    )),
                };
            }
        }
        Ok(default.filter(|&d| d > 0).map(Duration::from_millis))
    };
    let priority = match headers.get(PRIORITY_HEADER) {
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|s| s.trim().parse::<i32>().ok())
            .ok_or_else(|| {
                ApiError::bad_request(
                    "invalid_priority",
                    format!("header {PRIORITY_HEADER} must be an integer"),
                )
            })?,
        None => body_priority.map_or(0, |p| {
            i32::try_from(-p.clamp(-1 << 30, 1 << 30)).unwrap_or(0)
        }),
    };
    Ok(Objective {
        ttft: ms(TTFT_HEADERS, model.slo_ttft_ms)?,
        tpot: ms(TPOT_HEADERS, model.slo_tpot_ms)?,
        priority,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn headers_then_model_defaults_then_nothing() {
        let mut model = ModelConfig::default();
        let none = objective_of(&model, &HeaderMap::new(), None).unwrap();
        assert!(!none.is_set() && none.priority == 0);
        model.slo_ttft_ms = Some(2000);
        let d = objective_of(&model, &HeaderMap::new(), None).unwrap();
        assert_eq!(d.ttft, Some(Duration::from_secs(2)));
        let h = headers(&[("x-llm-d-slo-ttft-ms", "500"), ("x-slo-tpot-ms", "40")]);
        let o = objective_of(&model, &h, None).unwrap();
        assert_eq!(o.ttft, Some(Duration::from_millis(500)));
        assert_eq!(o.tpot, Some(Duration::from_millis(40)));
        let h = headers(&[("x-slo-ttft-ms", "100"), ("x-llm-d-slo-ttft-ms", "900")]);
        let o = objective_of(&model, &h, None).unwrap();
        assert_eq!(
            o.ttft,
            Some(Duration::from_millis(100)),
            "kvgate's name first"
        );
    }

    /// `x-priority` as llm-d counts (below 0: sheddable); without it the body's
    /// `priority` as vLLM counts (lower first), negated.
    #[test]
    fn priority_from_the_header_or_the_body() {
        let model = ModelConfig::default();
        let p = |h: &[(&'static str, &str)], body| objective_of(&model, &headers(h), body);
        assert!(p(&[("x-priority", "-1")], None).unwrap().sheddable());
        assert_eq!(p(&[("x-priority", "5")], Some(3)).unwrap().priority, 5);
        assert!(
            p(&[], Some(1)).unwrap().sheddable(),
            "vLLM's later is sheddable"
        );
        assert_eq!(p(&[], Some(-2)).unwrap().priority, 2);
    }

    #[test]
    fn malformed_values_are_bad_requests() {
        let model = ModelConfig::default();
        for (k, v) in [
            ("x-slo-ttft-ms", "soon"),
            ("x-slo-ttft-ms", "0"),
            ("x-llm-d-slo-tpot-ms", "-5"),
            ("x-priority", "high"),
        ] {
            let e = objective_of(&model, &headers(&[(k, v)]), None).unwrap_err();
            assert_eq!(e.status.as_u16(), 400, "{k}: {v}");
        }
    }
}
