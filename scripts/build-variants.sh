#!/usr/bin/env bash
# Builds the runner of several commits side by side, for timing them in one H200 session (same
# clocks): scripts/build-variants.sh NAME=REV [NAME=REV ...] packs .device/variants.tar.xz with
# run-NAME per commit; scripts/time-variants.sh runs them there. Uses a git worktree under
# target/variants-src and the target dir target/variants (both git-ignored), so the checkout is
# left as it is. Keeps .device/bundle.tar.xz (scripts/build-gpu-bundle.sh) if there is one.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { echo "usage: $0 NAME=REV [NAME=REV ...]" >&2; exit 2; }
./scripts/setup.sh >/dev/null
root=$(pwd)
src=target/variants-src
bin=target/variants-bin
[ -d "$src" ] || git worktree add -f --detach "$src" HEAD >/dev/null
rm -rf "$bin" && mkdir -p "$bin" .device
for spec in "$@"; do
  name=${spec%%=*}
  # resolved here: inside the worktree, HEAD and branch-relative names mean the worktree's own
  rev=$(git rev-parse --verify "${spec#*=}^{commit}")
  (cd "$src" && git checkout -q --detach "$rev" && ln -sfn "$root/.tools" .tools &&
    CARGO_TARGET_DIR="$root/target/variants" cargo build -q --release --features cuda --example run)
  cp target/variants/release/examples/run "$bin/run-$name" && strip "$bin/run-$name"
  echo "built $name ($(git rev-parse --short "$rev"))"
done
tar -C "$bin" -cJf .device/variants.tar.xz . && du -sh .device/variants.tar.xz
