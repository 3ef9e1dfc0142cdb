//! Files open in other processes: a file unlinked while open stays readable until closed.
//!
//! Every process (every file system instance in it) that opens a regular file records itself
//! in the file's inode record (`Inode::openers`) at its first open of the file and removes
//! itself after its last close, both by compare-and-swap on the record: in the swap of the
//! close's write-back, or, for a file closed with nothing to write back, in a batch at the
//! next write-back pass, `sync`, `fork`, `exec` or exit ([`Fs::leave_lingering`]; the file
//! counts as open here until then, and an open before needs no swap). Dropping a file's last
//! name deletes its data only when no other live process is recorded; otherwise the inode
//! stays (with no name, `nlink` 0), goes on the orphan list, and the last recorded process to
//! close it deletes it. Because the unlink and the openers change one record by
//! compare-and-swap, an open and an unlink of the same file are ordered one way or the other.
//! A file made by `open` with `O_TMPFILE` ([`Fs::create_unnamed`]) is such a file from its
//! start, until a link gives it a name ([`Fs::link`]).
//!
//! A process killed while it has files open never removes itself. Openers on this host are
//! checked for life (`/proc/PID/stat`: same pid and start time, same boot) whenever a record is
//! changed, and every file system instance that starts sweeps the orphan list, deleting
//! orphans whose openers are all dead. Openers on other hosts cannot be checked and are kept.

use std::sync::OnceLock;

use crate::error::{FsError, Result};
use crate::kv::Cond;
use crate::layout::{Inode, OPENERS_MAX, ORPHANS_MAX, Opener, Orphans};
use crate::{Fs, process_id};

/// Compare-and-swap attempts on the orphan list before giving up.
const ORPHAN_CAS_RETRIES_MAX: usize = 64;

/// This host's identity: hashes of its machine id and of its boot id.
fn host() -> (u64, u64) {
    static HOST: OnceLock<(u64, u64)> = OnceLock::new();
    *HOST.get_or_init(|| {
        let read = |path: &str| std::fs::read(path).ok().filter(|b| !b.trim_ascii().is_empty());
        let machine = read("/etc/machine-id").or_else(|| read("/var/lib/dbus/machine-id")).or_else(|| read("/proc/sys/kernel/hostname")).unwrap_or_default();
        let boot = read("/proc/sys/kernel/random/boot_id").unwrap_or_default();
        (xxhash_rust::xxh3::xxh3_64(machine.trim_ascii()), xxhash_rust::xxh3::xxh3_64(boot.trim_ascii()))
    })
}

/// A process's start time in clock ticks since boot (field 22 of `/proc/PID/stat`), or
/// `None` when there is no such process.
pub(crate) fn start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read(format!("/proc/{pid}/stat")).ok()?;
    parse_start_ticks(&stat)
}

/// Field 22 of a `/proc/PID/stat` line; the command name (field 2) is in parentheses and may
/// itself contain spaces and parentheses, so fields are counted after its last `)`.
fn parse_start_ticks(stat: &[u8]) -> Option<u64> {
    let after = stat.iter().rposition(|&b| b == b')')?;
    let fields = std::str::from_utf8(&stat[after + 1..]).ok()?;
    fields.split_ascii_whitespace().nth(19)?.parse().ok()
}

/// Whether two openers are one process (possibly two file system instances in it).
fn same_process(a: &Opener, b: &Opener) -> bool {
    (a.machine, a.boot, a.pid, a.start_ticks) == (b.machine, b.boot, b.pid, b.start_ticks)
}

/// Whether `opener` may still be running, as seen from `me` (a process on this host).
fn alive(opener: &Opener, me: &Opener) -> bool {
    if opener.machine != me.machine {
        return true;
    }
    if opener.boot != me.boot {
        return false;
    }
    if opener.pid == me.pid {
        return opener.start_ticks == me.start_ticks;
    }
    start_ticks(opener.pid) == Some(opener.start_ticks)
}

impl Fs {
    /// This file system instance in this process, as recorded in the files it opens.
    pub(crate) fn opener(&self) -> Opener {
        let pid = process_id();
        let mut cached = self.opener.lock();
        match *cached {
            Some(me) if me.pid == pid => me,
            _ => {
                let (machine, boot) = host();
                let me = Opener { machine, boot, pid, start_ticks: start_ticks(pid).unwrap_or(0), instance: self.instance };
                *cached = Some(me);
                me
            }
        }
    }

    /// Drops the openers of `inode` that are dead (keeping `me` when present).
    fn prune_openers(inode: &mut Inode, me: &Opener) {
        inode.openers.retain(|o| o == me || alive(o, me));
    }

