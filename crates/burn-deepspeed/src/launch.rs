//! Starting ranks: threads in this process, or one MPI process per rank under `mpirun`.

use std::sync::Arc;
use std::time::Duration;

use burn_deepspeed_strategies::comm::{
    Communicator, FlightOptions, FlightRecorder, ThreadWorld, ThreadWorldOptions,
};

use crate::{DeepSpeedError, Result};

/// How the ranks of a run were started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LaunchKind {
    /// Threads of this process.
    Threads,
    /// This process is one rank of an MPI job.
    Mpi,
}

/// The variable `burn-deepspeed launch --ranks N` sets for the program it starts: [`launch`]
/// then runs N thread ranks, whatever count the program passes it.
pub const RANKS_ENV: &str = "BURN_DEEPSPEED_RANKS";

/// The number of thread ranks [`launch`] starts for a program that asks for `threads`:
/// `BURN_DEEPSPEED_RANKS` when the launcher set it, else `threads`. A value that is not a
/// positive count is an error naming the variable.
pub fn thread_ranks(threads: usize) -> Result<usize> {
    let Ok(value) = std::env::var(RANKS_ENV) else {
        return Ok(threads);
    };
    match value.trim().parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(DeepSpeedError::Data(format!(
            "{RANKS_ENV}={value:?} is not a number of ranks; set it to a positive count or \
             unset it"
        ))),
    }
}

/// The optional features this build of the library has, of `mpi`, `wgpu` and `cuda`.
pub fn built_features() -> Vec<&'static str> {
    [
        ("mpi", cfg!(feature = "mpi")),
        ("wgpu", cfg!(feature = "wgpu")),
        ("cuda", cfg!(feature = "cuda")),
    ]
    .into_iter()
    .filter_map(|(name, on)| on.then_some(name))
    .collect()
}

/// True when this process was started by `mpirun`/`mpiexec`.
pub fn launched_by_mpirun() -> bool {
    std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() || std::env::var_os("PMI_SIZE").is_some()
}

/// This process's rank in the job `mpirun` started, when it is one of its processes.
pub fn mpirun_rank() -> Option<usize> {
    ["OMPI_COMM_WORLD_RANK", "PMI_RANK"]
        .iter()
        .find_map(|k| std::env::var(k).ok()?.parse().ok())
}

/// The number of processes `mpirun` started, when this process is one of them.
pub fn mpirun_world_size() -> Option<usize> {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"]
        .iter()
        .find_map(|k| std::env::var(k).ok()?.parse().ok())
}

/// The number of processes `mpirun` started on this process's node, when it is one of them
/// (OpenMPI's `OMPI_COMM_WORLD_LOCAL_SIZE`, MPICH's `MPI_LOCALNRANKS`).
pub fn mpirun_local_size() -> Option<usize> {
    ["OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"]
        .iter()
        .find_map(|k| std::env::var(k).ok()?.parse().ok())
}

