//! Agreement on the outcome of a rank-local phase, so that a rank that fails between two
//! collectives tells its peers instead of leaving them blocked in the next one.

use super::{Buf, BufMut, Communicator};
use crate::{CommError, Result};

/// The longest failure message that travels to the peers (longer ones are cut).
const MAX_REASON: usize = 1024;

/// Checks that every rank holds the same `digest` of something that must not differ between
/// ranks (the resolved config, the model's layout, the checkpoint metadata it read): one
/// all-gather of the digests. Every rank gets the same verdict: `Ok(())`, or
/// [`CommError::Mismatch`] naming `what` and the first rank whose digest differs from rank 0's.
pub fn agree_on_digest(comm: &dyn Communicator, what: &'static str, digest: &[u8]) -> Result<()> {
    let world = comm.world_size();
    if world == 1 {
        return Ok(());
    }
    // Digests of any length compare as 32 bytes (longer ones are cut, shorter ones padded).
    let mut mine = [0u8; 32];
    let n = digest.len().min(32);
    mine[..n].copy_from_slice(&digest[..n]);
    let mut all = vec![0u8; 32 * world];
    comm.all_gather_buf(Buf::U8(&mine), BufMut::U8(&mut all), &vec![32; world])?;
    let first = &all[..32];
    match (1..world).find(|&r| &all[32 * r..32 * (r + 1)] != first) {
        None => Ok(()),
        Some(r) => Err(CommError::Mismatch {
            rank: comm.rank(),
            op: what,
            detail: format!(
                "rank {r}'s {what} differs from rank 0's: every rank must run with the same one"
            ),
        }),
    }
}

/// Agrees on the outcome of a rank-local phase (reading a file, checking an argument, a step
/// whose precondition failed): every rank passes `None` when its part succeeded or
/// `Some(reason)` when it failed, and every rank gets the same verdict. A collective: every
/// rank calls it, failed or not, before the next collective.
///
/// Costs one all-gather of 4 bytes per rank when every rank succeeded, and one more of the
/// failure messages otherwise. Returns `Ok(())` when every rank succeeded, and otherwise
/// [`CommError::PeerFailed`] naming the lowest failed rank other than this one (this rank when
/// it is the only one) and its reason.
pub fn agree(comm: &dyn Communicator, phase: &'static str, failure: Option<&str>) -> Result<()> {
    let world = comm.world_size();
    let me = comm.rank();
    let reason: &[u8] = failure.map_or(&[], |r| &r.as_bytes()[..r.len().min(MAX_REASON)]);
    if world == 1 {
        return match failure {
            None => Ok(()),
            Some(_) => Err(peer_failed(me, phase, reason)),
        };
    }
    // Each rank's message length plus one, or 0 when it succeeded.
    let mine = match failure {
        None => 0u32,
        Some(_) => reason.len() as u32 + 1,
    };
    let mut codes = vec![0u8; 4 * world];
    comm.all_gather_buf(
        Buf::U8(&mine.to_le_bytes()),
        BufMut::U8(&mut codes),
        &vec![4; world],
    )?;
    let codes: Vec<u32> = codes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    if codes.iter().all(|&c| c == 0) {
        return Ok(());
    }
    let counts: Vec<usize> = codes
        .iter()
        .map(|&c| c.saturating_sub(1) as usize)
        .collect();
    let mut reasons = vec![0u8; counts.iter().sum()];
    comm.all_gather_buf(Buf::U8(reason), BufMut::U8(&mut reasons), &counts)?;
    let failed = (0..world).filter(|&r| codes[r] != 0);
    let blamed = failed
        .clone()
        .find(|&r| r != me)
        .or_else(|| failed.clone().next())
        .unwrap_or(me);
    let start: usize = counts[..blamed].iter().sum();
    Err(peer_failed(
        blamed,
        phase,
        &reasons[start..start + counts[blamed]],
    ))
}