    /// Records this process as having `ino` open. Returns whether it is recorded (not when the
    /// record already lists [`OPENERS_MAX`] processes) and whether other live processes have
    /// the file open too. A file that lost its last name before this (an unlink between the
    /// lookup and the open) is `NotFound`, unless this process already has it open (another
    /// instance, e.g. before an `exec` that kept the descriptor).
    ///
    /// `also`: a data value read in the round trip of the swap (see
    /// [`Fs::update_inode_reading`]). Also returns the record as swapped in, and the value read.
    pub(crate) fn register_opener(&self, ino: u64, also: Option<&[u8]>) -> Result<(bool, bool, (Inode, crate::kv::AlsoRead))> {
        self.register_opener_as(ino, false, also)
    }

    /// `inherited`: the process got the file open from its parent (`fork`), which is recorded,
    /// so a file already without a name is registered too.
    fn register_opener_as(&self, ino: u64, inherited: bool, also: Option<&[u8]>) -> Result<(bool, bool, (Inode, crate::kv::AlsoRead))> {
        let me = self.opener();
        let mut recorded = false;
        let (inode, read) = self.update_inode_reading(ino, |inode| {
            if inode.nlink == 0 && !inherited && !inode.openers.iter().any(|o| same_process(o, &me)) {
                return Err(FsError::NotFound);
            }
            Self::prune_openers(inode, &me);
            recorded = inode.openers.contains(&me);
            if !recorded && inode.openers.len() < OPENERS_MAX {
                inode.openers.push(me);
                recorded = true;
            }
            Ok(())
        }, also)?;
        if !recorded {
            tracing::warn!(ino, openers_max = OPENERS_MAX, "too many processes have this file open: an unlink elsewhere will not wait for this one");
        }
        let elsewhere = !recorded || inode.openers.iter().any(|o| !same_process(o, &me));
        Ok((recorded, elsewhere, (inode, read)))
    }

