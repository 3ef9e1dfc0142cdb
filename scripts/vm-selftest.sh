#!/usr/bin/env bash
# scripts/vm-selftest.sh — proves the test VM can do what kura's kernel-path tests need:
# modules on demand (nbd, ublk_drv), and a real file system on a kernel NBD device served by
# a user-space server over loopback. Runs inside the VM:
#
#   scripts/kernel-vm.sh scripts/vm-selftest.sh
set -euo pipefail

[ "${KURA_IN_VM:-}" = 1 ] || { echo "vm-selftest: run it inside the VM: scripts/kernel-vm.sh scripts/vm-selftest.sh" >&2; exit 2; }

t_start=$(date +%s%N)
step() { printf 'vm-selftest: [%5d ms] %s\n' $(( ($(date +%s%N) - t_start) / 1000000 )) "$*"; }

scratch=$(mktemp -d /tmp/vm-selftest.XXXXXX)
img=$scratch/disk.img
mnt=$scratch/mnt
port=10809
export_name=selftest
nbd=/dev/nbd0

cleanup() {
  set +e
  mountpoint -q "$mnt" 2>/dev/null && umount "$mnt"
  nbd-client -c "$nbd" >/dev/null 2>&1 && nbd-client -d "$nbd" >/dev/null 2>&1
  [ -f "$scratch/qemu-nbd.pid" ] && kill "$(cat "$scratch/qemu-nbd.pid")" 2>/dev/null
  rm -rf "$scratch"
}
trap cleanup EXIT

step "kernel $(uname -r); loading nbd and ublk_drv with modprobe"
modprobe -a nbd ublk_drv
ls -l /dev/ublk-control "$nbd"

step "serving a 256 MiB file with qemu-nbd on 127.0.0.1:$port"
truncate -s 256M "$img"
mkdir -p "$mnt"
qemu-nbd --fork --pid-file "$scratch/qemu-nbd.pid" -f raw -x "$export_name" -b 127.0.0.1 -p "$port" "$img"

step "nbd-client 127.0.0.1 $port $nbd -N $export_name"
nbd-client 127.0.0.1 "$port" "$nbd" -N "$export_name"
size_bytes=$(blockdev --getsize64 "$nbd")
[ "$size_bytes" = $((256 << 20)) ] || { echo "vm-selftest: $nbd has $size_bytes bytes, want $((256 << 20))" >&2; exit 1; }

step "mkfs.ext4 $nbd"
mkfs.ext4 -q -F "$nbd"

step "mount, write 8 MiB, sync, umount"
mount "$nbd" "$mnt"
head -c $((8 << 20)) /dev/urandom >"$mnt/data"
want=$(sha256sum <"$mnt/data")
sync
umount "$mnt"

step "mount again and check the data"
mount -o ro "$nbd" "$mnt"
got=$(sha256sum <"$mnt/data")
[ "$got" = "$want" ] || { echo "vm-selftest: data changed across umount/mount" >&2; exit 1; }
umount "$mnt"

step "e2fsck -fn $nbd"
e2fsck -fn "$nbd"

step "disconnecting"
nbd-client -d "$nbd"
# qemu-nbd without --persistent exits when its one client leaves.
for _ in $(seq 50); do kill -0 "$(cat "$scratch/qemu-nbd.pid")" 2>/dev/null || break; sleep 0.1; done

step "OK"
