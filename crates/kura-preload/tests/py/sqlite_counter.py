"""One of several processes sharing a sqlite database (fcntl locks; the journal mode is
$SQLITE_JOURNAL_MODE, default DELETE, a rollback journal; WAL adds the shared-memory index;
$SQLITE_MMAP_SIZE reads pages through a shared mapping):
`sqlite_counter.py DB init 0` makes it; `DB NAME N` runs N transactions that each add one to a
counter and a row to a log; `DB watch N` reads N times, checking in each read that the counter
equals the rows and never went down, and prints "consistent"; `DB check 0` prints the counter,
the rows and integrity_check."""
import sqlite3, sys, os, time
path, who, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
db = sqlite3.connect(path, timeout=60, isolation_level=None)
db.execute("PRAGMA journal_mode=" + os.environ.get("SQLITE_JOURNAL_MODE", "DELETE"))
# $SQLITE_MMAP_SIZE > 0: pages are read through a shared mapping of the database file.
db.execute("PRAGMA mmap_size=" + os.environ.get("SQLITE_MMAP_SIZE", "0"))
if who == "init":
    db.execute("CREATE TABLE IF NOT EXISTS c (k INTEGER PRIMARY KEY, n INTEGER)")
    db.execute("CREATE TABLE IF NOT EXISTS log (who TEXT, i INTEGER, pad TEXT)")
    db.execute("INSERT OR REPLACE INTO c VALUES (1, 0)")
    sys.exit(0)
if who == "check":
    print(db.execute("SELECT n FROM c WHERE k=1").fetchone()[0], db.execute("SELECT count(*) FROM log").fetchone()[0], db.execute("PRAGMA integrity_check").fetchone()[0])
    sys.exit(0)
if who == "watch":
    last = 0
    for i in range(n):
        db.execute("BEGIN")
        counter = db.execute("SELECT n FROM c WHERE k=1").fetchone()[0]
        rows = db.execute("SELECT count(*) FROM log").fetchone()[0]
        db.execute("COMMIT")
        assert counter == rows, f"read {i}: counter {counter} but {rows} rows"
        assert counter >= last, f"read {i}: counter went from {last} to {counter}"
        last = counter
        time.sleep(0.002)
    print("consistent")
    sys.exit(0)
for i in range(n):
    while True:
        try:
            db.execute("BEGIN IMMEDIATE")
            break
        except sqlite3.OperationalError:
            time.sleep(0.001)
    db.execute("UPDATE c SET n = n + 1 WHERE k = 1")
    db.execute("INSERT INTO log VALUES (?, ?, ?)", (who, i, "x" * (i % 300)))
    db.execute("COMMIT")
