#!/usr/bin/env bash
# scripts/kernel-vm.sh 'COMMAND' — run COMMAND (bash) as root in a throw-away qemu VM that boots
# Debian's 6.12 kernel, and exit with COMMAND's status.
#
# Why: the host kernel has no ublk_drv and no nbd module. The VM's kernel has both (and loop,
# fuse, ext4, xfs), loaded on demand by `modprobe` — also the kernel's own automatic loading.
#
# Inside the VM:
#   - the host's root file system, shared read-only over 9p and chrooted into: every host binary
#     and the project's target directory are there at the same paths;
#   - /tmp and /var/tmp show the host's files, but writes there stay in the VM's RAM (an
#     overlay; a workspace or target directory under /tmp is thus visible too); /run and
#     /dev/shm are fresh tmpfs. Everything else is read-only;
#   - COMMAND starts in the caller's working directory, with HOME=/tmp and KURA_IN_VM=1;
#     host environment variables named in VM_ENV are passed in;
#   - network: loopback only (start servers inside the VM);
#   - with VM_DISK_MB set, an empty raw disk of that size as /dev/vda.
# Timings inside the VM are emulated (TCG): use it for correctness, benchmark on the host.
#
# Knobs: VM_DISK_MB (none), VM_MEM_MB (2048), VM_CPUS (2), VM_TIMEOUT_S (600, per boot),
#        VM_BOOT_TIMEOUT_S (180: a guest that has not reached COMMAND by then is booted
#        again, up to VM_BOOT_ATTEMPTS (3) times),
#        VM_ENV ("NAME1 NAME2": host variables to export inside), VM_ACCEL (tcg|kvm),
#        KURA_VM_CACHE (kernel cache, default /var/cache/kura-vm, filled by
#        scripts/vm-kernel-fetch.sh, which this script calls when the cache is empty).
# Exit status: COMMAND's; 124 when the VM timed out; 125 when the VM failed before COMMAND ended.
set -euo pipefail

