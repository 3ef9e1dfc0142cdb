//! TLS on the TCP listeners (memcached's `-Z` and its `-o ssl_*` options), with
//! [`kura_tls`]'s sessions: what `stats settings` shows of the setup, the configuration new
//! connections get (replaced by `refresh_certs`), and the counters `stats` shows.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use kura_tls::rustls::ServerConfig;
use kura_tls::{ClientAuth, MinVersion, ServerTlsOptions, TlsError, TlsSession};
use parking_lot::{Mutex, RwLock};

/// memcached's default `ssl_wbuf_size`, in KiB (shown; rustls buffers on its own, up to
/// [`kura_tls::SEND_BUFFER_BYTES_MAX`]).
pub const WBUF_SIZE_KIB_DEFAULT: u32 = 16;
/// memcached's `ssl_keyformat` for PEM (OpenSSL's `SSL_FILETYPE_PEM`), the only one kura reads.
pub const KEYFORMAT_PEM: u32 = 1;
/// memcached's default `ssl_min_version` (2: TLS 1.2).
pub const MIN_VERSION_DEFAULT: u32 = 2;
/// memcached's `ssl_verify_mode` values: 0 none, 1 request, 2 require, 3 once.
pub const VERIFY_MODE_MAX: u32 = 3;

/// The `-o ssl_*` options as given: what `stats settings` shows (memcached shows them with or
/// without `-Z`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsSettings {
    /// `-Z`.
    pub enabled: bool,
    pub chain_cert: Option<PathBuf>,
    /// The key's file; the certificate chain's when not given (memcached: "if not part of
    /// the ssl_chain_cert").
    pub key: Option<PathBuf>,
    pub verify_mode: u32,
    pub keyformat: u32,
    /// OpenSSL's cipher list: chooses among the TLS 1.2 suites kura has (as OpenSSL, TLS 1.3's
    /// stay); one that chooses none stops the start (memcached: "Error setting the provided
    /// cipher(s)").
    pub ciphers: Option<String>,
    pub ca_cert: Option<PathBuf>,
    pub wbuf_size_kib: u32,
    /// Sessions kept by the server for resumption (clients resume with tickets either way,
    /// as with memcached).
    pub session_cache: bool,
    /// Shown; kura encrypts in user space.
    pub kernel_tls: bool,
    /// 0 TLS 1.0, 1 TLS 1.1, 2 TLS 1.2, 3 TLS 1.3 (rustls has nothing older than 1.2).
    pub min_version: u32,
}

impl Default for TlsSettings {
    fn default() -> Self {
        Self {
            enabled: false,
            chain_cert: None,
            key: None,
            verify_mode: 0,
            keyformat: KEYFORMAT_PEM,
            ciphers: None,
            ca_cert: None,
            wbuf_size_kib: WBUF_SIZE_KIB_DEFAULT,
            session_cache: false,
            kernel_tls: false,
            min_version: MIN_VERSION_DEFAULT,
        }
    }
}

impl TlsSettings {
    /// The name `stats settings` gives `min_version` (memcached's).
    pub fn min_version_name(&self) -> &'static str {
        match self.min_version {
            0 => "tlsv1.0",
            1 => "tlsv1.1",
            3 => "tlsv1.3",
            _ => "tlsv1.2",
        }
    }

    /// What the TLS configuration is built from, or why it cannot be (checked at start).
    pub fn options(&self) -> Result<ServerTlsOptions, String> {
        let Some(chain) = &self.chain_cert else {
            return Err("-Z: TLS needs a certificate: -o ssl_chain_cert=FILE[,ssl_key=FILE] (PEM)".to_owned());
        };
        if self.keyformat != KEYFORMAT_PEM {
            return Err(format!("-o ssl_keyformat={}: kura reads PEM keys only (1)", self.keyformat));
        }
        let client_auth = match self.verify_mode {
            0 => ClientAuth::None,
            2 => ClientAuth::Require,
            _ => ClientAuth::Request,
        };
        if client_auth != ClientAuth::None && self.ca_cert.is_none() {
            return Err(format!("-o ssl_verify_mode={}: client certificates are checked against -o ssl_ca_cert=FILE, which is missing", self.verify_mode));
        }
        if let Some(list) = &self.ciphers {
            kura_tls::tls12_cipher_suites(list).map_err(|e| format!("-o ssl_ciphers: Error setting the provided cipher(s): {e}"))?;
        }
        Ok(ServerTlsOptions {
            cert_chain: chain.clone(),
            key: self.key.clone().unwrap_or_else(|| chain.clone()),
            client_ca: self.ca_cert.clone(),
            client_auth,
            min_version: if self.min_version >= 3 { MinVersion::Tls13 } else { MinVersion::Tls12 },
            session_cache: self.session_cache,
            // memcached's OpenSSL gives tickets whether or not ssl_session_cache is set.
            tickets: true,
            tls12_ciphers: self.ciphers.clone(),
        })
    }
}

/// The running server's TLS: the configuration new connections get and its counters.
pub struct ServerTls {
    options: ServerTlsOptions,
    config: RwLock<Arc<ServerConfig>>,
    /// When the certificate was last loaded (`time_since_server_cert_refresh`).
    loaded: Mutex<Instant>,
    /// Handshakes that failed (`ssl_handshake_errors`).
    pub handshake_errors: AtomicU64,
}

impl ServerTls {
    /// Loads the certificate and key: every problem is an error before the server listens.
    pub fn new(settings: &TlsSettings) -> Result<Self, String> {
        let options = settings.options()?;
        let config = kura_tls::server_config(&options).map_err(|e| e.to_string())?;
        Ok(Self { options, config: RwLock::new(config), loaded: Mutex::new(Instant::now()), handshake_errors: AtomicU64::new(0) })
    }

    /// A new connection's session.
    pub fn session(&self) -> std::io::Result<TlsSession> {
        let config = Arc::clone(&self.config.read());
        TlsSession::new(&config)
    }

    /// `refresh_certs`: reads the files again; connections that come after use them. On a
    /// failure the configuration in use stays, and the reason is memcached's kind of line.
    pub fn refresh(&self) -> Result<(), String> {
        match kura_tls::server_config(&self.options) {
            Ok(config) => {
                *self.config.write() = config;
                *self.loaded.lock() = Instant::now();
                Ok(())
            }
            Err(error) => {
                // memcached's first words for each file, then kura's reason.
                let file = match &error {
                    TlsError::Read { path, .. } | TlsError::TooLarge { path } | TlsError::NoCertificate { path } | TlsError::BadPem { path, .. } | TlsError::NoKey { path } | TlsError::BadCa { path, .. } => Some(path),
                    _ => None,
                };
                Err(match file {
                    Some(path) if Some(path) == self.options.client_ca.as_ref() && *path != self.options.cert_chain => format!("Error loading the CA certificate: {} : {error}", path.display()),
                    Some(path) if *path == self.options.key && (*path != self.options.cert_chain || matches!(error, TlsError::NoKey { .. })) => format!("Error loading the key: {} : {error}", path.display()),
                    Some(path) => format!("Error loading the certificate chain: {} : {error}", path.display()),
                    None => format!("Error validating the certificate: {error}"),
                })
            }
        }
    }

    /// Whole seconds since the certificate was last loaded.
    pub fn seconds_since_refresh(&self) -> u64 {
        self.loaded.lock().elapsed().as_secs()
    }

    pub fn count_handshake_error(&self) {
        self.handshake_errors.fetch_add(1, Ordering::Relaxed);
    }
}