/// Runs `f` on every rank of this process and returns their results in rank order.
///
/// Under `mpirun` (and with the `mpi` feature) this process is one rank: `f` runs once with
/// the MPI communicator and `threads` is ignored. Otherwise `threads` ranks run as threads
/// (or as many as `BURN_DEEPSPEED_RANKS` says, see [`thread_ranks`]).
/// A rank that panics or fails makes the call return an error naming it. A rank whose `f`
/// returns an error first [aborts](Communicator::abort) the world with it, so that its peers
/// fail at once instead of waiting for it in their next collective (under `mpirun` the job
/// ends with the rank and the reason on stderr).
///
/// When the program has installed no global `tracing` subscriber, each rank runs under the
/// library's default one ([`log::default_dispatch`](crate::log::default_dispatch)): the step
/// lines and warnings then reach stderr.
///
/// ```
/// use std::time::Duration;
/// use burn_deepspeed::comm::{CommunicatorExt, ReduceOp};
/// use burn_deepspeed::launch::launch;
///
/// let (_, sums) = launch(3, Duration::from_secs(10), |comm| {
///     let mut x = [comm.rank() as f32];
///     comm.all_reduce(&mut x, ReduceOp::Sum)?; // 0 + 1 + 2 on every rank
///     Ok(x[0])
/// })?;
/// assert_eq!(sums, [3.0; 3]);
/// # Ok::<(), burn_deepspeed::DeepSpeedError>(())
/// ```
pub fn launch<R, F>(threads: usize, timeout: Duration, f: F) -> Result<(LaunchKind, Vec<R>)>
where
    R: Send,
    F: Fn(Arc<dyn Communicator>) -> Result<R> + Sync,
{
    if launched_by_mpirun() {
        let comm = mpi_world()?;
        let dispatch = crate::log::default_dispatch();
        return crate::log::with_dispatch(dispatch.as_ref(), || failing_aborts(comm, f))
            .map(|r| (LaunchKind::Mpi, vec![r]));
    }
    let threads = thread_ranks(threads)?;
    let f = &f;
    let ranks = (0..threads).map(|_| move |comm| failing_aborts(comm, f));
    let no_leader: Option<fn(Arc<dyn Communicator>)> = None;
    let (_, results) = run_ranks(threads, timeout, no_leader, ranks)?;
    let mut out = Vec::with_capacity(threads);
    let mut first_error = None;
    for (rank, r) in results.into_iter().enumerate() {
        match r.map_err(|panic| panicked(rank, panic)).and_then(|r| r) {
            Ok(v) => out.push(v),
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok((LaunchKind::Threads, out)),
    }
}

/// Runs `leader` as rank 0 on the calling thread (it may hold state that cannot move to
/// another thread, such as an event processor) and, on every other rank, a closure that
/// `follower` makes for it on the calling thread. Under `mpirun` this process is one rank and
/// runs the one its rank calls for, and returns its result. In the thread world it returns
/// rank 0's result; a failed follower is an error naming its rank.
pub fn launch_with_leader<R, L, G>(
    threads: usize,
    timeout: Duration,
    leader: L,
    mut follower: impl FnMut() -> G,
) -> Result<(LaunchKind, R)>
where
    R: Send,
    L: FnOnce(Arc<dyn Communicator>) -> Result<R>,
    G: FnOnce(Arc<dyn Communicator>) -> Result<R> + Send,
{
    if launched_by_mpirun() {
        let comm = mpi_world()?;
        let r = if comm.rank() == 0 {
            failing_aborts(comm, leader)?
        } else {
            failing_aborts(comm, follower())?
        };
        return Ok((LaunchKind::Mpi, r));
    }
    let followers = (1..threads).map(|_| {
        let run = follower();
        move |comm| failing_aborts(comm, run)
    });
    let leader = move |comm| failing_aborts(comm, leader);
    let (first, rest) = run_ranks(threads, timeout, Some(leader), followers)?;
    for (i, r) in rest.into_iter().enumerate() {
        r.map_err(|panic| panicked(i + 1, panic))?
            .map_err(|e| DeepSpeedError::Data(format!("rank {}: {e}", i + 1)))?;
    }
    let first = first.ok_or_else(|| DeepSpeedError::Data("rank 0 did not run".into()))?;
    first.map(|r| (LaunchKind::Threads, r))
}

/// The thread world. With a `leader`, it runs as rank 0 on the calling thread and the
/// `followers` as ranks 1, 2, ...; without one, the `followers` are every rank. Each follower
/// runs on a thread of its own, named after its rank. Returns the leader's result and the
/// followers' (a panic as its payload).
fn run_ranks<R0, R, L, G>(
    threads: usize,
    timeout: Duration,
    leader: Option<L>,
    followers: impl IntoIterator<Item = G>,
) -> Result<(Option<R0>, Vec<std::thread::Result<R>>)>
where
    R: Send,
    L: FnOnce(Arc<dyn Communicator>) -> R0,
    G: FnOnce(Arc<dyn Communicator>) -> R + Send,
{
    if threads == 0 {
        return Err(DeepSpeedError::Data(
            "the number of ranks must be at least 1".into(),
        ));
    }
    let world = ThreadWorld::new(threads, ThreadWorldOptions { timeout })?;
    // A leader may hold state that cannot move to a pool's thread: with one, every rank keeps
    // the global pool.
    let pool_threads = match leader {
        Some(_) => None,
        None => rank_pool_threads(threads)?,
    };
    // The library's log subscriber on every thread of a rank, when the program has none.
    let dispatch = crate::log::default_dispatch();
    let dispatch = dispatch.as_ref();
    // Every rank behind the flight recorder (see `comm::FlightRecorder`).
    let comms = (world.communicators().into_iter())
        .map(|c| Arc::new(c) as Arc<dyn Communicator>)
        .collect();
    let mut comms = FlightRecorder::world(comms, &FlightOptions::from_env()?).into_iter();
    let leader = leader.map(|l| (l, comms.next().expect("a world has rank 0")));
    let first_follower = usize::from(leader.is_some());
    Ok(std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .zip(followers)
            .enumerate()
            .map(|(i, (comm, run))| {
                std::thread::Builder::new()
                    .name(format!("rank-{}", i + first_follower))
                    .spawn_scoped(scope, move || {
                        crate::log::with_dispatch(dispatch, || {
                            let rank = i + first_follower;
                            in_rank_pool(pool_threads, rank, dispatch, || run(comm))
                        })
                    })
                    .expect("failed to spawn a rank thread")
            })
            .collect();
        let first = leader.map(|(run, comm)| crate::log::with_dispatch(dispatch, || run(comm)));
        (first, handles.into_iter().map(|h| h.join()).collect())
    }))
}

