//! TLS for the NBD server (`NBD_OPT_STARTTLS`, the protocol's "TLS support" section): the
//! certificate and key loaded once at start ([`kura_tls`], which the memcached server
//! shares), and whether a client must use it.

use std::path::Path;
use std::sync::Arc;

use kura_tls::rustls::ServerConfig;
pub use kura_tls::{TlsError, TlsSession};
use kura_tls::{ClientAuth, MinVersion, ServerTlsOptions};

/// The server's TLS setup: what a client that sends `NBD_OPT_STARTTLS` gets, and whether a
/// client must (the protocol's FORCEDTLS mode) or may (options work in plain text too).
#[derive(Debug, Clone)]
pub struct NbdTls {
    pub config: Arc<ServerConfig>,
    /// FORCEDTLS: every option but `NBD_OPT_STARTTLS` and `NBD_OPT_ABORT` is answered
    /// `NBD_REP_ERR_TLS_REQD` until TLS is up, and `NBD_OPT_EXPORT_NAME` ends the session.
    pub required: bool,
}

impl NbdTls {
    /// Loads a PEM certificate chain (server certificate first) and its private key, and with
    /// `client_ca` a PEM file of CA certificates: clients must then present a certificate one
    /// of them signed. Every problem (missing file, no PEM, a key that is not the
    /// certificate's) is an error here, not at the first client.
    pub fn from_pem_files(cert: &Path, key: &Path, client_ca: Option<&Path>, required: bool) -> Result<Self, TlsError> {
        let options = ServerTlsOptions {
            cert_chain: cert.to_owned(),
            key: key.to_owned(),
            client_ca: client_ca.map(Path::to_owned),
            client_auth: if client_ca.is_some() { ClientAuth::Require } else { ClientAuth::None },
            min_version: MinVersion::Tls12,
            session_cache: true,
            tickets: false,
            tls12_ciphers: None,
        };
        Ok(Self { config: kura_tls::server_config(&options)?, required })
    }
}
