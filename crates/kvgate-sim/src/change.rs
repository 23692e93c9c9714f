//! Fleet changes on a schedule: the `--change AT:WHAT` syntax and its meaning.
//!
//! Owns the vocabulary of what can happen to the fleet during a simulation and when.
//! It must not apply a change (the simulation does) or know about policies.

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};

/// What happens to the fleet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ChangeKind {
    /// A new, empty engine joins (as through `POST /admin/workers`).
    Add,
    /// Engine i leaves the fleet: no new requests; those it holds finish.
    Remove(usize),
    /// Engine i dies: its requests in flight fail, the router takes it out of rotation
    /// and forgets what it cached (as its health checks would), and after the restart
    /// downtime it comes back with an empty cache and its event sequence starting over.
    Restart(usize),
    /// Engine i's prefix cache is reset (`POST /reset_prefix_cache?reset_running_requests=true`).
    Reset(usize),
}

/// A change at a virtual time.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct FleetChange {
    /// Milliseconds from the start of the run.
    pub at_ms: f64,
    pub kind: ChangeKind,
}

impl FleetChange {
    /// Parse `AT:add`, `AT:remove=I`, `AT:restart=I` or `AT:reset=I`, with `AT` in
    /// seconds (`30`, `30s`, `1.5s`) or milliseconds (`1500ms`) and `I` an engine's
    /// 0-based index (engines added later continue the numbering).
    pub fn parse(s: &str) -> anyhow::Result<Self> {
        let shape = || {
            format!("fleet change {s:?} must look like AT:add, AT:remove=I, AT:restart=I or AT:reset=I (AT in s or ms)")
        };
        let (at, what) = s.split_once(':').with_context(shape)?;
        let at = at.trim();
        let at_ms = if let Some(ms) = at.strip_suffix("ms") {
            ms.trim().parse::<f64>().with_context(shape)?
        } else {
            at.strip_suffix('s')
                .unwrap_or(at)
                .trim()
                .parse::<f64>()
                .with_context(shape)?
                * 1000.0
        };
        if !(at_ms.is_finite() && at_ms >= 0.0) {
            bail!(shape());
        }
        let (name, arg) = match what.trim().split_once('=') {
            Some((n, a)) => (n.trim(), Some(a.trim())),
            None => (what.trim(), None),
        };
        let index = || -> anyhow::Result<usize> {
            arg.with_context(shape)?
                .parse::<usize>()
                .with_context(shape)
        };
        let kind = match name {
            "add" if arg.is_none() => ChangeKind::Add,
            "remove" => ChangeKind::Remove(index()?),
            "restart" => ChangeKind::Restart(index()?),
            "reset" => ChangeKind::Reset(index()?),
            _ => bail!(shape()),
        };
        Ok(Self { at_ms, kind })
    }
}

impl std::fmt::Display for FleetChange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let at = self.at_ms / 1000.0;
        match self.kind {
            ChangeKind::Add => write!(f, "{at}s:add"),
            ChangeKind::Remove(i) => write!(f, "{at}s:remove={i}"),
            ChangeKind::Restart(i) => write!(f, "{at}s:restart={i}"),
            ChangeKind::Reset(i) => write!(f, "{at}s:reset={i}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_parse_and_print_back() {
        let c = FleetChange::parse("30:add").unwrap();
        assert_eq!(c.at_ms, 30_000.0);
        assert_eq!(c.kind, ChangeKind::Add);
        assert_eq!(
            FleetChange::parse("1500ms:restart=1").unwrap(),
            FleetChange {
                at_ms: 1500.0,
                kind: ChangeKind::Restart(1)
            }
        );
        assert_eq!(
            FleetChange::parse("2.5s:reset=0").unwrap().to_string(),
            "2.5s:reset=0"
        );
        assert_eq!(
            FleetChange::parse("8s:remove=3").unwrap().kind,
            ChangeKind::Remove(3)
        );
        for bad in [
            "add",
            "x:add",
            "-1:add",
            "5:restart",
            "5:reset=a",
            "5:add=1",
            "5:grow",
        ] {
            assert!(FleetChange::parse(bad).is_err(), "{bad}");
        }
    }
}
