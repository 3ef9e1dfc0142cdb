#!/usr/bin/env bash
# scripts/test.sh — run every test of the kura workspace. This is the one test command.
#
#   ./scripts/test.sh                 all tests
#   ./scripts/test.sh -p kura-bench   extra arguments go to `cargo test` as they are (naming
#                                     packages with -p tests only those)
#
# Steps:
#   1. install the Debian packages the tests use (fio, memcached, redis, qemu, nbd, mkfs, ...):
#      only the missing ones, with one `apt-get update` first; nothing at all when all are there.
#   2. fetch Debian's 6.12 kernel for the VM tests into /var/cache/kura-vm (unpacked, never
#      installed: the host's boot is left alone) — see scripts/vm-kernel-fetch.sh.
#   3. cargo test --workspace --release --no-fail-fast "$@"   (release: the tests do real I/O)
#
# Needs root (or sudo) for step 1 on a fresh Debian 12 machine. KURA_SKIP_INSTALL=1 skips
# steps 1-2; tests whose tools are then missing skip themselves with a printed reason.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

step() { printf '\n==> test.sh: %s\n' "$*"; }
die() { printf 'test.sh: error: %s\n' "$*" >&2; exit 1; }
now() { date +%s; }

# Debian packages the tests use (binary packages, checked with dpkg-query).
packages=(
  fio                 # block benchmarks, io_uring and nbd engines
  memcached           # the anchor server, DRAM and extstore
  libmemcached-tools  # memccapable, memaslap
  redis-server        # RESP backend anchor
  redis-tools         # redis-cli, redis-benchmark
  qemu-utils          # qemu-nbd, qemu-img, qemu-io
  qemu-system-x86     # the kernel VM (ublk, kernel NBD)
  nbd-client          # kernel NBD client (inside the VM)
  nbdkit              # reference NBD server
  libnbd-bin          # nbdinfo, nbdcopy
  xfsprogs            # mkfs.xfs, xfs_repair
  e2fsprogs           # mkfs.ext4, e2fsck
  fuse3               # fusermount3 for the FUSE export
  busybox-static      # the VM's initramfs
  cpio                # packs the initramfs
  kmod                # depmod/modprobe for the VM's modules
  xz-utils            # the kernel's modules are .ko.xz
  sqlite3             # a real database under the LD_PRELOAD file system
  python3             # os/shutil/pathlib programs under the preload
  nodejs              # Node.js (libuv) programs under the preload
  rsync               # copies trees into and out of the preload's mount
  libclang-dev        # bindgen for libublk-sys (the ublk frontend) at build time
  gcc                 # compiles the C test program of the preload (stdio, POSIX calls)
  openssl             # makes the certificates of the NBD TLS tests
)

sudo_cmd=()
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null || die "not root and no sudo: run as root, or KURA_SKIP_INSTALL=1"
  sudo_cmd=(sudo)
fi

is_installed() {
  [ "$(dpkg-query -W -f='${db:Status-Abbrev}' "$1" 2>/dev/null)" = "ii " ]
}

# Some machine images carry qemu-utils from bookworm-backports (QEMU 10), which Breaks the
# QEMU 7.2 qemu-system-common of bookworm: qemu-system-x86 must then come from the same suite.
qemu_suite() {
  local v
  v=$(dpkg-query -W -f='${Version}' qemu-utils 2>/dev/null || true)
  case $v in
    *~bpo*) . /etc/os-release; echo "${VERSION_CODENAME}-backports" ;;
  esac
}

# Adds `suite` from the mirror apt already uses for this release (backports get apt's default
# pin of 100: nothing else is upgraded from them).
enable_suite() {
  local suite=$1 file=/etc/apt/sources.list.d/kura-$1.sources codename mirror
  grep -qs -- "$suite" /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources && return 0
  codename=${suite%-backports}
  mirror=$(apt-get indextargets --format '$(REPO_URI) $(RELEASE)' | awk -v r="$codename" '$2 == r { print $1; exit }')
  [ -n "$mirror" ] || die "no apt source for $codename to take $suite from"
  echo "adding $suite from $mirror to apt's sources ($file)"
  printf 'Types: deb\nURIs: %s\nSuites: %s\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
    "$mirror" "$suite" | "${sudo_cmd[@]}" tee "$file" >/dev/null
}

