//! This replica's side of the exchange: who it is, its latest report line, the peers
//! whose streams are open, and the choices a leader made for it that it has settled.
//! Shared (`Arc`) by the gateway, its background tasks and the index bootstrap. Owns
//! that state and which peer leads; must not do I/O.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use tokio::sync::watch;

/// Settled ids older than this are forgotten whether or not they were reported.
const SETTLED_MAX_AGE: Duration = Duration::from_secs(10);

/// Who this replica is among its peers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    pub replica: String,
    /// Start time in nanoseconds since the Unix epoch: a restart has a larger one.
    pub incarnation: u64,
}

/// This replica's side of the exchange: its identity and its latest report line.
/// Shared (`Arc`) with the index bootstrap callbacks.
pub struct PeerHub {
    identity: OnceLock<Identity>,
    pub(crate) latest: watch::Sender<Bytes>,
    /// Peers whose report stream is open now: address → who answers there.
    pub(crate) followed: parking_lot::Mutex<BTreeMap<String, Identity>>,
    /// The choices asked of a leader: those settled lately and those still asked.
    choices: parking_lot::Mutex<Choices>,
    /// A leader that did not answer is passed over until then.
    leader_skipped_until: parking_lot::Mutex<Option<Instant>>,
    /// Index bootstraps (asking peers for a worker's snapshot) running now.
    bootstraps: Arc<AtomicUsize>,
}

/// The choices this replica asked of a leader.
#[derive(Default)]
struct Choices {
    /// The next choice's id.
    next: u64,
    /// Asked and not settled yet.
    asking: BTreeSet<u64>,
    /// Settled, with their settling time, kept in the reports for a while (a follower
    /// may skip a report; the next still names them).
    settled: VecDeque<(Instant, u64)>,
}

impl Choices {
    /// Every id below this one is settled.
    fn settled_below(&self) -> u64 {
        self.asking.first().copied().unwrap_or(self.next)
    }

    /// Forgets the ids settled longer than `age` before `now`.
    fn forget_settled(&mut self, now: Instant, age: Duration) {
        while self
            .settled
            .front()
            .is_some_and(|(at, _)| now.saturating_duration_since(*at) > age)
        {
            self.settled.pop_front();
        }
    }
}

/// A choice asked of the leader ([`PeerHub::ask`]), until it is settled: booked here
/// ([`Ask::settle`]) or, when dropped unbooked (the leader refused, answered too late,
/// or the client went away meanwhile), given up. Either way the next reports tell the
/// leader, which ends its hold of the choice.
pub struct Ask<'a> {
    hub: &'a PeerHub,
    pub id: u64,
    settled: bool,
}

impl Ask<'_> {
    /// Books the choice with `book`. The booking and the settling are one step for
    /// the publisher, which reads both under the same lock
    /// ([`PeerHub::settled_with_loads`]): a report never shows the booking without the
    /// id, which would count it twice at the leader, or the id without the booking.
    pub fn settle<T>(mut self, book: impl FnOnce() -> T) -> T {
        self.settled = true;
        self.hub.settle(self.id, book)
    }
}

impl Drop for Ask<'_> {
    fn drop(&mut self) {
        if !self.settled {
            self.hub.settle(self.id, || ());
        }
    }
}

/// An index bootstrap running: counted in [`PeerHub::bootstrapping`] until dropped.
pub struct BootstrapRunning(Arc<AtomicUsize>);

impl Drop for BootstrapRunning {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Identity {
    /// What orders replicas for leadership: the longest running first, then by name.
    fn seniority(&self) -> (u64, &str) {
        (self.incarnation, &self.replica)
    }
}

impl Default for PeerHub {
    fn default() -> Self {
        Self {
            identity: OnceLock::new(),
            latest: watch::Sender::new(Bytes::new()),
            followed: Default::default(),
            choices: parking_lot::Mutex::new(Choices {
                next: 1,
                ..Default::default()
            }),
            leader_skipped_until: Default::default(),
            bootstraps: Default::default(),
        }
    }
}

impl PeerHub {
    /// Sets this replica's identity once it listens (the default name needs the port).
    pub fn init_identity(&self, configured: Option<&str>, addr: SocketAddr) -> &Identity {
        self.identity.get_or_init(|| Identity {
            replica: configured
                .map(str::to_owned)
                .unwrap_or_else(|| format!("{}/{addr}", host_name())),
            incarnation: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64),
        })
    }

    pub fn identity(&self) -> Option<&Identity> {
        self.identity.get()
    }

    /// The address and name of the replica that chooses for this one: the longest
    /// running (smallest incarnation; ties by name) among this replica and the peers
    /// whose streams are open. A replica that restarts comes back as the youngest, so a
    /// rolling restart moves leadership at most once per replica replaced, when the
    /// leader itself goes. `None` when that is this replica (or a leader that did not
    /// answer is being passed over).
    pub fn leader(&self) -> Option<(String, String)> {
        let own = self.identity()?;
        if self
            .leader_skipped_until
            .lock()
            .is_some_and(|until| Instant::now() < until)
        {
            return None;
        }
        let followed = self.followed.lock();
        let (url, peer) = followed.iter().min_by_key(|(_, p)| p.seniority())?;
        (peer.seniority() < own.seniority()).then(|| (url.clone(), peer.replica.clone()))
    }

