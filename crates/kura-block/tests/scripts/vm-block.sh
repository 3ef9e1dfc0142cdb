#!/usr/bin/env bash
# vm-block.sh CHECK... — kura's kernel block paths for real: each CHECK puts ext4 / xfs on a
# kernel block device served by kura, restarts kura between writing and checking, and expects
# fsck clean and every checksum to match (fs-check.sh). Meant for the kernel VM
# (scripts/kernel-vm.sh), whose kernel has ublk_drv and nbd; crates/kura-block/tests/vm.rs
# runs it there, and runs the ublk checks on the host where /dev/ublk-control exists.
#
# CHECKs (each runs even when an earlier one failed; each ends with a line
# "vm-block: RESULT CHECK ok" or "vm-block: RESULT CHECK FAILED"):
#   ublk-raw        /dev/ublkbN on the embedded engine: the queue limits the kernel sees (write
#                   cache, FUA, discard, write-zeroes), FUA writes, discard and write-zeroes
#                   read back as zeros, fio verify with fsyncs; SIGTERM with a file system
#                   still mounted stops kura and removes the device; kura's request counts
#                   show flushes, FUA writes, discards and write-zeroes arrived, none failed.
#   ublk-embedded   kura block ublk on the embedded engine: ext4 and xfs.
#   nbd-embedded    kura block nbd + nbd-client (/dev/nbdN) on the embedded engine: ext4, xfs.
#   ublk-kura       kura block ublk on a `kura serve` store: the file systems in
#                   VM_BLOCK_SERVER_FS (default "xfs"); the server restarts too.
#   ublk-recover    kura block ublk on a `kura serve` store, SIGKILLed while files on ext4
#                   on the device are being written and fsynced: the device stays, the
#                   writer waits (no I/O error), `kura block ublk --recover N` takes the
#                   device over, the writer finishes; a SIGKILL mid-recovery is recovered
#                   too; fsck clean, every file as written; a recovery of a device that is
#                   live, or of the wrong volume, is refused; `kura block ublk-delete N`
#                   deletes a device left waiting (its waiting read fails), not a live one.
#   ublk-memcached  kura block ublk on a stock memcached, and
#   ublk-redis      on a stock redis-server: fio verify on the raw device, then ext4 written,
#                   kura restarted (the server keeps running: neither persists by itself),
#                   fsck clean and checksums match.
#
# Environment: KURA_BIN (the kura binary; required), FS_CHECK_MB (data per file system,
# default 4), VM_BLOCK_FS (file systems, default "ext4 xfs"), VM_BLOCK_VOLUME_SIZE (default
# 320M: xfs needs 300 MB), and where the stores go (the engine uses O_DIRECT, which tmpfs
# refuses): VM_BLOCK_DISK (a scratch block device, formatted ext4 and mounted) or
# VM_BLOCK_SCRATCH (a directory on a disk file system). VM_BLOCK_SERVER_PORT: kura serve's
# port (default 11411); memcached and redis-server use the next two. VM_BLOCK_STEP_TIMEOUT_S (default 200): an fs-check.sh step running
# longer counts as stuck: what is stuck is printed (tasks in D state, kernel and gdb stacks of
# kura's threads, the kernel log) and the check fails.
set -uo pipefail

kura=${KURA_BIN:?KURA_BIN: the kura binary}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
fs_check=$here/fs-check.sh
export FS_CHECK_MB=${FS_CHECK_MB:-4}
fs_types=${VM_BLOCK_FS:-ext4 xfs}
server_fs_types=${VM_BLOCK_SERVER_FS:-xfs}
volume_size=${VM_BLOCK_VOLUME_SIZE:-320M}
# The pool store: volumes are thin, so this bounds what the checks write, not the volumes.
store_size=1G
# How long a kura process may take to start serving or to stop, under emulation.
start_timeout_s=120
stop_timeout_s=120

t_start=$(date +%s%N)
say() { printf 'vm-block: [%6d ms] %s\n' $((($(date +%s%N) - t_start) / 1000000)) "$*"; }
# Messages go to stderr: some functions print their result on stdout.
fail() { say "error: $*" >&2; exit 1; }

