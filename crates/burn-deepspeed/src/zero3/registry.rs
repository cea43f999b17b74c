//! The process-wide registry through which the gather op finds a rank's [`GatherGroup`]: a
//! sharded parameter stores only a key (its group and tensor), which resolves here.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, Weak};

use super::group::*;

pub(super) enum Entry {
    Live(Weak<GatherGroup>),
    /// The parameters were gathered back whole ([`GatherGroup::release`]): the op passes the
    /// stored value through.
    Whole,
    /// Keys handed out by [`prepared_id`] for a model sharded ahead of its ranks (the Learner
    /// strategy); each rank's thread answers them through [`GatherGroup::answer_on_this_thread`].
    Prepared,
}

thread_local! {
    /// Prepared ids this thread resolves to one of its own groups.
    pub(super) static ALIASES: RefCell<HashMap<u64, Weak<GatherGroup>>> = RefCell::new(HashMap::new());
}

pub(super) static NEXT_ID: AtomicU64 = AtomicU64::new(1);

pub(super) fn registry() -> MutexGuard<'static, HashMap<u64, Entry>> {
    static REGISTRY: LazyLock<Mutex<HashMap<u64, Entry>>> =
        LazyLock::new(|| Mutex::new(HashMap::new()));
    REGISTRY.lock().unwrap_or_else(|e| e.into_inner())
}

/// The key of tensor `tensor` of group `group`, as stored in [`ShardGather`](super::ShardGather).
pub fn key_of(group: u64, tensor: usize) -> u64 {
    (group << 32) | tensor as u64
}

/// What a key resolves to.
pub enum Resolved {
    /// A live group and the tensor's index in it.
    Group(Arc<GatherGroup>, usize),
    /// The group's parameters are whole again.
    Whole,
}

/// Finds the group of `key`.
///
/// # Panics
/// When the engine that sharded the parameter is gone: a sharded parameter cannot be used
/// without its group.
pub fn resolve(key: u64) -> Resolved {
    let group = key >> 32;
    let tensor = (key & 0xffff_ffff) as usize;
    let aliased = ALIASES.with(|a| a.borrow().get(&group).and_then(Weak::upgrade));
    if let Some(g) = aliased {
        return Resolved::Group(g, tensor);
    }
    match registry().get(&group) {
        Some(Entry::Whole) => Resolved::Whole,
        Some(Entry::Live(weak)) => match weak.upgrade() {
            Some(g) => Resolved::Group(g, tensor),
            None => panic!("ZeRO-3: the gather group {group} of a sharded parameter is gone"),
        },
        Some(Entry::Prepared) => panic!(
            "ZeRO-3: this model was prepared by DeepSpeedStrategy::prepare_model (group \
             {group}); it runs only inside the SupervisedTraining that uses that strategy, \
             which returns it whole"
        ),
        None => panic!(
            "ZeRO-3: the engine that sharded this parameter (group {group}) was dropped; \
             take the whole model with DeepSpeedEngine::into_model before dropping it"
        ),
    }
}

/// A new id for a model sharded before its ranks exist: its keys resolve, on each rank's
/// thread, to the group that rank registers with [`GatherGroup::answer_on_this_thread`].
pub fn prepared_id() -> u64 {
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    registry().insert(id, Entry::Prepared);
    id
}
