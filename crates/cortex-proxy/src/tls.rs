//! TLS on a listener: rustls on the `ring` provider (through tokio-rustls), the certificate
//! chain and private key read from PEM files and re-read every `reload_interval`.
//!
//! Key decisions:
//! - A pair is served only once it loads whole: both files read and parsed (with the PEM parser
//!   of `rustls-pki-types`, which rustls re-exports), and the key matching the certificate's
//!   public key. A bad, partial or mismatched pair on disk — a renewal caught between writing
//!   the two files, or a mistake — never replaces the pair being served: it is logged and
//!   counted, and the next reload tries again.
//! - The pair in service is one `Arc<ServerConfig>` swapped whole; a handshake takes the current
//!   one, so connections already open keep the certificate they were accepted with.
//! - Protocols are rustls's safe defaults (TLS 1.2 and 1.3); ALPN offers `h2` and `http/1.1`.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rustls::ServerConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;

/// Where a listener's certificate and key are, and how often they are re-read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsConfig {
    /// The PEM certificate chain, leaf first.
    pub cert: PathBuf,
    /// The PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// How often both files are re-read.
    pub reload_interval: Duration,
}

/// Why a certificate and key could not be served.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file holds no PEM object of the expected kind, or cannot be read.
    #[error("{path}: {what}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        what: String,
    },
    /// rustls refused the pair (the key does not match the certificate, or is unsupported).
    #[error("certificate {cert} and key {key}: {why}")]
    Pair {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// rustls's reason, in words (not a `source`: a chain printer would say it twice).
        why: String,
    },
}

/// A listener's TLS: the pair in service, reloaded in the background.
pub struct Tls {
    config: TlsConfig,
    current: RwLock<Served>,
}

/// The pair in service.
struct Served {
    config: Arc<ServerConfig>,
    /// The leaf certificate (DER), to tell which pair is served.
    leaf: CertificateDer<'static>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls").field("config", &self.config).finish_non_exhaustive()
    }
}

impl Tls {
    /// Loads the pair of `config`.
    ///
    /// # Errors
    /// [`TlsError`] naming the file or the pair that cannot be served.
    pub fn load(config: TlsConfig) -> Result<Arc<Tls>, TlsError> {
        let first = server_config(&config.cert, &config.key)?;
        Ok(Arc::new(Tls { config, current: RwLock::new(first) }))
    }

    /// The acceptor for a new connection: the pair in service now.
    #[must_use]
    pub fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(Arc::clone(&self.served().config))
    }

    /// The leaf certificate in service (DER).
    #[must_use]
    pub fn leaf(&self) -> CertificateDer<'static> {
        self.served().leaf.clone()
    }

    fn served(&self) -> std::sync::RwLockReadGuard<'_, Served> {
        self.current.read().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Re-reads the files: a pair that loads whole replaces the one in service.
    ///
    /// # Errors
    /// The new pair's problem; the pair in service is kept.
    pub fn reload(&self) -> Result<(), TlsError> {
        let next = server_config(&self.config.cert, &self.config.key)?;
        *self.current.write().unwrap_or_else(std::sync::PoisonError::into_inner) = next;
        Ok(())
    }

    /// Reloads every `reload_interval` for as long as the returned task runs (abort it to stop).
    #[must_use]
    pub fn spawn_reloader(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let tls = Arc::downgrade(self);
        let every = self.config.reload_interval;
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                let Some(tls) = tls.upgrade() else { return };
                if let Err(e) = tls.reload() {
                    tracing::warn!(error = %e, "TLS reload failed; the certificate in service is kept");
                }
            }
        })
    }
}

fn pem_error(path: &Path, e: &rustls::pki_types::pem::Error) -> TlsError {
    use rustls::pki_types::pem::Error as E;
    // The markers as text: the library's message prints their bytes as numbers.
    let marker = |m: &[u8]| String::from_utf8_lossy(m).into_owned();
    let what = match e {
        E::MissingSectionEnd { end_marker } => format!("missing section end marker `{}`", marker(end_marker)),
        E::IllegalSectionStart { line } => format!("illegal section start `{}`", marker(line)),
        other => other.to_string(),
    };
    TlsError::Pem { path: path.to_owned(), what }
}