# ---- scratch space on a real disk ------------------------------------------------------------

setup_scratch() {
  if [ -n "${VM_BLOCK_DISK:-}" ]; then
    scratch=/tmp/vm-block
    mkdir -p "$scratch/disk"
    mkfs.ext4 -q -F "$VM_BLOCK_DISK" || fail "mkfs.ext4 $VM_BLOCK_DISK"
    mount "$VM_BLOCK_DISK" "$scratch/disk" || fail "mount $VM_BLOCK_DISK"
    stores=$scratch/disk
  else
    scratch=$(mktemp -d "${VM_BLOCK_SCRATCH:?set VM_BLOCK_DISK or VM_BLOCK_SCRATCH}/vm-block.XXXXXX")
    stores=$scratch
  fi
}

# ---- kura processes ------------------------------------------------------------------------

# start_bg NAME CMD... — starts CMD in the background with stdout in $scratch/NAME.out and
# stderr in $scratch/NAME.log; sets $bg_pid.
start_bg() {
  local name=$1
  shift
  : >"$scratch/$name.out"
  RUST_LOG=${RUST_LOG:-info} "$@" >"$scratch/$name.out" 2>"$scratch/$name.log" </dev/null &
  bg_pid=$!
}

# wait_line NAME PID — waits until NAME.out has a line; prints it. (Shell builtins only in
# the loop: processes are slow under emulation. kura prints the line with one write.)
wait_line() {
  local name=$1 pid=$2 i line
  for ((i = 0; i < start_timeout_s * 10; i++)); do
    if [ -s "$scratch/$name.out" ] && IFS= read -r line <"$scratch/$name.out"; then
      printf '%s\n' "$line"
      return 0
    fi
    kill -0 "$pid" 2>/dev/null || { show_log "$name"; wait "$pid"; fail "$name exited ($?) before it was ready"; }
    sleep 0.1
  done
  show_log "$name"
  fail "$name printed nothing in ${start_timeout_s} s"
}

show_log() { { say "--- last lines of $1's log ---"; tail -30 "$scratch/$1.log" | sed 's/^/    /'; } >&2; }

# stop_pid NAME PID — SIGTERM, then waits; the process must exit with status 0.
stop_pid() {
  local name=$1 pid=$2 i status
  kill -TERM "$pid" 2>/dev/null
  for ((i = 0; i < stop_timeout_s * 10; i++)); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$pid" 2>/dev/null; then
    show_log "$name"
    kill -KILL "$pid"
    wait "$pid"
    fail "$name did not stop within ${stop_timeout_s} s of SIGTERM"
  fi
  wait "$pid"
  status=$?
  [ "$status" = 0 ] || { show_log "$name"; fail "$name exited with status $status after SIGTERM"; }
}

# ublk_start VOLUME POOL — kura block ublk; sets $ublk_pid and $ublk_dev.
ublk_start() {
  start_bg ublk "$kura" block ublk --volume "$1" --pool "$2"
  ublk_pid=$bg_pid
  ublk_dev=$(wait_line ublk "$ublk_pid") || exit 1
  [[ $ublk_dev =~ ^/dev/ublkb[0-9]+$ ]] || fail "kura block ublk printed '$ublk_dev', not /dev/ublkbN"
  local i
  for ((i = 0; i < 100; i++)); do [ -b "$ublk_dev" ] && break; sleep 0.1; done
  [ -b "$ublk_dev" ] || fail "$ublk_dev is not a block device"
  say "kura block ublk --volume $1: $ublk_dev ($(blockdev --getsize64 "$ublk_dev") bytes)$(store_open_ms ublk)"
}

# store_open_ms NAME — ", store opened in N ms" from NAME's log, if it opened an embedded store.
store_open_ms() {
  sed -n 's/\x1b\[[0-9;]*m//g; s/.*opened kura store.*elapsed_ms=\([0-9]*\).*/, store opened in \1 ms/p' "$scratch/$1.log" | head -1
}

