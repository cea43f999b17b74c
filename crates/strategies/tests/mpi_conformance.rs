//! The communicator conformance suite over MPI. MPI initializes once per process, so this is a
//! harness-less binary: `cargo test --features mpi` runs it as a world of one, and `.ci/run`
//! runs it under `mpirun -n 2` and `-n 3`.

use burn_deepspeed_strategies::comm::{Communicator, MpiCommunicator, conformance};

fn main() {
    let comm = match MpiCommunicator::init() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("cannot start MPI: {e}");
            std::process::exit(2);
        }
    };
    match conformance::check_all(&comm) {
        Ok(n) => {
            if comm.rank() == 0 {
                println!(
                    "mpi conformance: world {}: {n} passed, 0 failed",
                    comm.world_size()
                );
            }
        }
        Err(e) => {
            eprintln!("rank {}: {e}", comm.rank());
            println!("mpi conformance: 0 passed, 1 failed");
            std::process::exit(1);
        }
    }
}
