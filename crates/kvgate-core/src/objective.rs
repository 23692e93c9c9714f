//! Latency objectives: what a request asks of its time to first token and time per
//! output token, with its priority, and the judgement of a policy's choice against them
//! from the time model's predictions (each score line's predicted TTFT and TPOT, module
//! [`crate::timing`]). Owns that judgement only: the selection service acts on it
//! (keeps the choice, chooses again among the workers predicted to meet the objective,
//! or sheds a sheddable request). Pure.
//!
//! A worker meets a TTFT objective when the request is predicted to get its first token
//! in time there (the prediction times the worker's spread: what 19 like requests in 20
//! get, not the median; module [`crate::timing`]) and, if the worker has prefill
//! queued (it is not keeping up with its arrivals), so is a like request booked right
//! after it: a choice must leave room for the requests behind it. Without that headroom
//! a busy fleet admits sheddable work that the next interactive request then waits
//! behind (mixed-priority overload goodput 6.5 -> 7.9 req/s when it came, c2bbb98). A
//! worker with nothing queued is judged by the request alone: judged by the next one
//! too, a nearly idle fleet shed half of its sheddable 16k-token prompts (whose
//! objective lay between one prefill and two) at no gain.

use std::time::Duration;

use crate::ids::WorkerId;
use crate::policy::WorkerScore;

/// A request's latency objectives and priority (none set: nothing to judge).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Objective {
    /// Time to first token it should get.
    pub ttft: Option<Duration>,
    /// Time per output token it should get.
    pub tpot: Option<Duration>,
    /// Higher is more important; below 0 the request is sheddable: refused at once
    /// when no worker is predicted to meet its objective (llm-d's convention).
    pub priority: i32,
}

impl Objective {
    /// Whether there is any objective to judge.
    pub fn is_set(&self) -> bool {
        self.ttft.is_some() || self.tpot.is_some()
    }

    pub fn sheddable(&self) -> bool {
        self.priority < 0
    }

    /// An objective of `ms` milliseconds, as every front door reads one: `None` unless
    /// `ms` is a positive finite number (the caller refuses the request then).
    pub fn millis(ms: f64) -> Option<Duration> {
        if ms.is_finite() && ms > 0.0 {
            Duration::try_from_secs_f64(ms / 1e3).ok()
        } else {
            None
        }
    }

    /// How far `line`'s predictions miss the objectives, as fractions of them, summed
    /// (0: predicted to meet both; a line without predictions is taken to meet them).
    fn miss(&self, line: &WorkerScore) -> f64 {
        let over =
            |predicted: Option<f64>, objective: Option<Duration>| match (predicted, objective) {
                (Some(p), Some(o)) if o > Duration::ZERO => {
                    ((p - o.as_secs_f64()) / o.as_secs_f64()).max(0.0)
                }
                _ => 0.0,
            };
        over(judged_ttft_secs(line), self.ttft) + over(line.predicted_tpot_secs, self.tpot)
    }
}

/// The TTFT a TTFT objective is judged on (module comment): the later of this
/// request's and, on a worker with prefill queued, a like request's after it.
fn judged_ttft_secs(line: &WorkerScore) -> Option<f64> {
    let own = line.predicted_ttft_secs;
    let judged = match line.predicted_next_ttft_secs {
        Some(next) if line.prefill_tokens > 0 => own.map(|t| t.max(next)).or(Some(next)),
        _ => own,
    };
    judged.map(|t| t * line.ttft_spread.unwrap_or(1.0))
}

/// A choice judged against an objective.
#[derive(Clone, Debug, PartialEq)]
pub enum Judgement {
    /// The chosen worker is predicted to meet it.
    Met,
    /// It is not; these candidates are (in score order).
    Elsewhere(Vec<WorkerId>),
    /// No candidate is: `closest` is predicted to miss by least, its first token (or,
    /// while it has prefill queued, the next request's) `late` after the objective
    /// (zero when only the TPOT objective is missed).
    Unmet { closest: WorkerId, late: Duration },
}