    /// Counts an index bootstrap as running until the guard is dropped.
    pub fn bootstrap_started(&self) -> BootstrapRunning {
        self.bootstraps.fetch_add(1, Ordering::Relaxed);
        BootstrapRunning(self.bootstraps.clone())
    }

    /// Index bootstraps running now: this replica is not ready while one runs (it would
    /// route blind to what its peers know of the workers' caches).
    pub fn bootstrapping(&self) -> usize {
        self.bootstraps.load(Ordering::Relaxed)
    }

    /// Passes the leader over for `how_long`; true when it was not being
    /// passed over already (so one warning is logged per back-off, not per request).
    pub(crate) fn skip_leader(&self, how_long: Duration) -> bool {
        let now = Instant::now();
        let mut until = self.leader_skipped_until.lock();
        let fresh = until.is_none_or(|u| u <= now);
        *until = Some(now + how_long);
        fresh
    }

    /// A new choice to ask of the leader, settled when the returned [`Ask`] is.
    pub fn ask(&self) -> Ask<'_> {
        let mut choices = self.choices.lock();
        let id = choices.next;
        choices.next += 1;
        choices.asking.insert(id);
        Ask {
            hub: self,
            id,
            settled: false,
        }
    }

    fn settle<T>(&self, id: u64, book: impl FnOnce() -> T) -> T {
        let mut choices = self.choices.lock();
        let booked = book();
        let now = Instant::now();
        // Bounded even while nobody follows this replica (the publisher then prunes
        // nothing).
        choices.forget_settled(now, SETTLED_MAX_AGE);
        choices.asking.remove(&id);
        choices.settled.push_back((now, id));
        booked
    }

    /// The ids settled within `window` (older ones are dropped), the id below which
    /// every choice is settled, and `loads` read under the same lock as
    /// [`Ask::settle`] books.
    pub(crate) fn settled_with_loads<T>(
        &self,
        window: Duration,
        loads: impl FnOnce() -> T,
    ) -> (Vec<u64>, u64, T) {
        let mut choices = self.choices.lock();
        choices.forget_settled(Instant::now(), window);
        let ids = choices.settled.iter().map(|(_, id)| *id).collect();
        (ids, choices.settled_below(), loads())
    }
}

/// The machine's host name (a Kubernetes pod's name), for the default replica name.
fn host_name() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .map(|h| h.trim().to_owned())
                .filter(|h| !h.is_empty())
        })
        .unwrap_or_else(|| "kvgate".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hub(name: &str, incarnation: u64) -> PeerHub {
        let hub = PeerHub::default();
        hub.identity
            .set(Identity {
                replica: name.to_owned(),
                incarnation,
            })
            .unwrap();
        hub
    }

    fn follow(hub: &PeerHub, url: &str, name: &str, incarnation: u64) {
        let peer = Identity {
            replica: name.to_owned(),
            incarnation,
        };
        hub.followed.lock().insert(url.to_owned(), peer);
    }

    fn leader_name(hub: &PeerHub) -> Option<String> {
        hub.leader().map(|(_, name)| name)
    }

    /// Every id below the watermark is settled: it stops at the oldest choice still
    /// asked, and a choice dropped unbooked is given up (settled) too.
    #[test]
    fn choices_are_settled_below_the_oldest_one_still_asked() {
        let hub = hub("a", 1);
        let below = || hub.settled_with_loads(Duration::from_secs(1), || ());
        assert_eq!(below().1, 1);
        let (one, two, three) = (hub.ask(), hub.ask(), hub.ask());
        assert_eq!((one.id, two.id, three.id), (1, 2, 3));
        assert_eq!(below().1, 1);
        two.settle(|| ());
        assert_eq!(below(), (vec![2], 1, ()));
        drop(one); // the client went away while the leader chose
        assert_eq!(below(), (vec![2, 1], 3, ()));
        three.settle(|| ());
        assert_eq!(below(), (vec![2, 1, 3], 4, ()));
    }

    /// A rolling restart of a, b, c (each replaced by a younger run of the same name)
    /// moves leadership only when the leader is the one replaced.
    #[test]
    fn the_longest_running_replica_leads_through_a_rolling_restart() {
        // c started first, so it leads although its name is the largest.
        let a = hub("a", 20);
        follow(&a, "http://b", "b", 30);
        follow(&a, "http://c", "c", 10);
        assert_eq!(leader_name(&a), Some("c".to_owned()));
        let c = hub("c", 10);
        follow(&c, "http://a", "a", 20);
        follow(&c, "http://b", "b", 30);
        assert_eq!(leader_name(&c), None, "c leads itself");

        // b is replaced: a younger b changes nothing.
        follow(&a, "http://b", "b", 40);
        assert_eq!(leader_name(&a), Some("c".to_owned()));
        // c is replaced: a (now the longest running) leads, and keeps leading when
        // the new c comes back.
        a.followed.lock().remove("http://c");
        assert_eq!(leader_name(&a), None);
        follow(&a, "http://c", "c", 50);
        assert_eq!(leader_name(&a), None);
        let b = hub("b", 40);
        follow(&b, "http://a", "a", 20);
        follow(&b, "http://c", "c", 50);
        assert_eq!(leader_name(&b), Some("a".to_owned()));

        // Runs started at the same instant lead by name.
        let x = hub("x", 7);
        follow(&x, "http://w", "w", 7);
        assert_eq!(leader_name(&x), Some("w".to_owned()));
    }
}
