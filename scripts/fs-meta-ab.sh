#!/bin/bash
# Metadata-heavy programs on the kura file system through a local kura server (the default
# pool of `kura fs run`), for two builds alternated, with ext4 in each round: the figures of
# the README's "Changes to names" table.
#
#   scripts/fs-meta-ab.sh OLD_DIR NEW_DIR WORK_DIR [ROUNDS]
#
# OLD_DIR and NEW_DIR each hold a `kura` binary and its `libkura_fs.so` (a target/release of
# each build); WORK_DIR is scratch space on the disk to measure (ext4 runs there too). Each
# round and build gets a fresh data directory. Prints one line per program and build: the
# median of the rounds, in ms (the stat lines in µs).
set -euo pipefail
[ $# -ge 3 ] || { sed -n 2,11p "$0"; exit 2; }
OLD=$(realpath "$1"); NEW=$(realpath "$2"); WORK=$(realpath -m "$3"); ROUNDS=${4:-3}
SCRIPTS=$(dirname "$(realpath "$0")")
mkdir -p "$WORK"; cd "$WORK"

# The tree: 20 directories, each with a subdirectory of 50 small files (1,000 files).
if [ ! -f tree.tar ]; then
  rm -rf src && mkdir -p src/tree
  for d in $(seq 1 20); do mkdir -p src/tree/d$d/sub; for f in $(seq 1 50); do echo "file $d $f" > src/tree/d$d/sub/f$f.txt; done; done
  tar cf tree.tar -C src tree
fi

cat > rename.py <<'EOF'
import os, sys
b = sys.argv[1]
for d in sorted(os.listdir(b)):
    p = os.path.join(b, d, "sub")
    for f in os.listdir(p):
        os.rename(os.path.join(p, f), os.path.join(p, f + ".r"))
EOF
cp "$SCRIPTS/fs-stat-loop.py" stat.py
cat > programs.sh <<'EOF'
#!/bin/bash
# programs.sh BASE WORK: each program timed once, under BASE (a kura path or an ext4 directory)
set -e
B=$1; W=$2
t() { local label=$1; shift; local s=$(date +%s%N); "$@" >/dev/null 2>&1; local e=$(date +%s%N); printf "%-28s %8.1f ms\n" "$label" $(( (e-s)/100000 ))e-1; }
mkdir -p $B/w && cd $B/w
t "tar xf" tar xf $W/tree.tar
t "cp -a" cp -a tree copy
t "rename x1000" python3 $W/rename.py copy
t "find|xargs touch" sh -c "find copy -type f | xargs touch"
t "rm -r" rm -r tree copy
mkdir -p $B/r && cd $B/r && tar xf $W/tree.tar && python3 $W/stat.py $B/r/tree
EOF

mkdir -p runs
for r in $(seq 1 "$ROUNDS"); do
  for v in old new; do
    bin=$OLD; [ $v = new ] && bin=$NEW
    data=$WORK/runs/$v.$r.data; rm -rf "$data"; mkdir -p "$data"
    "$bin/kura" fs run --data-dir "$data" --fuse off -- bash "$WORK/programs.sh" /kura "$WORK" > "runs/$v.$r.txt"
    rm -rf "$data"
  done
  rm -rf "runs/ext4.$r.dir"; mkdir -p "runs/ext4.$r.dir"
  bash programs.sh "$WORK/runs/ext4.$r.dir" "$WORK" > "runs/ext4.$r.txt"; rm -rf "runs/ext4.$r.dir"
done
median() { sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
for label in "tar xf" "cp -a" "rename x1000" "find|xargs touch" "rm -r" "stat " "open+read+close" "stat-missing"; do
  line="$label:"
  for v in old new ext4; do
    line="$line $v $(grep -h "^$label" runs/$v.*.txt | awk '{print $(NF-1)}' | median)"
  done
  echo "$line"
done
