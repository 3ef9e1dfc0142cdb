//! Certificates for TLS tests, made with the `openssl` CLI (the tool users make theirs with).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::require_cmd;

/// In a temporary directory: a CA (`ca.pem`), server certificates for `localhost` and
/// 127.0.0.1 it signed (`server.pem` and `server2.pem`, keys `*-key.pem`), a client
/// certificate it signed (`client.pem`), and a client certificate no one signed
/// (`rogue.pem`). Every file is readable by anyone (memcached drops root with `-u`).
pub struct TestCerts {
    dir: tempfile_dir::Dir,
}

impl TestCerts {
    /// `Err` (a reason to skip) when `openssl` is missing.
    pub fn make() -> Result<Self, String> {
        require_cmd("openssl")?;
        let dir = tempfile_dir::Dir::new()?;
        let ssl = |args: &[&str]| {
            let out = Command::new("openssl").args(args).current_dir(dir.path()).stdin(Stdio::null()).output().expect("run openssl");
            assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        };
        let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
        ssl(&[&["req", "-x509"][..], &ec, &["-keyout", "ca-key.pem", "-out", "ca.pem", "-days", "2", "-subj", "/CN=kura test ca", "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign"]].concat());
        std::fs::write(dir.path().join("server.ext"), "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n").expect("write server.ext");
        std::fs::write(dir.path().join("client.ext"), "extendedKeyUsage=clientAuth\n").expect("write client.ext");
        for (name, ext, cn) in [("server", "server.ext", "localhost"), ("server2", "server.ext", "localhost"), ("client", "client.ext", "kura client")] {
            ssl(&[&["req"][..], &ec, &["-keyout", &format!("{name}-key.pem"), "-out", &format!("{name}.csr"), "-subj", &format!("/CN={cn}")]].concat());
            ssl(&["x509", "-req", "-in", &format!("{name}.csr"), "-CA", "ca.pem", "-CAkey", "ca-key.pem", "-CAcreateserial", "-out", &format!("{name}.pem"), "-days", "2", "-extfile", ext]);
        }
        ssl(&[&["req", "-x509"][..], &ec, &["-keyout", "rogue-key.pem", "-out", "rogue.pem", "-days", "2", "-subj", "/CN=rogue", "-addext", "extendedKeyUsage=clientAuth"]].concat());
        for entry in std::fs::read_dir(dir.path()).expect("read the certificates' directory") {
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::set_permissions(entry.expect("entry").path(), std::fs::Permissions::from_mode(0o644)).expect("chmod");
        }
        Ok(Self { dir })
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// [`TestCerts::path`] as a string (for command lines and URLs).
    pub fn arg(&self, name: &str) -> String {
        self.path(name).to_str().expect("UTF-8 temporary path").to_owned()
    }
}

/// A temporary directory removed on drop (kura-testkit has no dependencies to bring one).
mod tempfile_dir {
    use super::*;

    pub struct Dir(PathBuf);

    impl Dir {
        pub fn new() -> Result<Self, String> {
            static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
            let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let path = std::env::temp_dir().join(format!("kura-certs-{}-{n}", std::process::id()));
            let _ = std::fs::remove_dir_all(&path);
            std::fs::create_dir_all(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            Ok(Self(path))
        }

        pub fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}