/// The environment variable that sizes each thread rank's compute pool.
pub const RANK_THREADS_VAR: &str = "BURN_DEEPSPEED_RANK_THREADS";

/// Threads of each thread rank's own rayon pool (Flex's kernels and ours run on the pool of the
/// thread that calls them) for a world of `ranks` threads: `BURN_DEEPSPEED_RANK_THREADS` when
/// set (`0`: every rank shares the process's global pool), otherwise the machine's cores
/// divided among the ranks (at least 1 each), so that ranks do not fight over cores. `None`:
/// the shared global pool.
pub fn rank_pool_threads(ranks: usize) -> Result<Option<usize>> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    pool_threads(
        std::env::var(RANK_THREADS_VAR).ok().as_deref(),
        ranks,
        cores,
    )
}

/// [`rank_pool_threads`] for the variable's value `set`, `ranks` ranks and `cores` cores.
fn pool_threads(set: Option<&str>, ranks: usize, cores: usize) -> Result<Option<usize>> {
    match set.map(|v| (v, v.trim().parse::<usize>())) {
        Some((_, Ok(0))) => Ok(None),
        Some((_, Ok(n))) => Ok(Some(n)),
        Some((v, Err(_))) => Err(DeepSpeedError::InvalidValue {
            path: RANK_THREADS_VAR.into(),
            message: format!("`{v}` is not a number of threads (0 shares one pool)"),
        }),
        None => Ok(Some((cores / ranks.max(1)).max(1))),
    }
}

