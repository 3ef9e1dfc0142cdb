//! Benchmark results as JSON: printed pretty on stdout and, when asked, saved to a file.

use std::fs;
use std::io::{self, Write};
use std::path::Path;

use serde::Serialize;
use serde_json::Value;

/// Writes `value` pretty-printed, with a final newline.
pub fn write_pretty(out: &mut impl Write, value: &Value) -> io::Result<()> {
    serde_json::to_writer_pretty(&mut *out, value)?;
    out.write_all(b"\n")
}

/// Prints `value` pretty on stdout and, with `path`, writes the same text to that file
/// (creating its parent directories).
pub fn emit(value: &Value, path: Option<&Path>) -> io::Result<()> {
    let mut text = Vec::new();
    write_pretty(&mut text, value)?;
    {
        let mut stdout = io::stdout().lock();
        stdout.write_all(&text)?;
        stdout.flush()?;
    }
    if let Some(path) = path {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            fs::create_dir_all(dir)?;
        }
        fs::write(path, &text).map_err(|e| {
            io::Error::new(e.kind(), format!("cannot write {}: {e}", path.display()))
        })?;
    }
    Ok(())
}

/// [`emit`] for anything serialisable.
pub fn emit_serialize<T: Serialize + ?Sized>(value: &T, path: Option<&Path>) -> io::Result<()> {
    let value = serde_json::to_value(value).map_err(io::Error::other)?;
    emit(&value, path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn pretty_text_round_trips() {
        let value = json!({"bench": "fio", "iops": 1234.5, "lat_us": {"p50": 80, "p99": 200}});
        let mut out = Vec::new();
        write_pretty(&mut out, &value).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.ends_with("}\n") && text.contains("\n  \"bench\""),
            "{text}"
        );
        assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), value);
    }

    #[test]
    fn emit_writes_the_file_too() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nested/result.json");
        let value = json!({"ok": true});
        emit(&value, Some(&path)).unwrap();
        let saved: Value = serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(saved, value);

        #[derive(Serialize)]
        struct Row {
            name: &'static str,
        }
        emit_serialize(&[Row { name: "a" }], Some(&path)).unwrap();
        assert!(
            fs::read_to_string(&path)
                .unwrap()
                .contains("\"name\": \"a\"")
        );
    }
}