# ublk_stop — SIGTERM; the device must be gone afterwards (stopped and deleted).
ublk_stop() {
  local id=${ublk_dev#/dev/ublkb} i
  stop_pid "kura block ublk" "$ublk_pid"
  for ((i = 0; i < 50; i++)); do
    [ ! -e "/sys/block/ublkb$id" ] && [ ! -e "/dev/ublkc$id" ] && break
    sleep 0.1
  done
  [ ! -e "/sys/block/ublkb$id" ] || fail "SIGTERM left /sys/block/ublkb$id behind"
  [ ! -e "/dev/ublkc$id" ] || fail "SIGTERM left /dev/ublkc$id behind"
  say "kura block ublk stopped; $ublk_dev deleted"
  ublk_pid=
}

# nbd_start POOL [LISTEN] — kura block nbd; sets $nbd_pid and $nbd_addr.
nbd_start() {
  start_bg nbd "$kura" block nbd --listen "${2:-127.0.0.1:0}" --print-address --pool "$1"
  nbd_pid=$bg_pid
  nbd_addr=$(wait_line nbd "$nbd_pid") || exit 1
  say "kura block nbd listening on $nbd_addr$(store_open_ms nbd)"
}

# server_start — kura serve in store mode on $stores/server.kura; sets $server_pid, $server_port.
server_start() {
  server_port=${VM_BLOCK_SERVER_PORT:-11411}
  start_bg server "$kura" serve -l 127.0.0.1 -p "$server_port" --mode store --size "$store_size" -t 2 -m 16 --path "$stores/server.kura"
  server_pid=$bg_pid
  local i
  for ((i = 0; i < start_timeout_s * 10; i++)); do
    (exec 3<>"/dev/tcp/127.0.0.1/$server_port") 2>/dev/null && break
    kill -0 "$server_pid" 2>/dev/null || { show_log server; fail "kura serve exited before listening"; }
    sleep 0.1
  done
  (exec 3<>"/dev/tcp/127.0.0.1/$server_port") 2>/dev/null || fail "kura serve is not listening on $server_port"
  say "kura serve listening on 127.0.0.1:$server_port"
}

# external_start NAME — a stock memcached or redis-server on the port after kura serve's;
# sets $external_pid and $external_url.
external_start() {
  local port=$((${VM_BLOCK_SERVER_PORT:-11411} + 1)) i
  case $1 in
    memcached)
      command -v memcached >/dev/null || fail "memcached is not installed"
      start_bg memcached memcached -u root -U 0 -l 127.0.0.1 -p "$port" -m 512 -t 2
      external_url="memcached://127.0.0.1:$port" ;;
    redis)
      port=$((port + 1))
      command -v redis-server >/dev/null || fail "redis-server is not installed"
      start_bg redis redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --protected-mode no --dir "$scratch"
      external_url="redis://127.0.0.1:$port" ;;
  esac
  external_pid=$bg_pid
  for ((i = 0; i < start_timeout_s * 10; i++)); do
    (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
    kill -0 "$external_pid" 2>/dev/null || { show_log "$1"; fail "$1 exited before listening"; }
    sleep 0.1
  done
  (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null || fail "$1 is not listening on $port"
  say "$1 listening on 127.0.0.1:$port"
}

# volume_create NAME SIZE POOL
volume_create() {
  RUST_LOG=warn "$kura" volume create "$1" --size "$2" --pool "$3" >/dev/null 2>"$scratch/volume.log" ||
    { cat "$scratch/volume.log" >&2; fail "kura volume create $1 --size $2 --pool $3"; }
}

# What is stuck, when something is: tasks in D state with their kernel stacks, the block
# devices' in-flight counts, kura's threads (kernel stacks and, with gdb, user stacks) and the
# kernel log.
diagnose() {
  local p t
  say "=== diagnostics: $*"
  ps -eo pid,stat,wchan:32,comm | awk 'NR == 1 || $2 ~ /D/'
  for p in $(ps -eo pid,stat | awk '$2 ~ /D/ { print $1 }'); do
    echo "--- task $p ($(cat "/proc/$p/comm" 2>/dev/null)), kernel stack:"
    cat "/proc/$p/stack" 2>/dev/null
  done
  for t in /sys/block/ublkb* /sys/block/nbd*; do
    [ -e "$t/inflight" ] && [ "$(cat "$t/size")" != 0 ] && echo "--- ${t##*/}: inflight $(cat "$t/inflight")"
  done
  for p in ${ublk_pid:-} ${nbd_pid:-} ${server_pid:-}; do
    kill -0 "$p" 2>/dev/null || continue
    echo "--- kura process $p: $(tr '\0' ' ' <"/proc/$p/cmdline")"
    for t in /proc/"$p"/task/*; do
      echo "  thread ${t##*/} $(cat "$t/comm") state $(awk '{ print $3 }' "$t/stat") wchan $(cat "$t/wchan")"
      sed 's/^/    /' "$t/stack" 2>/dev/null
    done
    command -v gdb >/dev/null &&
      timeout 60 gdb -p "$p" -batch -ex 'thread apply all bt 25' 2>&1 | grep -E '^(Thread|#)' | sed 's/^/  /'
  done
  echo "--- kernel log"
  dmesg | tail -30
  for t in ublk nbd server; do [ -s "$scratch/$t.log" ] && show_log "$t" 2>&1; done
}