    /// In the child of a `fork`: records this process in every file it inherited open (and
    /// recorded in the parent), so the file outlives the parent's last close if another
    /// process removes it. A file deleted before this (the parent closed it after an unlink
    /// elsewhere) is left unregistered; its descriptors then answer `ESTALE`.
    pub fn register_inherited_opens(&self) -> Result<()> {
        self.forget_lingering();
        let nodes: Vec<_> = self.nodes.lock().values().cloned().collect();
        let mut first_error = None;
        for node in nodes {
            let mut registered = node.registered.lock();
            // Registered implies open here now (`forget_lingering` cleared the parent's records
            // of files it had closed): a last close changes it under the same lock.
            if !*registered {
                continue;
            }
            match self.register_opener_as(node.ino, true, None) {
                Ok((recorded, _, _)) => *registered = recorded,
                Err(FsError::NotFound) => *registered = false,
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Removes this process from the openers of `ino`; deletes the file when that leaves it
    /// with no name and no live opener.
    pub(crate) fn unregister_opener(&self, ino: u64) -> Result<()> {
        let me = self.opener();
        let inode = match self.update_inode(ino, |inode| {
            Self::leave_openers(inode, &me);
            Ok(())
        }) {
            Ok(inode) => inode,
            Err(FsError::NotFound) => return Ok(()),
            Err(e) => return Err(e),
        };
        self.after_leaving(&inode)
    }

    /// Removes `me` from the openers in `inode` (and the dead ones): the change
    /// [`Fs::unregister_opener`] swaps in, which the write-back of a last close makes together
    /// with its own.
    pub(crate) fn leave_openers(inode: &mut Inode, me: &Opener) {
        Self::prune_openers(inode, me);
        inode.openers.retain(|o| o != me);
    }

    /// After this process left the openers of `inode` (the record as swapped in): deletes the
    /// file when that left it with no name and no live opener.
    pub(crate) fn after_leaving(&self, inode: &Inode) -> Result<()> {
        if inode.nlink == 0 && inode.openers.is_empty() {
            self.delete_inode(inode)?;
            self.remove_orphan(inode.ino)?;
        }
        Ok(())
    }

    /// Whether processes other than this one are recorded (alive) as having `inode` open.
    pub(crate) fn open_elsewhere(&self, inode: &Inode) -> bool {
        let me = self.opener();
        inode.openers.iter().any(|o| *o != me && alive(o, &me))
    }

    /// Whether another live process is recorded as having `inode` open (other file system
    /// instances of this process, such as the one before an `exec`, do not count).
    pub(crate) fn open_in_another_process(&self, inode: &Inode) -> bool {
        let me = self.opener();
        inode.openers.iter().any(|o| !same_process(o, &me) && alive(o, &me))
    }

    /// Puts `ino` on the orphan list (a file without names that is still open somewhere).
    pub(crate) fn add_orphan(&self, ino: u64) -> Result<()> {
        self.update_orphans(|list| {
            if list.inos.contains(&ino) {
                return false;
            }
            if list.inos.len() >= ORPHANS_MAX {
                tracing::warn!(ino, orphans_max = ORPHANS_MAX, "the orphan list is full: this unlinked file leaks if its last opener dies");
                return false;
            }
            list.inos.push(ino);
            true
        })
    }

    /// Takes `ino` off the orphan list (deleted, or given a name again).
    pub(crate) fn remove_orphan(&self, ino: u64) -> Result<()> {
        self.update_orphans(|list| {
            let before = list.inos.len();
            list.inos.retain(|&i| i != ino);
            list.inos.len() != before
        })
    }

    /// Applies `change` to the orphan list by compare-and-swap (`change` says whether it
    /// changed anything).
    fn update_orphans(&self, mut change: impl FnMut(&mut Orphans) -> bool) -> Result<()> {
        let key = self.keys.orphans();
        for _ in 0..ORPHAN_CAS_RETRIES_MAX {
            let (mut list, version) = match self.kv.get_versioned(&key)? {
                Some((bytes, version)) => (Orphans::decode(&key, &bytes)?, Some(version)),
                None => (Orphans::default(), None),
            };
            if !change(&mut list) {
                return Ok(());
            }
            let cond = version.map_or(Cond::Absent, Cond::Version);
            let done = if list.inos.is_empty() && version.is_some() {
                self.kv.delete_cond(&key, cond)?
            } else {
                self.kv.put_cond(&key, &list.encode(), cond)?.is_some()
            };
            if done {
                return Ok(());
            }
        }
        Err(FsError::Io("orphan list: too much contention".into()))
    }

    /// Deletes the orphans whose openers are all dead (processes killed while they had an
    /// unlinked file open). Returns how many were deleted.
    pub fn sweep_orphans(&self) -> Result<usize> {
        let stored = self.kv.get_versioned(&self.keys.orphans())?;
        self.sweep_orphan_list(stored)
    }

    /// [`Fs::sweep_orphans`] of the list as just read (`None`: there is none).
    pub(crate) fn sweep_orphan_list(&self, stored: Option<(Vec<u8>, u64)>) -> Result<usize> {
        let key = self.keys.orphans();
        let Some((bytes, _)) = stored else { return Ok(0) };
        let list = Orphans::decode(&key, &bytes)?;
        let me = self.opener();
        let mut deleted = 0;
        for ino in list.inos {
            // Every process that starts looks at the list: the record is written only when an
            // opener died, not for orphans other processes still legitimately hold.
            let inode = match self.load_inode(ino) {
                Ok((inode, _)) if inode.openers.iter().all(|o| alive(o, &me)) => Ok(inode),
                Ok(_) => self.update_inode(ino, |inode| {
                    Self::prune_openers(inode, &me);
                    Ok(())
                }),
                Err(e) => Err(e),
            };
            let inode = match inode {
                Ok(inode) => inode,
                Err(FsError::NotFound) => {
                    self.remove_orphan(ino)?;
                    continue;
                }
                Err(e) => return Err(e),
            };
            if inode.nlink == 0 && inode.openers.is_empty() {
                self.delete_inode(&inode)?;
                self.remove_orphan(ino)?;
                deleted += 1;
            } else if inode.nlink > 0 {
                // An `O_TMPFILE` file its opener linked, which died before it took the file
                // off the list: a file with a name is no orphan.
                self.remove_orphan(ino)?;
            }
        }
        if deleted > 0 {
            tracing::info!(deleted, "deleted unlinked files whose last openers died");
        }
        Ok(deleted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_ticks_of_a_stat_line() {
        let line = b"1234 (a (weird) name) S 1 1234 1234 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10";
        assert_eq!(parse_start_ticks(line), Some(987_654));
        assert_eq!(parse_start_ticks(b"garbage"), None);
        assert!(start_ticks(std::process::id()).is_some());
    }

    #[test]
    fn life_of_openers() {
        let (machine, boot) = host();
        let pid = std::process::id();
        let me = Opener { machine, boot, pid, start_ticks: start_ticks(pid).unwrap(), instance: 1 };
        assert!(alive(&Opener { instance: 2, ..me }, &me), "another instance of this process");
        assert!(!alive(&Opener { start_ticks: me.start_ticks + 1, ..me }, &me), "an earlier process with this pid");
        assert!(!alive(&Opener { boot: boot ^ 1, ..me }, &me), "an earlier boot");
        assert!(alive(&Opener { machine: machine ^ 1, boot: 0, pid: u32::MAX, ..me }, &me), "another host cannot be checked");
        let parent = std::os::unix::process::parent_id();
        assert!(alive(&Opener { pid: parent, start_ticks: start_ticks(parent).unwrap(), ..me }, &me));
        assert!(!alive(&Opener { pid: u32::MAX - 1, ..me }, &me), "no such process");
    }
}