/// Judges the choice of `chosen` among the candidates `scores` describe.
pub fn judge(scores: &[WorkerScore], chosen: WorkerId, objective: &Objective) -> Judgement {
    let chosen_meets = scores
        .iter()
        .find(|s| s.worker == chosen)
        .is_none_or(|s| objective.miss(s) == 0.0);
    if chosen_meets {
        return Judgement::Met;
    }
    let meeting: Vec<WorkerId> = scores
        .iter()
        .filter(|s| objective.miss(s) == 0.0)
        .map(|s| s.worker)
        .collect();
    if !meeting.is_empty() {
        return Judgement::Elsewhere(meeting);
    }
    let closest = scores
        .iter()
        .min_by(|a, b| objective.miss(a).total_cmp(&objective.miss(b)))
        .unwrap_or_else(|| unreachable!("the chosen worker has a line"));
    let late = match (judged_ttft_secs(closest), objective.ttft) {
        (Some(p), Some(o)) => Duration::try_from_secs_f64(p - o.as_secs_f64()).unwrap_or_default(),
        _ => Duration::ZERO,
    };
    Judgement::Unmet {
        closest: closest.worker,
        late,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(worker: u32, ttft_ms: f64, tpot_ms: f64) -> WorkerScore {
        WorkerScore {
            worker: WorkerId(worker),
            overlap_blocks: [0; 3],
            in_flight: 0,
            prefill_tokens: 0,
            decode_blocks: 0.0,
            cost: None,
            predicted_ttft_secs: Some(ttft_ms / 1e3),
            predicted_tpot_secs: Some(tpot_ms / 1e3),
            predicted_next_ttft_secs: None,
            ttft_spread: None,
        }
    }

    /// `line` on a worker with prefill queued, a like request after this one predicted
    /// to get its first token at `next_ms`.
    fn busy(worker: u32, ttft_ms: f64, next_ms: f64) -> WorkerScore {
        WorkerScore {
            prefill_tokens: 4096,
            predicted_next_ttft_secs: Some(next_ms / 1e3),
            ttft_spread: None,
            ..line(worker, ttft_ms, 20.0)
        }
    }

    fn objective(ttft_ms: Option<u64>, tpot_ms: Option<u64>) -> Objective {
        Objective {
            ttft: ttft_ms.map(Duration::from_millis),
            tpot: tpot_ms.map(Duration::from_millis),
            priority: 0,
        }
    }

    #[test]
    fn a_choice_that_meets_the_objective_stands() {
        let scores = [line(0, 300.0, 20.0), line(1, 100.0, 20.0)];
        let o = objective(Some(500), Some(50));
        assert_eq!(judge(&scores, WorkerId(0), &o), Judgement::Met);
        assert!(!Objective::default().is_set());
    }

    #[test]
    fn an_objective_in_milliseconds_is_positive_and_finite() {
        assert_eq!(Objective::millis(250.0), Some(Duration::from_millis(250)));
        assert_eq!(Objective::millis(0.5), Some(Duration::from_micros(500)));
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e300] {
            assert_eq!(Objective::millis(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_choice_that_misses_names_the_workers_that_meet_it() {
        let scores = [
            line(0, 900.0, 20.0),
            line(1, 400.0, 20.0),
            line(2, 450.0, 80.0),
        ];
        let o = objective(Some(500), Some(50));
        assert_eq!(
            judge(&scores, WorkerId(0), &o),
            Judgement::Elsewhere(vec![WorkerId(1)])
        );
    }

    /// When nobody meets it, the worker missing by least (TTFT and TPOT misses as
    /// fractions of their objectives) and how late its first token is predicted.
    #[test]
    fn when_nobody_meets_it_the_closest_miss_is_named() {
        let scores = [
            line(0, 1500.0, 20.0),
            line(1, 1200.0, 20.0),
            line(2, 1100.0, 100.0),
        ];
        let o = objective(Some(1000), Some(50));
        let Judgement::Unmet { closest, late } = judge(&scores, WorkerId(0), &o) else {
            panic!("nobody meets it");
        };
        assert_eq!(closest, WorkerId(1));
        assert!(late.abs_diff(Duration::from_millis(200)) < Duration::from_micros(1));
    }

    /// An objective is judged on the prediction times the worker's spread (observed over
    /// predicted TTFT at the judged quantile): 600 ms predicted where the judged share of
    /// like requests came within twice their prediction does not meet 1 s.
    #[test]
    fn the_prediction_is_judged_with_the_workers_spread() {
        let o = objective(Some(1000), None);
        let plain = line(0, 600.0, 10.0);
        assert_eq!(
            judge(std::slice::from_ref(&plain), WorkerId(0), &o),
            Judgement::Met
        );
        let spread = WorkerScore {
            ttft_spread: Some(2.0),
            ..plain
        };
        let Judgement::Unmet { late, .. } = judge(&[spread], WorkerId(0), &o) else {
            panic!("1.2 s judged is late");
        };
        assert_eq!(late, Duration::from_millis(200));
    }

    /// A worker with prefill queued meets the objective only if the request after this
    /// one would too (the choice leaves headroom); an idle one is judged by this request
    /// alone, however slow the next would be.
    #[test]
    fn a_busy_worker_must_leave_room_for_the_next_request() {
        let o = objective(Some(1000), None);
        let scores = [busy(0, 600.0, 1200.0), busy(1, 700.0, 900.0)];
        assert_eq!(
            judge(&scores, WorkerId(0), &o),
            Judgement::Elsewhere(vec![WorkerId(1)])
        );
        let idle = WorkerScore {
            prefill_tokens: 0,
            ..busy(0, 600.0, 1200.0)
        };
        assert_eq!(judge(&[idle], WorkerId(0), &o), Judgement::Met);
        let Judgement::Unmet { late, .. } = judge(&scores[..1], WorkerId(0), &o) else {
            panic!("the only worker leaves no room");
        };
        assert!(late.abs_diff(Duration::from_millis(200)) < Duration::from_micros(1));
    }
}
