//! OpenSSL's cipher lists (memcached's `-o ssl_ciphers`, which it gives
//! `SSL_CTX_set_cipher_list`) read against the TLS 1.2 suites kura has. A pure parser: the
//! list's grammar as ciphers(1) gives it, over the six suites rustls offers with ring.
//!
//! As with OpenSSL, the list chooses TLS 1.2 suites only (TLS 1.3's are not set by it), a name
//! or alias that matches nothing is passed over, and a list that leaves no suite at all is an
//! error. Names of suites kura does not have (`AES128-SHA`, `RC4-SHA`, DHE, CBC, PSK …) match
//! nothing, so a list made only of them is refused rather than ignored.

use rustls::SupportedCipherSuite;
use rustls::crypto::ring::cipher_suite as suite;

/// Longest cipher list read (OpenSSL's default list is ~70 bytes; long hand-made ones a few
/// hundred).
pub const CIPHER_LIST_BYTES_MAX: usize = 4096;

/// Why a cipher list chooses no suite.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CipherListError {
    #[error("the cipher list is longer than {CIPHER_LIST_BYTES_MAX} bytes")]
    TooLong,
    #[error("{command:?} is not a cipher list command (@STRENGTH, @SECLEVEL=N)")]
    BadCommand { command: String },
    #[error("no cipher in {list:?} is one kura offers; kura's TLS 1.2 ciphers are {}", SUITES.iter().map(|s| s.openssl).collect::<Vec<_>>().join(":"))]
    NoCipher { list: String },
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Auth {
    Ecdsa,
    Rsa,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Enc {
    Aes128Gcm,
    Aes256Gcm,
    Chacha20,
}

/// One TLS 1.2 suite kura has, with what OpenSSL's aliases select it by.
struct Suite {
    openssl: &'static str,
    iana: &'static str,
    auth: Auth,
    enc: Enc,
    suite: SupportedCipherSuite,
}

/// In rustls' order of preference (its ring provider's).
const SUITES: [Suite; 6] = [
    Suite { openssl: "ECDHE-ECDSA-AES256-GCM-SHA384", iana: "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384", auth: Auth::Ecdsa, enc: Enc::Aes256Gcm, suite: suite::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384 },
    Suite { openssl: "ECDHE-ECDSA-AES128-GCM-SHA256", iana: "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256", auth: Auth::Ecdsa, enc: Enc::Aes128Gcm, suite: suite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256 },
    Suite { openssl: "ECDHE-ECDSA-CHACHA20-POLY1305", iana: "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256", auth: Auth::Ecdsa, enc: Enc::Chacha20, suite: suite::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256 },
    Suite { openssl: "ECDHE-RSA-AES256-GCM-SHA384", iana: "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384", auth: Auth::Rsa, enc: Enc::Aes256Gcm, suite: suite::TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384 },
    Suite { openssl: "ECDHE-RSA-AES128-GCM-SHA256", iana: "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256", auth: Auth::Rsa, enc: Enc::Aes128Gcm, suite: suite::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256 },
    Suite { openssl: "ECDHE-RSA-CHACHA20-POLY1305", iana: "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256", auth: Auth::Rsa, enc: Enc::Chacha20, suite: suite::TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256 },
];

/// Whether `name` (a suite's OpenSSL or IANA name, or one of OpenSSL's aliases; exact case,
/// as OpenSSL) selects `s`. Any other word selects none.
fn selects(name: &str, s: &Suite) -> bool {
    match name {
        // Every one of kura's suites is ECDHE, AEAD, TLS 1.2, "HIGH" and in OpenSSL's default.
        "ALL" | "DEFAULT" | "HIGH" | "TLSv1.2" | "AEAD" | "kECDHE" | "kEECDH" | "ECDHE" | "EECDH" => true,
        "aECDSA" | "ECDSA" => s.auth == Auth::Ecdsa,
        "aRSA" => s.auth == Auth::Rsa,
        "AES" | "AESGCM" => s.enc != Enc::Chacha20,
        "AES128" => s.enc == Enc::Aes128Gcm,
        "AES256" => s.enc == Enc::Aes256Gcm,
        "CHACHA20" => s.enc == Enc::Chacha20,
        // OpenSSL's SHA256 and SHA384 select by MAC, which for these suites is the AEAD.
        _ => name == s.openssl || name == s.iana,
    }
}

/// The TLS 1.2 suites `list` (OpenSSL's syntax) chooses, in its order.
pub fn tls12_cipher_suites(list: &str) -> Result<Vec<SupportedCipherSuite>, CipherListError> {
    Ok(choose(list)?.into_iter().map(|i| SUITES[i].suite).collect())
}

/// The indexes into [`SUITES`] the list chooses, in order.
fn choose(list: &str) -> Result<Vec<usize>, CipherListError> {
    if list.len() > CIPHER_LIST_BYTES_MAX {
        return Err(CipherListError::TooLong);
    }
    let mut active: Vec<usize> = Vec::new();
    let mut killed = [false; SUITES.len()];
    for element in list.split([':', ' ', ',', ';']).filter(|e| !e.is_empty()) {
        if let Some(command) = element.strip_prefix('@') {
            match command {
                "STRENGTH" => active.sort_by_key(|&i| std::cmp::Reverse(strength_bits(&SUITES[i]))),
                // Security levels restrict keys and curves; every suite of kura's passes all.
                c if c.strip_prefix("SECLEVEL=").is_some_and(|n| n.len() == 1 && n.as_bytes()[0].is_ascii_digit()) => {}
                _ => return Err(CipherListError::BadCommand { command: element.to_owned() }),
            }
            continue;
        }
        let (op, rule) = match element.as_bytes()[0] {
            b @ (b'!' | b'-' | b'+') => (b, &element[1..]),
            _ => (b' ', element),
        };
        // "A+B": the suites both select.
        let matched: Vec<usize> = (0..SUITES.len()).filter(|&i| rule.split('+').all(|term| selects(term, &SUITES[i]))).collect();
        match op {
            b'!' => {
                for &i in &matched {
                    killed[i] = true;
                }
                active.retain(|i| !matched.contains(i));
            }
            b'-' => active.retain(|i| !matched.contains(i)),
            b'+' => {
                let (moved, kept): (Vec<usize>, Vec<usize>) = active.iter().partition(|i| matched.contains(i));
                active = kept;
                active.extend(moved);
            }
            _ => {
                for i in matched {
                    if !killed[i] && !active.contains(&i) {
                        active.push(i);
                    }
                }
            }
        }
    }
    if active.is_empty() {
        return Err(CipherListError::NoCipher { list: list.to_owned() });
    }
    Ok(active)
}

fn strength_bits(s: &Suite) -> u32 {
    match s.enc {
        Enc::Aes128Gcm => 128,
        Enc::Aes256Gcm | Enc::Chacha20 => 256,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(list: &str) -> Vec<&'static str> {
        choose(list).unwrap().into_iter().map(|i| SUITES[i].openssl).collect()
    }

    #[test]
    fn lists_as_openssl_reads_them() {
        assert_eq!(names("ECDHE-RSA-AES128-GCM-SHA256"), ["ECDHE-RSA-AES128-GCM-SHA256"]);
        assert_eq!(names("HIGH:!aNULL:!MD5").len(), 6);
        assert_eq!(names("DEFAULT").len(), 6);
        assert_eq!(names("ECDHE+AESGCM:!aRSA"), ["ECDHE-ECDSA-AES256-GCM-SHA384", "ECDHE-ECDSA-AES128-GCM-SHA256"]);
        assert_eq!(names("HIGH:!AESGCM"), ["ECDHE-ECDSA-CHACHA20-POLY1305", "ECDHE-RSA-CHACHA20-POLY1305"]);
        // Order: as listed; "+" moves to the end; "-" removes for now, "!" for good.
        assert_eq!(names("CHACHA20:AES128:AES256").first(), Some(&"ECDHE-ECDSA-CHACHA20-POLY1305"));
        assert_eq!(names("ALL:+CHACHA20").last(), Some(&"ECDHE-RSA-CHACHA20-POLY1305"));
        assert_eq!(names("ALL:-aRSA:aRSA").len(), 6);
        assert_eq!(names("ALL:!aRSA:aRSA").len(), 3);
        assert_eq!(names("AES128:CHACHA20:@STRENGTH").last(), Some(&"ECDHE-RSA-AES128-GCM-SHA256"));
        assert_eq!(names("@SECLEVEL=2:ECDSA"), names("ECDSA"));
        // Separators other than ':'; IANA names; names kura lacks are passed over.
        assert_eq!(names("AES128-SHA, ECDHE-ECDSA-CHACHA20-POLY1305;TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384"), ["ECDHE-ECDSA-CHACHA20-POLY1305", "ECDHE-RSA-AES256-GCM-SHA384"]);
    }

    #[test]
    fn lists_that_choose_nothing_are_errors() {
        for list in ["", "RC4-SHA", "AES128-SHA:DHE-RSA-AES256-GCM-SHA384", "ALL:!ALL", "aNULL", "high", "TLS_AES_128_GCM_SHA256", "SHA256"] {
            assert!(matches!(choose(list), Err(CipherListError::NoCipher { .. })), "{list:?}");
        }
        assert!(matches!(choose("ALL:@FOO"), Err(CipherListError::BadCommand { .. })));
        assert_eq!(choose(&"A:".repeat(3000)), Err(CipherListError::TooLong));
        let message = choose("RC4").unwrap_err().to_string();
        assert!(message.contains("ECDHE-ECDSA-AES256-GCM-SHA384") && message.contains("RC4"), "{message}");
    }
}
