//! The world ranks share: its members, the state they meet in, and how a failure reaches every group split from it.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::Duration;

use super::rank::ThreadCommunicator;
use super::round::{Owned, Round};
use crate::{CommError, Result};

/// Options of a [`ThreadWorld`].
#[derive(Debug, Clone)]
pub struct ThreadWorldOptions {
    /// How long a rank waits for its peers in one operation before it fails with
    /// [`CommError::Timeout`] (and makes the others fail too).
    pub timeout: Duration,
}

impl Default for ThreadWorldOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(300),
        }
    }
}

/// A world of ranks that are threads of this process.
///
/// Collectives rendezvous in numbered rounds: each rank deposits a copy of its input, waits
/// until every rank has arrived, then computes its own output from the same contributions in
/// rank order, so every rank sees bit-identical reductions. A rank whose communicator is
/// dropped while panicking, or that times out, marks the world failed, and every rank waiting
/// or arriving later gets [`CommError::PeerFailed`] at once.
#[derive(Debug, Clone)]
pub struct ThreadWorld {
    shared: Arc<Shared>,
}

impl ThreadWorld {
    /// A world of `world_size` ranks; 0 is refused.
    pub fn new(world_size: usize, options: ThreadWorldOptions) -> Result<Self> {
        if world_size == 0 {
            return Err(CommError::InvalidArgument {
                rank: 0,
                op: "ThreadWorld::new",
                detail: "a world needs at least one rank, found 0".into(),
            });
        }
        Ok(Self {
            shared: Shared::new((0..world_size).collect(), options.timeout, None),
        })
    }

    /// The communicator of every rank, in rank order. Hand each to one thread.
    pub fn communicators(&self) -> Vec<ThreadCommunicator> {
        (0..self.shared.world)
            .map(|rank| ThreadCommunicator::new(rank, self.shared.clone()))
            .collect()
    }

    /// Runs `f` on `world_size` threads, one per rank, and returns each rank's result (an
    /// `Err` holds the panic payload of a rank that panicked). A world of 0 ranks runs
    /// nothing and returns no results.
    pub fn run<R, F>(
        world_size: usize,
        options: ThreadWorldOptions,
        f: F,
    ) -> Vec<std::thread::Result<R>>
    where
        R: Send,
        F: Fn(ThreadCommunicator) -> R + Sync,
    {
        let Ok(world) = ThreadWorld::new(world_size, options) else {
            return Vec::new();
        };
        let f = &f;
        std::thread::scope(|scope| {
            let handles: Vec<_> = world
                .communicators()
                .into_iter()
                .map(|comm| {
                    std::thread::Builder::new()
                        .name(format!("rank-{}", comm.rank))
                        .spawn_scoped(scope, move || f(comm))
                        .expect("failed to spawn a rank thread")
                })
                .collect();
            handles.into_iter().map(|h| h.join()).collect()
        })
    }
}

#[derive(Debug)]
pub(super) struct Shared {
    pub(super) world: usize,
    /// Each rank's rank in the root world (the one no `split` made), which errors name.
    pub(super) members: Vec<usize>,
    pub(super) timeout: Duration,
    pub(super) state: Mutex<State>,
    pub(super) cv: Condvar,
    /// The world this one was split from.
    pub(super) parent: Option<Arc<Shared>>,
    /// The groups split from this world.
    pub(super) children: Mutex<Vec<Weak<Shared>>>,
    /// In the root world: what each rank (by root rank) is busy with on its own between two
    /// collectives (see [`Communicator::begin_solo`]). Locked alone, never with `state`
    /// waiting on it.
    pub(super) solo: Mutex<Vec<Option<&'static str>>>,
}

impl Shared {
    pub(super) fn new(
        members: Vec<usize>,
        timeout: Duration,
        parent: Option<Arc<Shared>>,
    ) -> Arc<Self> {
        let world = members.len();
        let shared = Arc::new(Shared {
            world,
            members,
            timeout,
            state: Mutex::new(State {
                rounds: HashMap::new(),
                mailboxes: HashMap::new(),
                failure: None,
                exited: vec![false; world],
                groups: HashMap::new(),
            }),
            cv: Condvar::new(),
            parent,
            children: Mutex::new(Vec::new()),
            solo: Mutex::new(vec![None; world]),
        });
        if let Some(parent) = &shared.parent {
            parent
                .children
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(Arc::downgrade(&shared));
        }
        shared
    }

    /// Records that root rank `rank` failed for `reason` in this world, the worlds it was
    /// split from and every group split from any of them, and wakes every waiting rank.
    pub(super) fn fail_family(self: &Arc<Self>, rank: usize, reason: &str) {
        // Mark every world before waking anyone: a rank woken in one world must not leave
        // (and so fail a peer in another world for leaving) before that world is marked.
        let family = self.root().family();
        for world in &family {
            let mut state = lock(&world.state);
            if state.failure.is_none() {
                state.failure = Some((rank, reason.to_string()));
            }
        }
        for world in &family {
            world.cv.notify_all();
        }
    }

    /// The world no `split` made, that this one descends from.
    pub(super) fn root(self: &Arc<Self>) -> Arc<Self> {
        let mut root = self.clone();
        while let Some(parent) = root.parent.clone() {
            root = parent;
        }
        root
    }

    /// This world and every group split from it, at any depth.
    pub(super) fn family(self: Arc<Self>) -> Vec<Arc<Self>> {
        let mut out = vec![self];
        let mut at = 0;
        while at < out.len() {
            let children = out[at].children.lock().unwrap_or_else(|e| e.into_inner());
            let live: Vec<Arc<Self>> = children.iter().filter_map(Weak::upgrade).collect();
            drop(children);
            out.extend(live);
            at += 1;
        }
        out
    }

    /// The failure recorded in the root world, which every failure of the family reaches.
    pub(super) fn family_failure(self: &Arc<Self>) -> Option<(usize, String)> {
        lock(&self.root().state).failure.clone()
    }

    /// What the first of `ranks` (ranks of this world) that is busy on its own is doing.
    pub(super) fn solo_among(self: &Arc<Self>, ranks: &[usize]) -> Option<(usize, &'static str)> {
        let root = self.root();
        let solo = root.solo.lock().unwrap_or_else(|e| e.into_inner());
        ranks.iter().find_map(|&r| {
            let global = self.members[r];
            solo.get(global)
                .copied()
                .flatten()
                .map(|what| (global, what))
        })
    }
}

#[derive(Debug)]
pub(super) struct State {
    pub(super) rounds: HashMap<u64, Round>,
    pub(super) mailboxes: HashMap<(usize, usize, u16), VecDeque<Owned>>,
    pub(super) failure: Option<(usize, String)>,
    pub(super) exited: Vec<bool>,
    /// Worlds created by `split`, keyed by (split number, color), with how many of their
    /// members have not picked them up yet.
    pub(super) groups: HashMap<(u64, usize), (Arc<Shared>, usize)>,
}

impl State {
    /// The recorded failure of another rank, as the error of `op`, if any.
    pub(super) fn peer_failure(&self, op: &'static str) -> Option<CommError> {
        self.failure
            .as_ref()
            .map(|(rank, reason)| CommError::PeerFailed {
                rank: *rank,
                op,
                reason: reason.clone(),
            })
    }
}

pub(super) fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
