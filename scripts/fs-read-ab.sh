#!/bin/bash
# Read-only metadata-heavy programs on the kura file system through a local kura server (the
# default pool of `kura fs run`), for two builds alternated, with ext4 in each round: the
# figures of the README's table of copies kept while the servers' change count stands still.
#
#   scripts/fs-read-ab.sh OLD_DIR NEW_DIR WORK_DIR [ROUNDS]
#
# OLD_DIR and NEW_DIR each hold a `kura` binary and its `libkura_fs.so` (a target/release of
# each build); WORK_DIR is scratch space on the disk to measure (ext4 runs there too). Each
# round and build gets a fresh data directory; the tree (1,000 files in 40 directories, a git
# repository) is made, looked at once, then timed; find, ls -lR and du are timed again at the
# end (new processes over an unchanged tree), and once more while another process appends a
# line to a log beside the tree every millisecond (`+writer`: the pool changes all along, but
# not the tree). Prints each run's lines (ms; stat lines in µs), prefixed with the build and
# round.
set -euo pipefail
[ $# -ge 3 ] || { sed -n 2,12p "$0"; exit 2; }
OLD=$(realpath "$1"); NEW=$(realpath "$2"); WORK=$(realpath -m "$3"); ROUNDS=${4:-3}
SCRIPTS=$(dirname "$(realpath "$0")")
mkdir -p "$WORK"; cd "$WORK"

cat > work.sh <<'EOS'
set -e
B=$1
t() { local s=$(date +%s%N); "$@" >/dev/null 2>&1; local e=$(date +%s%N); printf "%-28s %8.1f ms\n" "${P:-}$*" $(( (e-s)/100000 ))e-1; }
if [ ! -d $B/tree ]; then
  mkdir -p $B/tree; cd $B/tree
  for d in $(seq 1 20); do mkdir -p d$d/sub; for f in $(seq 1 50); do echo "file $d $f" > d$d/sub/f$f.txt; done; done
  git init -q . && git add -A && git -c user.email=a@b -c user.name=a commit -qm x
fi
cd $B/tree
t find . -type f
t ls -lR .
t du -s .
t git status
t tar cf /dev/null .
python3 "$(dirname "$0")/st.py" $B/tree
# The same read-only programs again, each a new process, nothing changed in between.
t find . -type f
t ls -lR .
t du -s .
# Once more while another process appends to a log beside the tree.
rm -f $B.stop
python3 -c "
import os, sys, time
f = open(sys.argv[1], 'a')
while not os.path.exists(sys.argv[2]):
    f.write('a line of the log\n'); f.flush(); time.sleep(0.001)
" $B.log $B.stop &
sleep 0.5
P="+writer " t find . -type f
P="+writer " t ls -lR .
P="+writer " t du -s .
touch $B.stop; wait
rm -f $B.stop $B.log
EOS
cp "$SCRIPTS/fs-stat-loop.py" st.py

for r in $(seq 1 "$ROUNDS"); do
  for b in old new; do
    if [ $b = old ]; then K=$OLD; else K=$NEW; fi
    D=$WORK/data-$b-$r; rm -rf "$D"
    "$K/kura" fs run --data-dir "$D" --store-size 1G --fuse off -- \
      bash -c "bash $WORK/work.sh /kura/w >/dev/null; bash $WORK/work.sh /kura/w" | sed "s/^/$b $r /"
    rm -rf "$D"
  done
  E=$WORK/ext4-$r; rm -rf "$E"; mkdir -p "$E"
  bash "$WORK/work.sh" "$E" >/dev/null; bash "$WORK/work.sh" "$E" | sed "s/^/ext4 $r /"; rm -rf "$E"
done