fn peer_failed(rank: usize, phase: &'static str, reason: &[u8]) -> CommError {
    CommError::PeerFailed {
        rank,
        op: phase,
        reason: String::from_utf8_lossy(reason).into_owned(),
    }
}

/// The sum over ranks of each of `values`, in f64 (one all-gather of 8 bytes per value and
/// rank, summed in rank order, so that every rank gets the same bits). For scalars such as a
/// squared norm, which an f32 all-reduce would round or overflow.
pub fn sum_f64(comm: &dyn Communicator, values: &[f64]) -> Result<Vec<f64>> {
    let world = comm.world_size();
    if world == 1 {
        return Ok(values.to_vec());
    }
    let mine: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut all = vec![0u8; mine.len() * world];
    comm.all_gather_buf(
        Buf::U8(&mine),
        BufMut::U8(&mut all),
        &vec![mine.len(); world],
    )?;
    let mut sums = vec![0.0f64; values.len()];
    for rank in all.chunks_exact(mine.len().max(1)).take(world) {
        for (s, v) in sums.iter_mut().zip(rank.chunks_exact(8)) {
            *s += f64::from_le_bytes(v.try_into().expect("8 bytes"));
        }
    }
    Ok(sums)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::{ThreadWorld, ThreadWorldOptions};

    #[test]
    fn every_rank_learns_who_failed_and_why() {
        for world in 1..=4 {
            let out = ThreadWorld::run(world, ThreadWorldOptions::default(), |c| {
                let failure = (c.rank() == world - 1).then_some("disk full");
                agree(&c, "save", failure)
            });
            for (rank, r) in out.into_iter().enumerate() {
                match r.unwrap() {
                    Err(CommError::PeerFailed {
                        rank: r,
                        op,
                        reason,
                    }) => {
                        assert_eq!((r, op, reason.as_str()), (world - 1, "save", "disk full"));
                    }
                    other => panic!("rank {rank} of {world}: {other:?}"),
                }
            }
        }
    }

    #[test]
    fn agreement_passes_when_every_rank_succeeded() {
        let out = ThreadWorld::run(3, ThreadWorldOptions::default(), |c| {
            agree(&c, "load", None)
        });
        assert!(out.into_iter().all(|r| r.unwrap().is_ok()));
    }

    #[test]
    fn a_failed_rank_hears_of_the_other_failed_rank() {
        let out = ThreadWorld::run(3, ThreadWorldOptions::default(), |c| {
            let reason = format!("rank {} broke", c.rank());
            agree(&c, "load", (c.rank() != 1).then_some(reason.as_str()))
        });
        let blamed: Vec<usize> = out
            .into_iter()
            .map(|r| match r.unwrap() {
                Err(CommError::PeerFailed { rank, .. }) => rank,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(blamed, vec![2, 0, 0]);
    }

    #[test]
    fn f64_sums_keep_what_f32_would_lose() {
        let out = ThreadWorld::run(2, ThreadWorldOptions::default(), |c| {
            sum_f64(&c, &[1e300, 1.0 + 1e-12 * c.rank() as f64]).unwrap()
        });
        for r in out {
            let s = r.unwrap();
            assert_eq!(s[0], 2e300);
            assert_eq!(s[1], 2.0 + 1e-12);
        }
    }

    #[test]
    fn digests_agree_or_name_the_first_rank_that_differs() {
        let out = ThreadWorld::run(3, ThreadWorldOptions::default(), |c| {
            agree_on_digest(&c, "config", b"same")
        });
        assert!(out.into_iter().all(|r| r.unwrap().is_ok()));
        let out = ThreadWorld::run(4, ThreadWorldOptions::default(), |c| {
            let digest: &[u8] = if c.rank() >= 2 { b"other" } else { b"same" };
            agree_on_digest(&c, "config", digest)
        });
        for r in out {
            let e = r.unwrap().unwrap_err().to_string();
            assert!(e.contains("rank 2's config differs from rank 0's"), "{e}");
        }
    }
}
