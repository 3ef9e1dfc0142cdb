#!/usr/bin/env bash
# scripts/install-fs-tools.sh — install the file system conformance tools that
# crates/kura-fs/tests/conformance.rs runs, at pinned versions, into a cache CI reuses:
#
#   pjdfstest  POSIX conformance suite (the Rust rewrite)  -> $KURA_TOOLS_DIR/bin/pjdfstest
#   fsx        File System eXerciser (the Rust port)       -> $KURA_TOOLS_DIR/bin/fsx
#
# Each version goes to its own root ($KURA_TOOLS_DIR/<crate>-<version>), built with
# `cargo install --locked`; $KURA_TOOLS_DIR/bin links to the pinned ones. A tool already
# there at its pinned version is not touched, so a warm run takes no time and no network.
# A cold run builds both from crates.io: 3 to 6 minutes on 2 cores, depending on load.
set -euo pipefail

tools_dir=${KURA_TOOLS_DIR:-/var/cache/kura-tools}
# crate, version, binary
pinned=(
  "pjdfstest 0.2.2 pjdfstest"
  "fsx 0.3.2 fsx"
)

if ! command -v cargo >/dev/null && [ -x "$HOME/.cargo/bin/cargo" ]; then
  export PATH="$HOME/.cargo/bin:$PATH"
fi
command -v cargo >/dev/null || { echo "install-fs-tools.sh: cargo not found" >&2; exit 1; }
mkdir -p "$tools_dir/bin"

for entry in "${pinned[@]}"; do
  read -r crate version binary <<<"$entry"
  root="$tools_dir/$crate-$version"
  exe="$root/bin/$binary"
  # `--version` prints "<name> <version>": a binary that runs and says so is taken as installed.
  if ! { [ -x "$exe" ] && "$exe" --version 2>/dev/null | grep -qx "$binary $version"; }; then
    echo "install-fs-tools.sh: installing $crate $version into $root"
    target=$(mktemp -d)
    start=$(date +%s)
    # The build directory goes whatever happens (it holds a few hundred MB).
    trap 'rm -rf "$target"' EXIT
    cargo install --quiet --locked --root "$root" --target-dir "$target" --version "=$version" "$crate"
    rm -rf "$target"
    trap - EXIT
    echo "install-fs-tools.sh: $crate $version built in $(( $(date +%s) - start )) s"
  fi
  ln -sfn "$exe" "$tools_dir/bin/$binary"
done
echo "install-fs-tools.sh: $(ls "$tools_dir/bin" | tr '\n' ' ')in $tools_dir/bin"
