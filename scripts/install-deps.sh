#!/usr/bin/env bash
# Installs the system packages burn-deepspeed needs (OpenMPI, and libclang for the `mpi`
# crate's bindgen; Mesa's lavapipe software Vulkan, on which the CubeCL kernels' tests run
# the wgpu runtime; OpenBLAS for the `blas` feature). Idempotent: does nothing when they are present.
set -euo pipefail
need=()
command -v mpirun >/dev/null 2>&1 || need+=(openmpi-bin)
[ -e /usr/lib/x86_64-linux-gnu/openmpi/include/mpi.h ] || [ -e /usr/include/mpi.h ] \
    || dpkg -s libopenmpi-dev >/dev/null 2>&1 || need+=(libopenmpi-dev)
dpkg -s libclang-dev >/dev/null 2>&1 || need+=(libclang-dev)
command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
dpkg -s mesa-vulkan-drivers >/dev/null 2>&1 || need+=(mesa-vulkan-drivers)
dpkg -s libvulkan1 >/dev/null 2>&1 || need+=(libvulkan1)
# OpenBLAS, for the `blas` feature (the linear layers' products on the CPU).
dpkg -s libopenblas-dev >/dev/null 2>&1 || need+=(libopenblas-dev)
if [ ${#need[@]} -eq 0 ]; then
    exit 0
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
echo "installing: ${need[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}"
