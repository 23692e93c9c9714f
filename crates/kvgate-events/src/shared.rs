//! The prefix index as the gateway shares it: read by routing decisions, written by
//! event ingestion.
//!
//! Owns the locking policy: many readers at once ([`IndexLock::read`]), one writer at
//! a time ([`IndexLock::write`]), and a writer that lets waiting readers in between
//! slices of its work ([`IndexWriter::let_waiters_in`], called by `apply`) and before
//! it starts, so a lookup waits for at most a slice, never for an engine's whole
//! batch. Must not know about events or routing.
//!
//! A reader that finds the index write-locked says so (`waiting_readers`) before it
//! blocks, and the writer, at its next slice boundary or its next batch, lets go of the
//! lock and waits until every such reader has it. The lock's own handover to parked
//! threads was not enough: with writers saturated, lookups waited through 4-40 slices
//! and batches (p99 0.4-1.0 ms, docs/BENCHMARKS.md section 10), because a reader is
//! only handed the lock once it is parked, and the writer took the lock back first.
//!
//! Writers queue on their own mutex before they take the index's lock: at a handover
//! the only threads waiting for the index are readers, so two writers never pass the
//! lock back and forth slice by slice (without this mutex they did, and two writers'
//! event rate fell to half, docs/BENCHMARKS.md section 10).

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvgate_core::{PrefixIndex, WorkerRef};
use parking_lot::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::apply::IndexWriter;

/// The shared, per-model prefix index.
pub type SharedIndex = Arc<IndexLock>;

/// The longest a writer waits for readers to take the index before it goes on (a
/// reader that has not run for this long is descheduled, not waiting for the lock).
const READERS_GRACE: Duration = Duration::from_millis(1);

/// A prefix index behind a readers-writer lock whose writers take turns on a mutex of
/// their own and let waiting readers in (see the module comment).
#[derive(Debug)]
pub struct IndexLock {
    index: RwLock<PrefixIndex>,
    writers: Mutex<()>,
    /// Readers that found the index write-locked and do not have it yet.
    waiting_readers: AtomicUsize,
    /// Reads so far that found a writer in and waited for it ([`IndexLock::read_waits`]).
    read_waits: AtomicU64,
}

/// Write access to the index: the index's write lock, held after the writers' turn.
pub struct IndexWriteGuard<'a> {
    // Dropped in this order: readers get the index before the next writer its turn.
    index: RwLockWriteGuard<'a, PrefixIndex>,
    _turn: MutexGuard<'a, ()>,
    lock: &'a IndexLock,
}

impl IndexLock {
    pub fn new(index: PrefixIndex) -> Self {
        Self {
            index: RwLock::new(index),
            writers: Mutex::new(()),
            waiting_readers: AtomicUsize::new(0),
            read_waits: AtomicU64::new(0),
        }
    }

    /// A shared [`IndexLock`] of `index`.
    pub fn shared(index: PrefixIndex) -> SharedIndex {
        Arc::new(Self::new(index))
    }

    pub fn into_inner(self) -> PrefixIndex {
        self.index.into_inner()
    }

    /// Read access, alongside other readers; a reader that finds a writer in waits for
    /// the end of its slice.
    pub fn read(&self) -> RwLockReadGuard<'_, PrefixIndex> {
        if let Some(guard) = self.index.try_read() {
            return guard;
        }
        self.read_waits.fetch_add(1, Ordering::Relaxed);
        self.waiting_readers.fetch_add(1, Ordering::SeqCst);
        let guard = self.index.read();
        self.waiting_readers.fetch_sub(1, Ordering::SeqCst);
        guard
    }

    /// How many reads so far found a writer in and waited for it (the rest took the
    /// index at once): how often event ingestion delays routing.
    pub fn read_waits(&self) -> u64 {
        self.read_waits.load(Ordering::Relaxed)
    }

    /// Write access: this writer's turn, then the index's write lock once the readers
    /// waiting for it have had it.
    pub fn write(&self) -> IndexWriteGuard<'_> {
        let turn = self.writers.lock();
        self.wait_for_readers();
        IndexWriteGuard {
            index: self.index.write(),
            _turn: turn,
            lock: self,
        }
    }

    /// Waits, not holding the index, until the readers waiting for it have it (for at
    /// most [`READERS_GRACE`]); yields the CPU meanwhile, which a reader may need.
    fn wait_for_readers(&self) {
        let start = Instant::now();
        while self.waiting_readers.load(Ordering::SeqCst) > 0 && start.elapsed() < READERS_GRACE {
            std::thread::yield_now();
        }
    }
}

impl Deref for IndexWriteGuard<'_> {
    type Target = PrefixIndex;

    fn deref(&self) -> &PrefixIndex {
        &self.index
    }
}

impl DerefMut for IndexWriteGuard<'_> {
    fn deref_mut(&mut self) -> &mut PrefixIndex {
        &mut self.index
    }
}

impl IndexWriter for IndexWriteGuard<'_> {
    fn index(&mut self) -> &mut PrefixIndex {
        &mut self.index
    }

    /// Lets go of the index while the readers waiting for it take it, and takes it
    /// back after them (nothing when none waits). Other writers wait for their turn,
    /// not here.
    fn let_waiters_in(&mut self) {
        if self.lock.waiting_readers.load(Ordering::SeqCst) > 0 {
            let lock = self.lock;
            RwLockWriteGuard::unlocked_fair(&mut self.index, || lock.wait_for_readers());
        }
    }

    /// Lets go of the write lock while the rank's grown engine-hash map is built under
    /// a read lock (lookups go on meanwhile; other writers wait for their turn, so the
    /// map cannot change), then takes it back and swaps the map in.
    fn make_room(&mut self, at: WorkerRef, blocks: usize) {
        if !self.index.needs_room(at, blocks) {
            return;
        }
        let lock = RwLockWriteGuard::rwlock(&self.index);
        let grown =
            RwLockWriteGuard::unlocked(&mut self.index, || lock.read().grow_ahead(at, blocks));
        if let Some(grown) = grown {
            self.index.install_grown(grown);
        }
    }
}
