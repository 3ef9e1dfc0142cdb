#!/usr/bin/env bash
# fs-check.sh write|verify DEVICE ext4|xfs STATE_DIR — a real file system on a kura block device.
#
#   write:  mkfs, mount, write a tree of files (FS_CHECK_MB in all, default 24), record their
#           sha256 in STATE_DIR/manifest-FS, sync, unmount.
#   verify: fsck without repairing (e2fsck -fn / xfs_repair -n) must find it clean; mount
#           read-only and check every file against the manifest; unmount.
# Used by the FUSE + loop tests on the host and by the ublk / kernel NBD tests in the VM.
set -euo pipefail
mode=$1 dev=$2 fs=$3 state=$4
mb=${FS_CHECK_MB:-24}
mnt=$state/mnt-$fs
manifest=$state/manifest-$fs
mkdir -p "$mnt"
say() { printf 'fs-check: %s %s: %s\n' "$fs" "$dev" "$*"; }

case $mode in
write)
  case $fs in
    ext4) mkfs.ext4 -q -F "$dev" ;;
    xfs) mkfs.xfs -q -f "$dev" ;;
    *) echo "unknown file system $fs" >&2; exit 2 ;;
  esac
  mount "$dev" "$mnt"
  # A tree: directories three deep, files from empty to 2 MiB, about $mb MiB in all.
  left=$((mb << 20)) i=0
  while [ $left -gt 0 ]; do
    dir=$mnt/d$((i % 4))/e$((i % 3))/f$((i % 2))
    # Each process costs a lot under an emulated CPU (the kernel VM): no mkdir when not needed.
    [ -d "$dir" ] || mkdir -p "$dir"
    case $((i % 5)) in
      0) size=0 ;; 1) size=$((RANDOM % 4096 + 1)) ;; 2) size=$(((RANDOM % 64 + 1) * 4096)) ;;
      3) size=$((RANDOM * 37 % (2 << 20))) ;; *) size=$((RANDOM % 300000)) ;;
    esac
    [ $size -gt $left ] && size=$left
    if [ $size = 0 ]; then : >"$dir/file$i"; else head -c "$size" /dev/urandom >"$dir/file$i"; fi
    left=$((left - size)) i=$((i + 1))
  done
  ln -s d0 "$mnt/link"
  (cd "$mnt" && find . -type f -print0 | sort -z | xargs -0 sha256sum) >"$manifest"
  sync
  umount "$mnt"
  say "wrote $i files ($mb MiB)"
  ;;
verify)
  case $fs in
    ext4) e2fsck -fn "$dev" ;;
    xfs) xfs_repair -n "$dev" ;;
  esac
  say "fsck clean"
  mount -o ro "$dev" "$mnt"
  (cd "$mnt" && sha256sum --quiet -c "$manifest")
  [ "$(readlink "$mnt/link")" = d0 ]
  umount "$mnt"
  say "$(wc -l <"$manifest") files match their checksums"
  ;;
*) echo "usage: fs-check.sh write|verify DEVICE ext4|xfs STATE_DIR" >&2; exit 2 ;;
esac