usage="usage: scripts/kernel-vm.sh 'COMMAND'"
cmd=${1:?$usage}
[ $# -eq 1 ] || { echo "$usage" >&2; exit 2; }
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

say() { printf 'kernel-vm: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 125; }

command -v qemu-system-x86_64 >/dev/null ||
  die "qemu-system-x86_64 not found: apt-get install qemu-system-x86 (scripts/test.sh does)"
[ -x /bin/busybox ] && ! ldd /bin/busybox >/dev/null 2>&1 ||
  die "/bin/busybox missing or not static: apt-get install busybox-static (scripts/test.sh does)"
command -v cpio >/dev/null || die "cpio not found: apt-get install cpio"
command -v xz >/dev/null || die "xz not found: apt-get install xz-utils"

kdir=$("$here/vm-kernel-fetch.sh") || die "no VM kernel (see above)"
kver=$(basename "$kdir")
moddir=$kdir/lib/modules/$kver

work=$(mktemp -d "${TMPDIR:-/tmp}/kernel-vm.XXXXXX")
trap 'rm -rf "$work"' EXIT

# Modules needed before the chroot (to mount the shared root), in load order: modules.dep
# lists a module's dependencies so that loading them last-to-first works.
early_modules() {
  local name line path deps i
  for name in "$@"; do
    line=$(grep -E "(^|/)$name\.ko(\.[a-z]+)?:" "$moddir/modules.dep") ||
      die "module $name not in $moddir/modules.dep"
    path=${line%%:*}
    read -r -a deps <<<"${line#*:}"
    for ((i = ${#deps[@]} - 1; i >= 0; i--)); do echo "${deps[i]}"; done
    echo "$path"
  done | awk '!seen[$0]++'
}

build_initramfs() {
  local root=$work/initramfs m base
  mkdir -p "$root"/{bin,sbin,usr/bin,usr/sbin,mods,proc,sys,dev,host,scratch}
  cp /bin/busybox "$root/bin/"
  : >"$root/mods/order"
  for m in $(early_modules 9pnet_virtio 9p); do
    base=$(basename "$m"); base=${base%%.ko*}.ko
    case $m in
      *.xz) xz -dc "$moddir/$m" >"$root/mods/$base" ;;
      *.zst) zstd -qdc "$moddir/$m" >"$root/mods/$base" ;;
      *.gz) gzip -dc "$moddir/$m" >"$root/mods/$base" ;;
      *) cp "$moddir/$m" "$root/mods/$base" ;;
    esac
    echo "$base" >>"$root/mods/order"
  done
  # The kernel's own module requests (mount -t xfs, /dev/loop-control, ...) run
  # /sbin/modprobe in the initramfs root: hand them to the real modprobe in the chroot.
  printf '#!/bin/busybox sh\nexec /bin/busybox chroot /host /sbin/modprobe "$@"\n' >"$root/sbin/modprobe"
  chmod +x "$root/sbin/modprobe"
  write_command >"$root/cmd"
  write_init "$moddir" >"$root/init"
  chmod +x "$root/init"
  (cd "$root" && find . | cpio -o -H newc --quiet | gzip -1) >"$work/initramfs.gz"
}

# COMMAND, preceded by the variables named in VM_ENV, as a bash script.
write_command() {
  local name
  for name in ${VM_ENV:-}; do
    [[ $name =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || die "VM_ENV: bad variable name '$name'"
    [ -n "${!name+x}" ] && printf 'export %s=%q\n' "$name" "${!name}"
  done
  printf 'cd %q 2>/dev/null || cd /tmp\n' "$PWD"
  printf '%s\n' "$cmd"
}

write_init() {
  local moddir=$1
  cat <<INIT
#!/bin/busybox sh
/bin/busybox --install -s
export PATH=/sbin:/bin
fail() { echo "kernel-vm init: \$*"; echo KURA-VM-EXIT-STATUS=125; poweroff -f; }
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in \$(cat /mods/order); do insmod /mods/\$m || fail "insmod \$m"; done
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=524288 hostroot /host || fail "mount 9p"
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts; mount -t tmpfs shm /dev/shm
mount --rbind /dev /host/dev; mount -t proc proc /host/proc; mount -t sysfs sys /host/sys
# Modules first: the kernel cache may live under a directory a tmpfs covers next.
mount --bind /host$moddir/.. /host/lib/modules || fail "bind modules"
# /tmp and /var/tmp: the host's files stay visible (a workspace or target directory may live
# there) under a RAM overlay that takes the VM's writes; plain tmpfs if overlayfs fails.
chroot /host /sbin/modprobe overlay
mount -t tmpfs -o mode=755 scratch /scratch
for d in /tmp /var/tmp; do
  u=/scratch/\${d#/}; mkdir -p \$u/upper \$u/work; chmod 1777 \$u/upper
  mount -t overlay overlay -o lowerdir=/host\$d,upperdir=\$u/upper,workdir=\$u/work /host\$d ||
    { echo "kernel-vm init: overlay on \$d failed, using an empty tmpfs"; mount -t tmpfs -o mode=1777 tmp /host\$d; }
done
mount -t tmpfs -o mode=755 run /host/run || fail "tmpfs /run"
cp /cmd /host/tmp/.kura-vm-cmd
${VM_DISK_MB:+chroot /host /sbin/modprobe virtio_blk || fail "modprobe virtio_blk"}
ip link set lo up; hostname kura-vm
echo KURA-VM-CMD-START
chroot /host /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \\
  HOME=/tmp TERM=dumb LANG=C.UTF-8 KURA_IN_VM=1 /bin/bash /tmp/.kura-vm-cmd </dev/null
echo "KURA-VM-EXIT-STATUS=\$?"
sync; poweroff -f
INIT
}

# TCG by default: nested KVM on the machines this was written on aborts (MSR 0x10a) or crashes
# the guest in its first instructions, and TCG boots in seconds anyway. VM_ACCEL=kvm opts in.
accel_args() {
  case ${VM_ACCEL:-tcg} in
    tcg) echo "-accel tcg -cpu max" ;;
    kvm) echo "-accel kvm -cpu host" ;;
    *) die "VM_ACCEL must be tcg or kvm" ;;
  esac
}

build_initramfs

# One boot of the VM, its console in $work/console.log and COMMAND's output (what follows the
# start marker) on stdout as it comes. Sets vm_status to qemu's exit status (124: timed out),
# or to 99 when the guest did not reach COMMAND within VM_BOOT_TIMEOUT_S: an emulated guest
# sometimes stalls in early boot (RCU stalls, "timer wakeup didn't happen" on one vCPU) and
# would sit there until VM_TIMEOUT_S.
boot_once() {
  local disk=()
  if [ -n "${VM_DISK_MB:-}" ]; then
    rm -f "$work/disk.img"
    truncate -s "${VM_DISK_MB}M" "$work/disk.img"
    disk=(-drive "file=$work/disk.img,if=virtio,format=raw,cache=unsafe")
  fi
  : >"$work/console.log"
  # shellcheck disable=SC2046 # accel_args is a list of words
  timeout -k 10 "${VM_TIMEOUT_S:-600}" qemu-system-x86_64 $(accel_args) \
    -m "${VM_MEM_MB:-2048}" -smp "${VM_CPUS:-2}" -nodefaults -no-user-config -display none \
    -serial stdio -monitor none -no-reboot \
    -kernel "$kdir/vmlinuz" -initrd "$work/initramfs.gz" \
    -append "console=ttyS0 quiet panic=-1 mitigations=off" \
    -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
    "${disk[@]}" </dev/null 2>"$work/qemu.err" >"$work/console.log" &
  local qpid=$! waited=0
  # (grep alone: with pipefail, a reader that stops early would fail the pipe.)
  until grep -qa '^KURA-VM-CMD-START' "$work/console.log"; do
    kill -0 "$qpid" 2>/dev/null || break # qemu is gone: its status says why
    if [ "$waited" -ge "${VM_BOOT_TIMEOUT_S:-180}" ]; then
      kill "$qpid" 2>/dev/null
      wait "$qpid" 2>/dev/null
      vm_status=99
      return
    fi
    sleep 1
    waited=$((waited + 1))
  done
  tail -n +1 -f --pid="$qpid" "$work/console.log" |
    awk '{ sub(/\r$/, "") }
      # The status marker may follow output that did not end in a newline: print that part.
      p && match($0, /KURA-VM-EXIT-STATUS=[0-9]+$/) { if (RSTART > 1) print substr($0, 1, RSTART - 1); p = 0; next }
      p { print; fflush() }
      /^KURA-VM-CMD-START$/ { p = 1 }'
  wait "$qpid"
  vm_status=$?
}

set +e
attempts=${VM_BOOT_ATTEMPTS:-3}
for attempt in $(seq 1 "$attempts"); do
  boot_once
  [ "$vm_status" = 99 ] || break
  say "the guest did not reach COMMAND within ${VM_BOOT_TIMEOUT_S:-180} s (boot attempt $attempt of $attempts); last console lines:"
  tr -d '\r' <"$work/console.log" | tail -5 >&2
done
set -e

status=$(tr -d '\r' <"$work/console.log" | sed -n 's/.*KURA-VM-EXIT-STATUS=\([0-9][0-9]*\)$/\1/p' | tail -1)
if [ -n "$status" ]; then exit "$status"; fi
if [ "$vm_status" = 124 ]; then say "VM timed out after ${VM_TIMEOUT_S:-600} s"; fi
if [ "$vm_status" = 99 ]; then say "the guest did not boot in $attempts attempts"; exit 125; fi
say "the VM stopped before COMMAND finished (qemu status $vm_status); last console lines:"
tr -d '\r' <"$work/console.log" | tail -40 >&2
cat "$work/qemu.err" >&2
[ "$vm_status" = 124 ] && exit 124
exit 125