# How long one fs-check.sh step may take before it counts as stuck (minutes normally).
fs_check_timeout_s=${VM_BLOCK_STEP_TIMEOUT_S:-200}

fs_check() {
  local t0 pid i
  t0=$(date +%s%N)
  "$fs_check" "$@" &
  pid=$!
  for ((i = 0; i < fs_check_timeout_s * 10; i++)); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$pid" 2>/dev/null; then
    diagnose "fs-check.sh $* still running after ${fs_check_timeout_s} s"
    kill "$pid"
    fail "fs-check.sh $* got stuck"
  fi
  wait "$pid" || fail "fs-check.sh $* failed"
  say "fs-check.sh $1 $3 took $((($(date +%s%N) - t0) / 1000000)) ms"
}

# Stops whatever a check left running, unmounts, detaches: a failed check must not block the
# next one.
cleanup() {
  set +e
  local m
  for m in "$scratch"/mnt-*; do mountpoint -q "$m" 2>/dev/null && umount -l "$m"; done
  for m in /dev/nbd0 /dev/nbd1; do [ -b $m ] && nbd-client -c $m >/dev/null 2>&1 && nbd-client -d $m >/dev/null 2>&1; done
  for m in ${ublk_pid:-} ${nbd_pid:-} ${server_pid:-} ${external_pid:-}; do
    kill -TERM "$m" 2>/dev/null && { sleep 2; kill -KILL "$m" 2>/dev/null; }
  done
  wait 2>/dev/null
  # Each check has its own stores; the scratch disk holds one check's at a time.
  rm -f "$stores"/*.kura
}

# ---- checks --------------------------------------------------------------------------------

# read_range DEV OFFSET LEN — the bytes, with O_DIRECT (past the page cache).
read_range() {
  dd if="$1" iflag=direct,skip_bytes,count_bytes skip="$2" count="$3" bs=64K status=none
}

# same_range DEV FILE OFFSET LEN — DEV holds what FILE holds in that range. (Files, not
# process substitution: the VM's /dev has no /dev/fd.)
same_range() {
  read_range "$1" "$3" "$4" >"$scratch/got" || return 1
  dd if="$2" iflag=skip_bytes,count_bytes skip="$3" count="$4" bs=64K status=none >"$scratch/want"
  cmp -s "$scratch/got" "$scratch/want"
}

# zeros DEV OFFSET LEN — the range reads as zeros.
zeros() {
  read_range "$1" "$2" "$3" >"$scratch/got" || return 1
  head -c "$3" /dev/zero | cmp -s "$scratch/got" -
}

check_ublk_raw() {
  local pool="embedded:$stores/raw.kura?size=$store_size" b q
  volume_create raw 64M "$pool"
  ublk_start raw "$pool"
  b=${ublk_dev#/dev/}
  q=/sys/block/$b/queue
  say "queue: write_cache=$(cat $q/write_cache) fua=$(cat $q/fua) discard_max_bytes=$(cat $q/discard_max_bytes) write_zeroes_max_bytes=$(cat $q/write_zeroes_max_bytes) logical/physical=$(cat $q/logical_block_size)/$(cat $q/physical_block_size) max_sectors_kb=$(cat $q/max_sectors_kb)"
  [ "$(cat $q/write_cache)" = "write back" ] || fail "no volatile write cache: the kernel would send no FLUSH"
  [ "$(cat $q/fua)" = 1 ] || fail "no FUA"
  [ "$(cat $q/discard_max_bytes)" -gt 0 ] || fail "no discard"
  [ "$(cat $q/write_zeroes_max_bytes)" -gt 0 ] || fail "no write-zeroes"

  # FUA writes (O_DIRECT|O_DSYNC), read back.
  head -c $((4 << 20)) /dev/urandom >"$scratch/pattern"
  dd if="$scratch/pattern" of="$ublk_dev" bs=256K oflag=direct,dsync status=none || fail "FUA writes"
  same_range "$ublk_dev" "$scratch/pattern" 0 $((4 << 20)) || fail "FUA writes read back wrong"
  say "4 MiB of FUA writes read back"
  # Discard of whole blocks, write-zeroes of whole blocks, write-zeroes of a partial block range
  # (read-modify-write at both ends), and a flush.
  blkdiscard -o 0 -l $((1 << 20)) "$ublk_dev" || fail "blkdiscard"
  zeros "$ublk_dev" 0 $((1 << 20)) || fail "discarded range does not read as zeros"
  blkdiscard -z -o $((1 << 20)) -l $((1 << 20)) "$ublk_dev" || fail "blkdiscard -z (write-zeroes)"
  zeros "$ublk_dev" $((1 << 20)) $((1 << 20)) || fail "write-zeroes range does not read as zeros"
  local off=$(((2 << 20) + 512)) len=$((8192 + 1024))
  blkdiscard -z -o $off -l $len "$ublk_dev" || fail "blkdiscard -z of a partial-block range"
  zeros "$ublk_dev" $off $len || fail "partial write-zeroes range does not read as zeros"
  same_range "$ublk_dev" "$scratch/pattern" $((2 << 20)) 512 || fail "write-zeroes changed bytes before its range"
  same_range "$ublk_dev" "$scratch/pattern" $((off + len)) 4096 || fail "write-zeroes changed bytes after its range"
  blockdev --flushbufs "$ublk_dev" || fail "flush"
  say "discard, write-zeroes (whole and partial blocks) read back as zeros; flush ok"
  # Writes of 512 B - 128 KiB (read-modify-write of partial blocks), many in flight, with an
  # fsync (a FLUSH) every 16 writes, then verified.
  if command -v fio >/dev/null; then
    fio --name=ublk-verify --filename="$ublk_dev" --ioengine=io_uring --direct=1 --rw=randwrite \
      --bsrange=512-128k --offset=8M --size=16M --iodepth=16 --fsync=16 --verify=crc32c \
      --verify_fatal=1 --do_verify=1 --randrepeat=1 --output-format=terse >"$scratch/fio.out" 2>&1 ||
      { cat "$scratch/fio.out"; fail "fio verify"; }
    say "fio: 512 B - 128 KiB random writes with fsyncs verified"
  fi
  # SIGTERM while a file system is still mounted: kura stops the device and exits (the file
  # system's I/O fails from then on); the device goes away once it is unmounted. (That data
  # outlives a restart the file system checks show.)
  mkdir -p "$scratch/mnt-busy"
  mkfs.ext4 -q -F "$ublk_dev" && mount "$ublk_dev" "$scratch/mnt-busy" || fail "mkfs.ext4 + mount"
  echo busy >"$scratch/mnt-busy/file"
  stop_pid "kura block ublk" "$ublk_pid"
  ublk_pid=
  umount "$scratch/mnt-busy" 2>/dev/null || umount -l "$scratch/mnt-busy"
  local i id=${ublk_dev#/dev/ublkb}
  for ((i = 0; i < 100; i++)); do [ ! -e "/sys/block/ublkb$id" ] && break; sleep 0.1; done
  [ ! -e "/sys/block/ublkb$id" ] || fail "$ublk_dev still there after SIGTERM and umount"
  say "SIGTERM with a mounted file system: kura exited, $ublk_dev gone after umount"
  # What kura's queues received (each logs its counts when it ends): the kernel did send
  # flushes, FUA writes, discards and write-zeroes, and none failed.
  # (One awk, not a process per count: processes are slow under emulation.)
  local summary kv
  summary=$(sed 's/\x1b\[[0-9;]*m//g' "$scratch/ublk.log" | awk '
    /ublk: queue done/ { for (i = 1; i <= NF; i++) if (split($i, kv, "=") == 2) n[kv[1]] += kv[2] }
    END { split("reads writes fua_writes flushes discards write_zeroes failed", k, " ")
          for (i = 1; i <= 7; i++) printf " %s=%d", k[i], n[k[i]] }')
  for kv in $summary; do
    case $kv in
      failed=*) [ "${kv#*=}" = 0 ] || fail "${kv#*=} requests failed:$summary" ;;
      *) [ "${kv#*=}" -gt 0 ] || fail "kura received no ${kv%=*}:$summary" ;;
    esac
  done
  say "requests kura received:$summary"
}

check_ublk_embedded() {
  local pool="embedded:$stores/ublk.kura?size=$store_size" fs
  for fs in $fs_types; do
    volume_create "vol-$fs" "$volume_size" "$pool"
    ublk_start "vol-$fs" "$pool"
    fs_check write "$ublk_dev" "$fs" "$scratch"
    ublk_stop
    ublk_start "vol-$fs" "$pool"
    fs_check verify "$ublk_dev" "$fs" "$scratch"
    ublk_stop
  done
}

check_ublk_kura() {
  local pool fs
  server_start
  pool="kura://127.0.0.1:$server_port"
  for fs in $server_fs_types; do
    volume_create "srv-$fs" "$volume_size" "$pool"
    ublk_start "srv-$fs" "$pool"
    fs_check write "$ublk_dev" "$fs" "$scratch"
    ublk_stop
    # Everything acknowledged was flushed to the server; restart the server as well.
    stop_pid "kura serve" "$server_pid"
    server_start
    ublk_start "srv-$fs" "$pool"
    fs_check verify "$ublk_dev" "$fs" "$scratch"
    ublk_stop
  done
  stop_pid "kura serve" "$server_pid"
  server_pid=
}

# ublk_recover ID VOLUME POOL — kura block ublk --recover ID; the device must be the same.
ublk_recover() {
  start_bg ublk "$kura" block ublk --recover "$1" --volume "$2" --pool "$3"
  ublk_pid=$bg_pid
  local dev
  dev=$(wait_line ublk "$ublk_pid") || exit 1
  [ "$dev" = "/dev/ublkb$1" ] || fail "kura block ublk --recover $1 printed '$dev'"
  say "kura block ublk --recover $1: $dev served again"
}

# kill_ublk — SIGKILL the ublk process; the device must stay (its requests wait).
kill_ublk() {
  local id=${ublk_dev#/dev/ublkb}
  kill -KILL "$ublk_pid"
  wait "$ublk_pid" 2>/dev/null
  ublk_pid=
  sleep 1
  [ -b "$ublk_dev" ] && [ -e "/sys/block/ublkb$id" ] || fail "$ublk_dev went away with its server"
  say "kura block ublk SIGKILLed; $ublk_dev stays"
}

check_ublk_recover() {
  local pool id src=$scratch/recover-src mnt=$scratch/mnt-recover writer i files=60
  server_start
  pool="kura://127.0.0.1:$server_port"
  volume_create rec "$volume_size" "$pool"
  volume_create other 64M "$pool"
  ublk_start rec "$pool"
  id=${ublk_dev#/dev/ublkb}
  # A live device is not taken over; nor is one with another volume's size.
  "$kura" block ublk --recover "$id" --volume rec --pool "$pool" >/dev/null 2>"$scratch/refused.log" &&
    fail "--recover of a live device succeeded"
  grep -q "live" "$scratch/refused.log" || { cat "$scratch/refused.log" >&2; fail "--recover of a live device: no clear error"; }
  # The files to write, on the scratch disk.
  mkdir -p "$src" "$mnt"
  for ((i = 0; i < files; i++)); do head -c $(((i % 7 + 1) * 96 * 1024)) /dev/urandom >"$src/f$i"; done
  (cd "$src" && sha256sum f* >"$scratch/recover.sums")
  mkfs.ext4 -q -F "$ublk_dev" || fail "mkfs.ext4"
  mount "$ublk_dev" "$mnt" || fail "mount"
  # The writer: each file copied and fsynced; any error ends it with a failure.
  (
    for ((i = 0; i < files; i++)); do
      cp "$src/f$i" "$mnt/f$i" && sync "$mnt/f$i" || { echo "writer: f$i failed" >&2; exit 1; }
    done
  ) &
  writer=$!
  sleep 1
  kill_ublk
  kill -0 "$writer" 2>/dev/null || fail "the writer ended while the device had no server (too fast? raise files)"
  sleep 2
  ublk_recover "$id" rec "$pool"
  # Once more, right away: killed during or just after its recovery.
  sleep 0.5
  kill_ublk
  "$kura" block ublk --recover "$id" --volume other --pool "$pool" >/dev/null 2>"$scratch/refused.log" &&
    fail "--recover with another volume succeeded"
  grep -q "size" "$scratch/refused.log" || { cat "$scratch/refused.log" >&2; fail "--recover with another volume: no clear error"; }
  ublk_recover "$id" rec "$pool"
  for ((i = 0; i < fs_check_timeout_s * 10; i++)); do kill -0 "$writer" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$writer" 2>/dev/null && { diagnose "the writer is stuck after the recovery"; fail "writer stuck"; }
  wait "$writer" || fail "the writer saw an I/O error across the kills and recoveries"
  umount "$mnt" || fail "umount"
  e2fsck -fn "$ublk_dev" >"$scratch/fsck.log" 2>&1 || { cat "$scratch/fsck.log" >&2; fail "e2fsck found errors"; }
  mount -o ro "$ublk_dev" "$mnt" || fail "mount ro"
  (cd "$mnt" && sha256sum -c --quiet "$scratch/recover.sums") || fail "files differ after the recoveries"
  umount "$mnt"
  say "ublk-recover: $files files written across two SIGKILLs and recoveries; fsck clean; all match"
  "$kura" block ublk-delete "$id" 2>"$scratch/refused.log" && fail "ublk-delete of a live device succeeded"
  grep -q "live" "$scratch/refused.log" || { cat "$scratch/refused.log" >&2; fail "ublk-delete of a live device: no clear error"; }
  ublk_stop
  # A device left waiting that will not be recovered: ublk-delete fails its waiting read.
  ublk_start rec "$pool"
  id=${ublk_dev#/dev/ublkb}
  kill_ublk
  dd if="$ublk_dev" of=/dev/null iflag=direct bs=4k count=1 skip=777 2>/dev/null &
  writer=$!
  sleep 1
  kill -0 "$writer" 2>/dev/null || fail "a read of the waiting device did not wait"
  "$kura" block ublk-delete "$id" || fail "kura block ublk-delete $id"
  for ((i = 0; i < 50; i++)); do [ ! -e "/sys/block/ublkb$id" ] && break; sleep 0.1; done
  [ ! -e "/sys/block/ublkb$id" ] || fail "ublk-delete left /sys/block/ublkb$id"
  wait "$writer" && fail "the read waiting in a deleted device succeeded"
  say "ublk-delete: the waiting device deleted, its waiting read failed"
  ublk_pid=
  stop_pid "kura serve" "$server_pid"
  server_pid=
}

# check_ublk_external memcached|redis — kura block ublk on a stock server.
check_ublk_external() {
  local pool
  external_start "$1"
  pool=$external_url
  volume_create "ext-raw" 64M "$pool"
  ublk_start "ext-raw" "$pool"
  fio --name=ublk-verify --filename="$ublk_dev" --ioengine=io_uring --direct=1 --rw=randwrite \
    --bsrange=512-128k --size=16M --iodepth=16 --fsync=16 --verify=crc32c \
    --verify_fatal=1 --do_verify=1 --randrepeat=1 --output-format=terse >"$scratch/fio.out" 2>&1 ||
    { cat "$scratch/fio.out"; fail "fio verify on $1"; }
  say "fio: 512 B - 128 KiB random writes with fsyncs verified on $1"
  ublk_stop
  volume_create "ext-ext4" "$volume_size" "$pool"
  ublk_start "ext-ext4" "$pool"
  fs_check write "$ublk_dev" ext4 "$scratch"
  ublk_stop
  ublk_start "ext-ext4" "$pool"
  fs_check verify "$ublk_dev" ext4 "$scratch"
  ublk_stop
  stop_pid "$1" "$external_pid"
  external_pid=
}

check_ublk_memcached() { check_ublk_external memcached; }
check_ublk_redis() { check_ublk_external redis; }

check_nbd_embedded() {
  local pool="embedded:$stores/nbd.kura?size=$store_size" fs i=0 port
  modprobe nbd nbds_max=4 2>/dev/null || true
  [ -b /dev/nbd0 ] || fail "no /dev/nbd0 (modprobe nbd)"
  for fs in $fs_types; do
    volume_create "vol-$fs" "$volume_size" "$pool"
  done
  nbd_start "$pool"
  port=${nbd_addr##*:}
  for fs in $fs_types; do
    nbd-client 127.0.0.1 "$port" "/dev/nbd$i" -N "vol-$fs" >/dev/null || fail "nbd-client -N vol-$fs"
    say "nbd-client: /dev/nbd$i on vol-$fs ($(blockdev --getsize64 /dev/nbd$i) bytes)"
    fs_check write "/dev/nbd$i" "$fs" "$scratch"
    nbd-client -d "/dev/nbd$i" >/dev/null || fail "nbd-client -d /dev/nbd$i"
    i=$((i + 1))
  done
  stop_pid "kura block nbd" "$nbd_pid"
  nbd_start "$pool" "$nbd_addr"
  i=0
  for fs in $fs_types; do
    nbd-client 127.0.0.1 "$port" "/dev/nbd$i" -N "vol-$fs" >/dev/null || fail "nbd-client -N vol-$fs"
    fs_check verify "/dev/nbd$i" "$fs" "$scratch"
    nbd-client -d "/dev/nbd$i" >/dev/null || fail "nbd-client -d /dev/nbd$i"
    i=$((i + 1))
  done
  stop_pid "kura block nbd" "$nbd_pid"
  nbd_pid=
}

# ---- main ----------------------------------------------------------------------------------

[ $# -gt 0 ] || { echo "usage: vm-block.sh ublk-raw|ublk-embedded|nbd-embedded|ublk-kura|ublk-recover|ublk-memcached|ublk-redis..." >&2; exit 2; }
[ "$(id -u)" = 0 ] || fail "needs root (block devices, mounts)"
setup_scratch
case " $* " in *" ublk-"*) modprobe ublk_drv 2>/dev/null; [ -e /dev/ublk-control ] || fail "no /dev/ublk-control" ;; esac
say "kernel $(uname -r); kura $kura; FS_CHECK_MB=$FS_CHECK_MB; stores in $stores"

failed=0
for check in "$@"; do
  case $check in
    ublk-raw | ublk-embedded | nbd-embedded | ublk-kura | ublk-recover | ublk-memcached | ublk-redis) ;;
    *) echo "vm-block: unknown check $check" >&2; exit 2 ;;
  esac
  say "=== $check"
  (
    trap cleanup EXIT
    "check_${check//-/_}"
  )
  status=$?
  if [ $status = 0 ]; then
    say "RESULT $check ok"
  else
    say "RESULT $check FAILED (status $status)"
    failed=1
  fi
done
[ -n "${VM_BLOCK_DISK:-}" ] && umount "$stores"
[ -z "${VM_BLOCK_DISK:-}" ] && rm -rf "$scratch"
exit $failed
