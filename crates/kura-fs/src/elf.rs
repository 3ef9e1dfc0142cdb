//! What a shared library asks of the dynamic loader: its `DT_NEEDED` names and its search path
//! (`DT_RUNPATH`, else `DT_RPATH`), read from the file's dynamic section. The preload loads a
//! kura library's dependencies that sit in the mount (found through `$ORIGIN`) before the
//! library itself, since the loader cannot open files there.

/// Largest file parsed, bytes (shared libraries are far smaller).
pub const ELF_BYTES_MAX: usize = 1 << 30;
/// Dynamic entries read at most.
const DYNAMIC_ENTRIES_MAX: usize = 4096;

// Dynamic section tags (the preload also reads libc's loaded tables with them).
pub const DT_NULL: i64 = 0;
pub const DT_NEEDED: i64 = 1;
pub const DT_STRTAB: i64 = 5;
pub const DT_SYMTAB: i64 = 6;
pub const DT_STRSZ: i64 = 10;
pub const DT_RPATH: i64 = 15;
pub const DT_RUNPATH: i64 = 29;
pub const DT_GNU_HASH: i64 = 0x6fff_fef5;

/// A library's needs.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct DynamicNeeds {
    /// `DT_NEEDED` names, in order.
    pub needed: Vec<Vec<u8>>,
    /// The directories searched for them: `DT_RUNPATH`'s, or `DT_RPATH`'s when there is no
    /// `DT_RUNPATH` (as the loader), split at `:`; `$ORIGIN` left as written.
    pub search: Vec<Vec<u8>>,
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at.checked_add(2)?)?.try_into().ok()?))
}
fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at.checked_add(4)?)?.try_into().ok()?))
}
fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at.checked_add(8)?)?.try_into().ok()?))
}

/// The needs of a 64-bit little-endian ELF file (the preload's x86-64); `None` for anything
/// else or a malformed file. Pure: reads only `elf`.
pub fn dynamic_needs(elf: &[u8]) -> Option<DynamicNeeds> {
    if elf.len() > ELF_BYTES_MAX || elf.get(..4)? != b"\x7fELF" || *elf.get(4)? != 2 || *elf.get(5)? != 1 {
        return None;
    }
    let phoff = usize::try_from(u64_at(elf, 0x20)?).ok()?;
    let phentsize = usize::from(u16_at(elf, 0x36)?);
    let phnum = usize::from(u16_at(elf, 0x38)?);
    if phentsize < 56 {
        return None;
    }
    let mut loads: Vec<(u64, u64, u64)> = Vec::new(); // (vaddr, offset, filesz)
    let mut dynamic: Option<(usize, usize)> = None;
    for i in 0..phnum {
        let ph = phoff.checked_add(i.checked_mul(phentsize)?)?;
        let kind = u32_at(elf, ph)?;
        let offset = u64_at(elf, ph + 8)?;
        let vaddr = u64_at(elf, ph + 16)?;
        let filesz = u64_at(elf, ph + 32)?;
        match kind {
            libc::PT_LOAD => loads.push((vaddr, offset, filesz)),
            libc::PT_DYNAMIC => dynamic = Some((usize::try_from(offset).ok()?, usize::try_from(filesz).ok()?)),
            _ => {}
        }
    }
    let (dyn_off, dyn_size) = dynamic?;
    let entries = elf.get(dyn_off..dyn_off.checked_add(dyn_size)?)?;
    let (mut strtab, mut strsz) = (None, None);
    let (mut needed, mut rpath, mut runpath) = (Vec::new(), None, None);
    for entry in entries.chunks_exact(16).take(DYNAMIC_ENTRIES_MAX) {
        let tag = u64_at(entry, 0)? as i64;
        let val = u64_at(entry, 8)?;
        match tag {
            DT_NULL => break,
            DT_NEEDED => needed.push(val),
            DT_STRTAB => strtab = Some(val),
            DT_STRSZ => strsz = Some(val),
            DT_RPATH => rpath = Some(val),
            DT_RUNPATH => runpath = Some(val),
            _ => {}
        }
    }
    // The string table's address, to a file offset through the segment that holds it.
    let strtab = strtab?;
    let (vaddr, offset, _) = loads.iter().copied().find(|&(v, _, size)| strtab >= v && strtab - v < size)?;
    let table_off = usize::try_from(strtab - vaddr + offset).ok()?;
    let table = elf.get(table_off..table_off.checked_add(usize::try_from(strsz?).ok()?)?)?;
    let string = |at: u64| -> Option<Vec<u8>> {
        let rest = table.get(usize::try_from(at).ok()?..)?;
        Some(rest[..rest.iter().position(|&b| b == 0)?].to_vec())
    };
    let needed = needed.into_iter().map(string).collect::<Option<Vec<_>>>()?;
    let search = match runpath.or(rpath) {
        Some(at) => string(at)?.split(|&b| b == b':').filter(|d| !d.is_empty()).map(<[u8]>::to_vec).collect(),
        None => Vec::new(),
    };
    Some(DynamicNeeds { needed, search })
}

