#!/usr/bin/env bash
# cubecl-cuda (our `cuda` feature) builds PTX through LLVM, and its build script downloads a
# prebuilt LLVM 23 from GitHub unless one is already installed. This installs Debian's LLVM 22
# and presents it where the build script looks ($XDG_DATA_HOME/tracel/tracel-llvm-23.1.0-4),
# so that the feature builds with no network access. Every symbol cubecl uses exists in LLVM 22.
# Usage: XDG_DATA_HOME=DIR bash scripts/offline-llvm.sh && XDG_DATA_HOME=DIR cargo build --features cuda
set -euo pipefail
: "${XDG_DATA_HOME:?set XDG_DATA_HOME, and pass the same value to cargo}"
need=()
for p in llvm-22-dev libpolly-22-dev libzstd-dev; do
    dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
    sudo=""
    if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
    echo "installing: ${need[*]}"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}"
fi
bundle="$XDG_DATA_HOME/tracel/tracel-llvm-23.1.0-4"
mkdir -p "$bundle/bin"
# Debian's llvm-config names libz3 by its full path, which the build script cannot link by;
# the wrapper turns it into -lz3. Files that exist with the same content are left alone: a new
# timestamp would make cubecl's build script, and every crate above it, build again.
wrapper=$(mktemp)
cat > "$wrapper" <<'WRAP'
#!/bin/sh
/usr/lib/llvm-22/bin/llvm-config "$@" | sed 's#/usr/lib/x86_64-linux-gnu/libz3.so#-lz3#g'
WRAP
chmod +x "$wrapper"
if cmp -s "$wrapper" "$bundle/bin/llvm-config"; then
    rm "$wrapper"
else
    mv "$wrapper" "$bundle/bin/llvm-config"
fi
[ -e "$bundle/.tracel-llvm-installed" ] || touch "$bundle/.tracel-llvm-installed"
echo "LLVM $("$bundle/bin/llvm-config" --version) presented at $bundle"