/// The rustls configuration of the pair in `cert` and `key`.
fn server_config(cert: &Path, key: &Path) -> Result<Served, TlsError> {
    let chain = CertificateDer::pem_file_iter(cert)
        .map_err(|e| pem_error(cert, &e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_error(cert, &e))?;
    if chain.is_empty() {
        return Err(TlsError::Pem { path: cert.to_owned(), what: "no CERTIFICATE in the file".into() });
    }
    let leaf = chain[0].clone();
    let private = PrivateKeyDer::from_pem_file(key).map_err(|e| match e {
        rustls::pki_types::pem::Error::NoItemsFound => {
            let text = std::fs::read(key).unwrap_or_default();
            let has = |m: &str| text.windows(m.len()).any(|w| w == m.as_bytes());
            let what = if has("ENCRYPTED PRIVATE KEY") {
                "the private key is encrypted, which is not supported: decrypt it (`openssl pkey -in <file>`)"
            } else if has("CERTIFICATE") {
                "no private key, only a certificate: `key` must be the private key's file"
            } else {
                "no private key (`PRIVATE KEY`, `RSA PRIVATE KEY` or `EC PRIVATE KEY`) in the file"
            };
            TlsError::Pem { path: key.to_owned(), what: what.to_owned() }
        }
        e => pem_error(key, &e),
    })?;
    let pair = |e: rustls::Error| TlsError::Pair {
        cert: cert.to_owned(),
        key: key.to_owned(),
        why: match e {
            rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch) => {
                "the private key does not belong to the certificate (the chain's first certificate)"
                    .to_owned()
            }
            e => e.to_string(),
        },
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(pair)?
        .with_no_client_auth()
        .with_single_cert(chain, private)
        .map_err(pair)?;
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Served { config: Arc::new(cfg), leaf })
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Pair {
        cert: String,
        key: String,
        der: Vec<u8>,
    }

    fn pair() -> Pair {
        let c = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
        Pair { cert: c.cert.pem(), key: c.signing_key.serialize_pem(), der: c.cert.der().to_vec() }
    }

    #[test]
    fn a_new_pair_is_served_and_a_bad_one_never_replaces_the_good() {
        let dir = std::env::temp_dir().join(format!("cortex-tls-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
        let write = |c: &str, k: &str| {
            std::fs::write(&cert, c).unwrap();
            std::fs::write(&key, k).unwrap();
        };
        let (a, b, c) = (pair(), pair(), pair());
        write(&a.cert, &a.key);
        let cfg =
            TlsConfig { cert: cert.clone(), key: key.clone(), reload_interval: Duration::from_secs(60) };
        let tls = Tls::load(cfg.clone()).unwrap();
        assert_eq!(tls.leaf().as_ref(), a.der.as_slice());
        // A renewal: the new pair is served.
        write(&b.cert, &b.key);
        tls.reload().unwrap();
        assert_eq!(tls.leaf().as_ref(), b.der.as_slice());
        // Caught between writing the two files (c's certificate, b's key), an empty key, a key
        // in the certificate's place, a missing file: refused, b stays in service.
        for (cert_pem, key_pem, says) in [
            (c.cert.as_str(), b.key.as_str(), "the private key does not belong to the certificate"),
            (c.cert.as_str(), "", "no private key (`PRIVATE KEY`"),
            (c.cert.as_str(), c.cert.as_str(), "no private key, only a certificate"),
            (
                c.cert.as_str(),
                "-----BEGIN ENCRYPTED PRIVATE KEY-----\nMIIB\n-----END ENCRYPTED PRIVATE KEY-----\n",
                "the private key is encrypted",
            ),
            (c.key.as_str(), c.key.as_str(), "no CERTIFICATE"),
            // Cut short: the marker it lacks named as text.
            (&c.cert[..c.cert.len() / 2], c.key.as_str(), "missing section end marker `CERTIFICATE`"),
        ] {
            write(cert_pem, key_pem);
            let err = tls.reload().unwrap_err().to_string();
            assert!(err.contains(says), "{err}");
            assert_eq!(tls.leaf().as_ref(), b.der.as_slice());
        }
        std::fs::remove_file(&key).unwrap();
        assert!(tls.reload().is_err());
        assert_eq!(tls.leaf().as_ref(), b.der.as_slice());
        // The same bad pairs are refused at start too.
        assert!(Tls::load(cfg.clone()).is_err());
        write(&c.cert, &c.key);
        tls.reload().unwrap();
        assert_eq!(tls.leaf().as_ref(), c.der.as_slice());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