/// `dir` with `$ORIGIN` / `${ORIGIN}` replaced by `origin` (the directory of the library);
/// `None` when it has no `$ORIGIN` (a directory the loader finds without help).
pub fn expand_origin(dir: &[u8], origin: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(dir.len() + origin.len());
    let mut rest = dir;
    let mut found = false;
    while let Some(i) = rest.iter().position(|&b| b == b'$') {
        out.extend_from_slice(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(r) = after.strip_prefix(b"{ORIGIN}").or_else(|| after.strip_prefix(b"ORIGIN")) {
            out.extend_from_slice(origin);
            rest = r;
            found = true;
        } else {
            out.push(b'$');
            rest = after;
        }
    }
    out.extend_from_slice(rest);
    found.then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Debian's libm: it needs libc.so.6 and has no search path.
    #[test]
    fn a_system_library_needs_libc() {
        let Ok(bytes) = std::fs::read("/lib/x86_64-linux-gnu/libm.so.6") else { return };
        let needs = dynamic_needs(&bytes).expect("libm parses");
        assert!(needs.needed.iter().any(|n| n == b"libc.so.6"), "{needs:?}");
    }

    /// A library gcc links against another with a `$ORIGIN` run path (skipped without gcc).
    #[test]
    fn runpath_and_needed_of_a_library_gcc_links() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("b.c"), "int b(void) { return 1; }").unwrap();
        std::fs::write(d.join("a.c"), "int b(void); int a(void) { return b(); }").unwrap();
        let gcc = |args: &[&str]| std::process::Command::new("gcc").current_dir(d).args(args).status();
        match gcc(&["-shared", "-fPIC", "-o", "libb.so", "-Wl,-soname,libb.so", "b.c"]) {
            Ok(status) if status.success() => {}
            _ => return kura_testkit::skip("no gcc"),
        }
        assert!(gcc(&["-shared", "-fPIC", "-o", "liba.so", "a.c", "-L.", "-lb", "-Wl,-rpath,$ORIGIN/sub:/opt/x", "-Wl,--enable-new-dtags"]).unwrap().success());
        let needs = dynamic_needs(&std::fs::read(d.join("liba.so")).unwrap()).unwrap();
        assert!(needs.needed.contains(&b"libb.so".to_vec()), "{needs:?}");
        assert_eq!(needs.search, vec![b"$ORIGIN/sub".to_vec(), b"/opt/x".to_vec()]);
    }

    #[test]
    fn truncated_and_foreign_files_are_none() {
        assert_eq!(dynamic_needs(b""), None);
        assert_eq!(dynamic_needs(b"#!/bin/sh\n"), None);
        if let Ok(bytes) = std::fs::read("/lib/x86_64-linux-gnu/libm.so.6") {
            for len in [16, 64, 200, 4096] {
                let _ = dynamic_needs(&bytes[..len]);
            }
        }
    }

    #[test]
    fn origin_is_expanded_in_both_spellings() {
        assert_eq!(expand_origin(b"$ORIGIN/../lib", b"/kura/a"), Some(b"/kura/a/../lib".to_vec()));
        assert_eq!(expand_origin(b"${ORIGIN}/x:$LIB", b"/o"), Some(b"/o/x:$LIB".to_vec()));
        assert_eq!(expand_origin(b"/usr/lib", b"/o"), None);
        assert_eq!(expand_origin(b"$PLATFORM", b"/o"), None);
    }

    proptest::proptest! {
        /// Any bytes after the magic, and a real library with bytes changed anywhere in its
        /// headers and dynamic section: an answer or None, never a panic.
        #[test]
        fn never_panics(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512),
                        edits in proptest::collection::vec((proptest::prelude::any::<usize>(), proptest::prelude::any::<u8>()), 1..16)) {
            let mut elf = b"\x7fELF\x02\x01".to_vec();
            elf.extend_from_slice(&bytes);
            let _ = dynamic_needs(&elf);
            if let Ok(mut lib) = std::fs::read("/lib/x86_64-linux-gnu/libm.so.6") {
                let headers = lib.len().min(1 << 16);
                for (at, byte) in edits {
                    lib[at % headers] = byte;
                }
                let _ = dynamic_needs(&lib);
            }
        }
    }
}