/// Runs rank `rank`'s `f` on a rayon pool of its own of `threads` threads, which Flex's and our
/// kernels then use (`None`: on the calling thread with the global pool, also when the pool
/// cannot be built). The pool's threads are named after the rank, as its thread is, so that
/// traces and debuggers show the rank's work under its name; they log through `dispatch`
/// (the rank thread's), whichever of them runs the rank's step.
fn in_rank_pool<R: Send>(
    threads: Option<usize>,
    rank: usize,
    dispatch: Option<&tracing::Dispatch>,
    f: impl FnOnce() -> R + Send,
) -> R {
    let dispatch = dispatch.cloned();
    let pool = threads.and_then(|n| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .thread_name(move |_| format!("rank-{rank}"))
            .start_handler(move |_| {
                if let Some(d) = &dispatch {
                    // For the pool thread's whole life: the guard is never dropped.
                    std::mem::forget(tracing::dispatcher::set_default(d));
                }
            })
            .build()
            .ok()
    });
    match pool {
        Some(pool) => pool.install(f),
        None => f(),
    }
}

/// Runs one rank; when it fails, aborts its world with the error before returning it.
fn failing_aborts<R>(
    comm: Arc<dyn Communicator>,
    run: impl FnOnce(Arc<dyn Communicator>) -> Result<R>,
) -> Result<R> {
    let handle = comm.clone();
    let result = run(comm);
    if let Err(e) = &result {
        handle.abort(&e.to_string());
    }
    result
}

/// A rank's panic as an error naming it.
fn panicked(rank: usize, panic: Box<dyn std::any::Any + Send>) -> DeepSpeedError {
    let msg = panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into());
    DeepSpeedError::Data(format!("rank {rank} panicked: {msg}"))
}

/// This process's communicator in the MPI world (initializes MPI; once per process).
#[cfg(feature = "mpi")]
pub(crate) fn mpi_world() -> Result<Arc<dyn Communicator>> {
    let comm: Arc<dyn Communicator> =
        Arc::new(burn_deepspeed_strategies::comm::MpiCommunicator::init()?);
    let options = FlightOptions::from_env()?;
    let mut recorded = FlightRecorder::world(vec![comm], &options);
    Ok(recorded.remove(0))
}

/// Without the `mpi` feature a run under `mpirun` is refused.
#[cfg(not(feature = "mpi"))]
pub(crate) fn mpi_world() -> Result<Arc<dyn Communicator>> {
    Err(DeepSpeedError::Unsupported {
        key: "mpirun".into(),
        reason: "this binary was built without the `mpi` feature; rebuild with \
                 `--features mpi`"
            .into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_rank_gets_its_share_of_the_cores_unless_told() {
        assert_eq!(pool_threads(None, 2, 2).unwrap(), Some(1));
        assert_eq!(pool_threads(None, 2, 16).unwrap(), Some(8));
        assert_eq!(pool_threads(None, 4, 2).unwrap(), Some(1));
        assert_eq!(pool_threads(Some("0"), 2, 16).unwrap(), None);
        assert_eq!(pool_threads(Some(" 3 "), 2, 16).unwrap(), Some(3));
        let e = pool_threads(Some("many"), 2, 2).unwrap_err().to_string();
        assert!(e.contains(RANK_THREADS_VAR) && e.contains("`many`"), "{e}");
    }

    /// Thread ranks run on pools of their own (of the size the environment gives), so that a
    /// rank's ops use its own threads; with a leader every rank keeps the global pool.
    #[test]
    fn thread_ranks_compute_on_their_own_pools() {
        let want = rank_pool_threads(3).unwrap();
        let (_, sizes) = launch(3, Duration::from_secs(60), |_| {
            Ok((
                rayon::current_num_threads(),
                rayon::current_thread_index().is_some(),
            ))
        })
        .unwrap();
        for (threads, on_pool) in sizes {
            match want {
                Some(n) => assert!(on_pool && threads == n, "{threads} threads, want {n}"),
                None => assert!(!on_pool),
            }
        }
        let (_, leader_on_pool) = launch_with_leader(
            2,
            Duration::from_secs(60),
            |_| Ok(rayon::current_thread_index().is_some()),
            || |_| Ok(rayon::current_thread_index().is_some()),
        )
        .unwrap();
        assert!(!leader_on_pool);
    }
}
