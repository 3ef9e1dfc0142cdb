//! The kernel's `#!` rules (`binfmt_script`), for the preload, which runs scripts stored in
//! the file system itself (the kernel cannot read them).

/// The longest `#!` line read, as the kernel's (`BINPRM_BUF_SIZE`).
pub const SHEBANG_LINE_BYTES_MAX: usize = 256;

/// A `#!` line: the interpreter and its one optional argument.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shebang {
    pub interpreter: Vec<u8>,
    pub argument: Option<Vec<u8>>,
}

/// Parses the start of a file as the kernel's `binfmt_script` does: `None` when it is not a
/// script; `Err(ENOEXEC)` for a `#!` line with no interpreter, or whose interpreter the
/// [`SHEBANG_LINE_BYTES_MAX`]-byte buffer may have cut (no newline, space, tab or end of file
/// after it). Everything after the interpreter, spaces and tabs trimmed at both ends, is one
/// argument; a NUL ends the line, as in the kernel's C strings.
pub fn parse_shebang(head: &[u8]) -> Result<Option<Shebang>, i32> {
    let head = &head[..head.len().min(SHEBANG_LINE_BYTES_MAX)];
    let Some(rest) = head.strip_prefix(b"#!") else { return Ok(None) };
    // The kernel's buffer is zero-filled past the end of a short file: that NUL ends the line.
    let (line, ended) = match rest.iter().position(|&b| b == b'\n' || b == 0) {
        Some(end) => (&rest[..end], true),
        None => (rest, head.len() < SHEBANG_LINE_BYTES_MAX),
    };
    let blank = |b: &u8| *b == b' ' || *b == b'\t';
    let start = line.iter().position(|b| !blank(b)).unwrap_or(line.len());
    let line = &line[start..];
    if line.is_empty() || (!ended && !line.iter().any(blank)) {
        return Err(libc::ENOEXEC);
    }
    let end = line.iter().rposition(|b| !blank(b)).map_or(0, |i| i + 1);
    let line = &line[..end];
    let interp_end = line.iter().position(blank).unwrap_or(line.len());
    let interpreter = line[..interp_end].to_vec();
    let arg = &line[interp_end..];
    let arg_start = arg.iter().position(|b| !blank(b)).unwrap_or(arg.len());
    let arg = &arg[arg_start..];
    Ok(Some(Shebang { interpreter, argument: (!arg.is_empty()).then(|| arg.to_vec()) }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sb(i: &str, a: Option<&str>) -> Option<Shebang> {
        Some(Shebang { interpreter: i.as_bytes().to_vec(), argument: a.map(|a| a.as_bytes().to_vec()) })
    }

    #[test]
    fn shebang_lines_parse_as_the_kernels() {
        assert_eq!(parse_shebang(b"\x7fELF...."), Ok(None));
        assert_eq!(parse_shebang(b""), Ok(None));
        assert_eq!(parse_shebang(b"#!/bin/sh\necho"), Ok(sb("/bin/sh", None)));
        assert_eq!(parse_shebang(b"#! /usr/bin/env  python3 -u \t\nx"), Ok(sb("/usr/bin/env", Some("python3 -u"))));
        assert_eq!(parse_shebang(b"#!/kura/v/bin/python3\r\n"), Ok(sb("/kura/v/bin/python3\r", None)));
        assert_eq!(parse_shebang(b"#!\n"), Err(libc::ENOEXEC));
        assert_eq!(parse_shebang(b"#!   \t \n"), Err(libc::ENOEXEC));
        // The interpreter cut by the buffer: refused; an argument cut: kept, cut.
        let long = format!("#!/{}", "a".repeat(400));
        assert_eq!(parse_shebang(long.as_bytes()), Err(libc::ENOEXEC));
        let cut_arg = format!("#!/bin/sh {}", "b".repeat(400));
        let parsed = parse_shebang(cut_arg.as_bytes()).unwrap().unwrap();
        assert_eq!(parsed.interpreter, b"/bin/sh");
        assert_eq!(parsed.argument.unwrap().len(), SHEBANG_LINE_BYTES_MAX - b"#!/bin/sh ".len());
        // A one-line file without a newline: its end ends the line.
        assert_eq!(parse_shebang(b"#!/bin/true"), Ok(sb("/bin/true", None)));
        assert_eq!(parse_shebang(b"#!/bin/sh\0 -x\n"), Ok(sb("/bin/sh", None)));
        // A full buffer whose interpreter is followed by a blank is not cut.
        let spaced = format!("#!/bin/sh{}", " ".repeat(400));
        assert_eq!(parse_shebang(spaced.as_bytes()), Ok(sb("/bin/sh", None)));
    }
}
