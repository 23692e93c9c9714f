//! Identifiers shared by every part of the core: workers, data-parallel ranks and
//! storage tiers. Owns no state.

use serde::{Deserialize, Serialize};

/// A worker (one engine replica endpoint) as numbered by whoever owns the fleet
/// (the gateway's registry). Ids are never reused for a different replica.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct WorkerId(pub u32);

impl std::fmt::Display for WorkerId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "w{}", self.0)
    }
}

/// One KV-cache owner inside a worker: vLLM data-parallel rank `dp_rank` of `worker`
/// publishes its own event stream and holds its own cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct WorkerRef {
    pub worker: WorkerId,
    pub dp_rank: u32,
}

impl WorkerRef {
    pub fn new(worker: WorkerId, dp_rank: u32) -> Self {
        Self { worker, dp_rank }
    }
}

/// Where a cached block lives. Lower tiers are slower to load back, so they earn
/// partial credit when scoring overlap.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    /// Accelerator memory (vLLM medium `GPU`).
    Device = 0,
    /// Host memory (vLLM medium `CPU`, offloaded blocks).
    Host = 1,
    /// Disk or remote storage (any other medium).
    Disk = 2,
}

impl Tier {
    pub const ALL: [Tier; 3] = [Tier::Device, Tier::Host, Tier::Disk];

    /// Maps an engine's `medium` string to a tier. `None` (older engines send no
    /// medium) means device memory.
    pub fn from_medium(medium: Option<&str>) -> Tier {
        match medium {
            None => Tier::Device,
            Some(m) if m.eq_ignore_ascii_case("gpu") || m.eq_ignore_ascii_case("device") => {
                Tier::Device
            }
            Some(m)
                if m.eq_ignore_ascii_case("cpu")
                    || m.eq_ignore_ascii_case("cpu_tier1")
                    || m.eq_ignore_ascii_case("host") =>
            {
                Tier::Host
            }
            Some(_) => Tier::Disk,
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }
}
