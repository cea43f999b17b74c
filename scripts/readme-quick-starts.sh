#!/usr/bin/env bash
# README.md's quick starts, as a user would use them: copies the `ds_config.json` and the two
# Rust snippets marked `<!-- quick-start: NAME -->` out of the README, verbatim, into a fresh
# crate outside this repository that depends on burn-deepspeed by path, builds it, runs it, and
# checks that both trained (the loss fell). The crate shares this workspace's lock file,
# profiles and features, and builds in the test profile, so that it reuses the test build's
# artifacts.
#
#   bash scripts/readme-quick-starts.sh
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
target="${CARGO_TARGET_DIR:-$repo/target}"
case "$target" in /*) ;; *) target="$repo/$target" ;; esac
crate=$(mktemp -d)
trap 'rm -rf "$crate"' EXIT
mkdir -p "$crate/src"

python3 - "$repo" "$crate" <<'PY'
import re, sys
from pathlib import Path
repo, crate = Path(sys.argv[1]), Path(sys.argv[2])
readme = (repo / "README.md").read_text()
blocks = dict(re.findall(r"<!-- quick-start: (\S+) -->\n```\w+\n(.*?)```\n", readme, re.S))
for name in ("ds_config.json", "learner", "engine"):
    if name not in blocks:
        sys.exit(f"README.md has no block marked <!-- quick-start: {name} -->")
(crate / "ds_config.json").write_text(blocks["ds_config.json"])
main = (repo / "scripts/readme-quick-starts/main.rs").read_text()
for name in ("learner", "engine"):
    mark = f"    // QUICK START: {name}\n"
    assert mark in main, f"scripts/readme-quick-starts/main.rs lost its mark {mark!r}"
    main = main.replace(mark, blocks[name])
(crate / "src/main.rs").write_text(main)
# The workspace's profiles, so that the dependencies are built as in the test build.
manifest = (repo / "Cargo.toml").read_text()
profiles = manifest[manifest.index("[profile."):]
(crate / "Cargo.toml").write_text(f"""[package]
name = "readme-quick-starts"
version = "0.0.0"
edition = "2024"
publish = false

[dependencies]
burn = {{ version = "=0.22.1", default-features = false, features = ["std", "train", "flex", "extension", "capture", "safetensors"] }}
burn-deepspeed = {{ path = "{repo}/crates/burn-deepspeed", features = ["mpi", "wgpu"] }}
burn-deepspeed-example-classifier = {{ path = "{repo}/examples/classifier", features = ["mpi", "wgpu"] }}

{profiles}""")
PY
cp Cargo.lock "$crate/"
cd "$crate"
CARGO_TARGET_DIR="$target" cargo build --offline --quiet --profile test
out=$(CARGO_TARGET_DIR="$target" cargo run --offline --quiet --profile test)
echo "$out"
python3 - "$out" <<'PY'
import re, sys
out = sys.argv[1]
m = re.search(r"learner quick start: held-out loss ([0-9.]+) -> ([0-9.]+)", out)
before, after = float(m.group(1)), float(m.group(2))
assert after < 0.8 * before, f"the Learner quick start did not train: {before} -> {after}"
m = re.search(r"engine quick start: loss ([0-9.]+) .*-> \[([0-9.e, -]+)\]", out)
first = float(m.group(1))
last = [float(x) for x in m.group(2).split(",")]
assert len(last) == 2 and max(last) < 0.8 * first, f"the engine quick start did not train: {first} -> {last}"
print("README quick starts: 2 passed, 0 failed")
PY