apt_install() {
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends "$@"
}

install_packages() {
  local missing=() regular=() p suite
  for p in "${packages[@]}"; do is_installed "$p" || missing+=("$p"); done
  local kernel_cached=0
  [ -f "${KURA_VM_CACHE:-/var/cache/kura-vm}/current/vmlinuz" ] && kernel_cached=1
  if [ ${#missing[@]} -eq 0 ] && [ $kernel_cached = 1 ]; then
    echo "all ${#packages[@]} Debian packages present; VM kernel cached"
    return
  fi
  command -v apt-get >/dev/null || die "apt-get not found: install ${missing[*]} by hand, or KURA_SKIP_INSTALL=1"
  suite=$(qemu_suite)
  [ -n "$suite" ] && [[ " ${missing[*]} " == *" qemu-system-x86 "* ]] && enable_suite "$suite"
  echo "apt-get update"
  "${sudo_cmd[@]}" apt-get update -q
  for p in "${missing[@]}"; do
    if [ "$p" = qemu-system-x86 ] && [ -n "$suite" ]; then continue; fi
    regular+=("$p")
  done
  if [ ${#regular[@]} -gt 0 ]; then
    echo "apt-get install ${regular[*]}"
    apt_install "${regular[@]}"
  fi
  if [ -n "$suite" ] && [[ " ${missing[*]} " == *" qemu-system-x86 "* ]]; then
    echo "apt-get install -t $suite qemu-system-x86 (to match qemu-utils from $suite)"
    apt_install -t "$suite" qemu-system-x86
  fi
  export KURA_APT_UPDATED=1
}

if [ "${KURA_SKIP_INSTALL:-0}" = 1 ]; then
  step "KURA_SKIP_INSTALL=1: not installing packages nor fetching the VM kernel"
else
  t0=$(now)
  step "1/3 Debian packages the tests use"
  install_packages
  step "2/3 kernel for the VM tests"
  kdir=$("${sudo_cmd[@]}" env KURA_APT_UPDATED="${KURA_APT_UPDATED:-0}" ${KURA_VM_CACHE:+KURA_VM_CACHE="$KURA_VM_CACHE"} "$root/scripts/vm-kernel-fetch.sh")
  echo "VM kernel: $kdir ($(cat "$kdir/package" 2>/dev/null || echo '?'))"
  echo "setup took $(( $(now) - t0 )) s"
  # Everything the VM tests need is installed now: they must run, not skip.
  export KURA_REQUIRE_VM=${KURA_REQUIRE_VM:-1}
fi

if ! command -v cargo >/dev/null && [ -x "$HOME/.cargo/bin/cargo" ]; then
  export PATH="$HOME/.cargo/bin:$PATH"
fi
command -v cargo >/dev/null || die "cargo not found: install Rust with rustup"

# pjdfstest and fsx for the file system's conformance tests: built with cargo once, cached in
# /var/cache/kura-tools (scripts/install-fs-tools.sh); with them installed the tests must run.
if [ "${KURA_SKIP_INSTALL:-0}" != 1 ]; then
  step "pjdfstest, fsx (cached in /var/cache/kura-tools)"
  "$root/scripts/install-fs-tools.sh"
  export KURA_REQUIRE_FS_TOOLS=${KURA_REQUIRE_FS_TOOLS:-1}
fi

# --no-fail-fast: one failing test binary does not hide the results of the others.
# --workspace unless packages are named (cargo would otherwise test everything anyway).
scope=(--workspace)
for arg in "$@"; do
  [ "$arg" = -- ] && break
  case $arg in -p | -p?* | --package | --package=*) scope=() ;; esac
done
step "3/3 cargo test${scope[*]:+ ${scope[*]}} --release --no-fail-fast $*"
t0=$(now)
cargo test "${scope[@]}" --release --no-fail-fast "$@"
echo "cargo test took $(( $(now) - t0 )) s"
