//! The prefix index as the gateway shares it: read by routing decisions, written by
//! event ingestion.
//!
//! Owns the locking policy: many readers at once ([`IndexLock::read`]), one writer at
//! a time ([`IndexLock::write`]), and a writer that lets waiting readers in between
//! slices of its work ([`IndexWriter::let_waiters_in`], called by `apply`), so a
//! lookup waits for at most a slice, never for an engine's whole batch. Writers queue
//! on their own mutex before they take the index's lock: at a handover the only
//! threads waiting for the index are readers, so two writers never pass the lock
//! back and forth slice by slice (without this mutex they did, and two writers' event
//! rate fell to half, docs/BENCHMARKS.md section 10). Must not know about events or
//! routing.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use kvgate_core::PrefixIndex;
use parking_lot::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::apply::IndexWriter;

/// The shared, per-model prefix index.
pub type SharedIndex = Arc<IndexLock>;

/// A prefix index behind a readers-writer lock whose writers take turns on a mutex of
/// their own (see the module comment).
#[derive(Debug)]
pub struct IndexLock {
    index: RwLock<PrefixIndex>,
    writers: Mutex<()>,
}

/// Write access to the index: the index's write lock, held after the writers' turn.
pub struct IndexWriteGuard<'a> {
    // Dropped in this order: readers get the index before the next writer its turn.
    index: RwLockWriteGuard<'a, PrefixIndex>,
    _turn: MutexGuard<'a, ()>,
}

impl IndexLock {
    pub fn new(index: PrefixIndex) -> Self {
        Self {
            index: RwLock::new(index),
            writers: Mutex::new(()),
        }
    }

    /// A shared [`IndexLock`] of `index`.
    pub fn shared(index: PrefixIndex) -> SharedIndex {
        Arc::new(Self::new(index))
    }

    pub fn into_inner(self) -> PrefixIndex {
        self.index.into_inner()
    }

    /// Read access, alongside other readers; waits while a writer holds a slice.
    pub fn read(&self) -> RwLockReadGuard<'_, PrefixIndex> {
        self.index.read()
    }

    /// Write access: this writer's turn, then the index's write lock.
    pub fn write(&self) -> IndexWriteGuard<'_> {
        let turn = self.writers.lock();
        IndexWriteGuard {
            index: self.index.write(),
            _turn: turn,
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

    /// Hands the index to waiting readers, if any, and takes it back after them
    /// (nothing when none waits). Other writers wait for their turn, not here.
    fn let_waiters_in(&mut self) {
        RwLockWriteGuard::bump(&mut self.index);
    }
}
