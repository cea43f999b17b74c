#!/usr/bin/env bash
# Packaging a user can depend on: `cargo package` of every published crate together (offline,
# our unpublished crates resolved from one another; without the verifying build, which would
# fetch them from crates.io), each package holding its license files and the README; and no
# command-line dependency (clap) in the library's dependency tree.
#
#   bash scripts/package-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
crates=(burn-deepspeed-cubecl-kernels burn-deepspeed-compress burn-deepspeed-strategies
    burn-deepspeed burn-deepspeed-cli)
passed=0
failed=0
args=()
for c in "${crates[@]}"; do args+=(-p "$c"); done
log=$(mktemp)
if cargo package --offline --allow-dirty --no-verify "${args[@]}" > "$log" 2>&1; then
    for c in "${crates[@]}"; do
        files=$(cargo package --offline --allow-dirty --list -p "$c" 2> /dev/null)
        if grep -qx LICENSE-MIT <<< "$files" && grep -qx LICENSE-APACHE <<< "$files" \
            && grep -qx README.md <<< "$files"; then
            echo "package $c: ok ($(wc -l <<< "$files") files)"
            passed=$((passed + 1))
        else
            echo "package $c: FAILED (license files or README missing)"
            failed=$((failed + 1))
        fi
    done
else
    tail -n 20 "$log"
    echo "cargo package: FAILED"
    failed=$((failed + 1))
fi
if cargo tree --offline -p burn-deepspeed -e normal --prefix none | grep -q '^clap '; then
    echo "burn-deepspeed depends on clap: FAILED"
    failed=$((failed + 1))
else
    echo "burn-deepspeed's dependency tree has no clap"
    passed=$((passed + 1))
fi
echo "packaging: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
