#!/usr/bin/env bash
# scripts/vm-kernel-fetch.sh — make sure a Debian 6.12 kernel and its modules are unpacked in
# the VM kernel cache, and print that kernel's directory on stdout (progress goes to stderr).
#
# The kernel runs only inside the test VM (scripts/kernel-vm.sh), so it is never installed:
# the package is fetched with `apt-get download`, unpacked with `dpkg-deb -x`, and given a
# modules.dep with `depmod -b`. The host's /boot, boot loader and module tree are left alone.
#
# Cache layout ($KURA_VM_CACHE, default /var/cache/kura-vm):
#   <kver>/vmlinuz               the kernel image
#   <kver>/lib/modules/<kver>/   its modules, with modules.dep
#   <kver>/package               the Debian package it came from
#   current -> <kver>            the kernel kernel-vm.sh boots
#
# Knobs: KURA_VM_CACHE; KURA_VM_KERNEL_PKG to pick a package by name (default: the newest
# linux-image-6.12.*-amd64-unsigned that apt knows); KURA_APT_UPDATED=1 when the caller has
# already run `apt-get update` (then it is not run again).
set -euo pipefail

cache=${KURA_VM_CACHE:-/var/cache/kura-vm}
tmp=""  # scratch directory of a fetch, removed on exit

say() { printf 'vm-kernel-fetch: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

kernel_ready() {
  local dir=$1 kver
  kver=$(basename "$dir")
  [ -f "$dir/vmlinuz" ] && [ -f "$dir/lib/modules/$kver/modules.dep" ]
}

# The VM bind-mounts the cached modules over /lib/modules of the shared (read-only) host root,
# so that directory must exist on the host. It is where Debian keeps modules anyway.
ensure_host_module_dir() {
  [ -d /lib/modules ] && return 0
  mkdir -p /lib/modules 2>/dev/null || die "/lib/modules is missing and cannot be created (run as root once)"
}

# Newest plain amd64 6.12 kernel (not -cloud, not -rt: the generic flavour has ublk_drv and nbd).
newest_kernel_pkg() {
  apt-cache search --names-only '^linux-image-6\.12\.[0-9]+.*-amd64-unsigned$' 2>/dev/null |
    awk '{print $1}' | grep -Ev -- '-(cloud|rt)-amd64' | sort -V | tail -1
}

pick_kernel_pkg() {
  if [ -n "${KURA_VM_KERNEL_PKG:-}" ]; then echo "$KURA_VM_KERNEL_PKG"; return; fi
  local pkg
  pkg=$(newest_kernel_pkg)
  if [ -z "$pkg" ] && [ "${KURA_APT_UPDATED:-0}" != 1 ]; then
    say "no 6.12 kernel in apt's lists; running apt-get update"
    apt-get update -qq >&2 || die "apt-get update failed"
    pkg=$(newest_kernel_pkg)
  fi
  [ -n "$pkg" ] || die "apt knows no linux-image-6.12.*-amd64-unsigned package (is this Debian 12?)"
  echo "$pkg"
}

fetch() {
  command -v apt-get >/dev/null || die "apt-get not found: the VM kernel comes from Debian's packages"
  command -v depmod >/dev/null || die "depmod not found: apt-get install kmod (scripts/test.sh does)"
  local pkg deb kver modsrc
  pkg=$(pick_kernel_pkg)
  tmp=$(mktemp -d "$cache/.fetch.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  say "downloading $pkg"
  (cd "$tmp" && apt-get download -q -o APT::Sandbox::User=root "$pkg" >&2) || die "apt-get download $pkg failed"
  deb=$(ls "$tmp"/*.deb)
  say "unpacking $(basename "$deb") into $cache"
  dpkg-deb -x "$deb" "$tmp/root"
  kver=$(ls "$tmp/root/boot" | sed -n 's/^vmlinuz-//p' | head -1)
  [ -n "$kver" ] || die "$pkg has no /boot/vmlinuz-*"
  modsrc=$tmp/root/lib/modules/$kver
  [ -d "$modsrc" ] || modsrc=$tmp/root/usr/lib/modules/$kver
  [ -d "$modsrc" ] || die "$pkg has no modules for $kver"
  mkdir -p "$tmp/$kver/lib/modules"
  mv "$tmp/root/boot/vmlinuz-$kver" "$tmp/$kver/vmlinuz"
  mv "$modsrc" "$tmp/$kver/lib/modules/$kver"
  echo "$pkg" >"$tmp/$kver/package"
  depmod -b "$tmp/$kver" "$kver"
  rm -rf "${cache:?}/$kver"
  mv "$tmp/$kver" "$cache/$kver"
  ln -sfn "$kver" "$cache/current"
  say "kernel $kver ready in $cache/$kver"
}

cached_kernel() {
  [ -L "$cache/current" ] && kernel_ready "$(readlink -f "$cache/current")" && readlink -f "$cache/current"
}

ensure_host_module_dir
cached_kernel && exit 0
# One fetch at a time (test processes may ask together); the winner's kernel serves the rest.
mkdir -p "$cache" 2>/dev/null || die "cannot create $cache (run as root, or set KURA_VM_CACHE)"
exec 9>"$cache/.lock" || die "cannot lock $cache (run as root, or set KURA_VM_CACHE)"
flock 9
cached_kernel && exit 0
find "$cache" -maxdepth 1 -name '.fetch.*' -mmin +60 -exec rm -rf {} + 2>/dev/null || true
fetch
cached_kernel || die "kernel unpacked but not usable in $cache"
