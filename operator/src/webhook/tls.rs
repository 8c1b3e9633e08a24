//! The webhook's serving certificate: `tls.crt` (the chain, PEM) and `tls.key` (PEM) in one
//! directory — a mounted `kubernetes.io/tls` Secret. The files are read again every
//! [`RELOAD_EVERY`] and served when they changed, so a renewed Secret is served without a
//! restart.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio_rustls::rustls::crypto::{ring, CryptoProvider};
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::{ClientHello, ResolvesServerCert};
use tokio_rustls::rustls::sign::CertifiedKey;
use tokio_rustls::rustls::ServerConfig;
use tokio_util::sync::CancellationToken;

/// How often the certificate files are checked for a change.
pub const RELOAD_EVERY: Duration = Duration::from_secs(10);

/// Why the certificate cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
    #[error("TLS setup: {0}")]
    Tls(String),
}

/// The certificate being served, swapped when its files change.
#[derive(Debug)]
pub struct Certificate {
    dir: PathBuf,
    /// The certificate and the files' bytes it was read from.
    current: RwLock<(Arc<CertifiedKey>, [Vec<u8>; 2])>,
}

impl ResolvesServerCert for Certificate {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

impl Certificate {
    /// Reads `dir`'s `tls.crt` and `tls.key`.
    pub async fn load(dir: &Path) -> Result<Arc<Certificate>, CertError> {
        let bytes = files(dir).await?;
        let key = parse(dir, &bytes)?;
        Ok(Arc::new(Certificate {
            dir: dir.to_owned(),
            current: RwLock::new((key, bytes)),
        }))
    }

    /// The certificate served now.
    pub fn current(&self) -> Arc<CertifiedKey> {
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .0
            .clone()
    }

    /// A rustls server config that serves this certificate (HTTP/1.1, no client certificates).
    pub fn server_config(self: &Arc<Self>) -> Result<Arc<ServerConfig>, CertError> {
        let mut config = ServerConfig::builder_with_provider(Arc::new(ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| CertError::Tls(e.to_string()))?
            .with_no_client_auth()
            .with_cert_resolver(self.clone());
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }

    /// Reads the files every `every` and serves them when they changed, until `stop`; a change that cannot be read keeps the previous certificate (and
    /// is logged).
    pub async fn reload_until(self: Arc<Self>, every: Duration, stop: CancellationToken) {
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            match self.reload().await {
                Ok(true) => {
                    tracing::info!(dir = %self.dir.display(), "webhook certificate reloaded")
                }
                Ok(false) => {}
                Err(e) => tracing::warn!("webhook certificate not reloaded: {e}"),
            }
        }
    }

    /// Reads the files again and serves them if they changed: whether a new certificate is
    /// served. On an error the previous one stays (and the change is tried again next time).
    pub async fn reload(&self) -> Result<bool, CertError> {
        let bytes = files(&self.dir).await?;
        if self.current.read().unwrap_or_else(|p| p.into_inner()).1 == bytes {
            return Ok(false);
        }
        let key = parse(&self.dir, &bytes)?;
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = (key, bytes);
        Ok(true)
    }
}

/// The bytes of `dir`'s `tls.crt` and `tls.key` (two small files: read whole each check, so
/// no file-time granularity can hide a change).
async fn files(dir: &Path) -> Result<[Vec<u8>; 2], CertError> {
    let read = |path: PathBuf| async move {
        tokio::fs::read(&path)
            .await
            .map_err(|source| CertError::Read { path, source })
    };
    Ok([
        read(dir.join("tls.crt")).await?,
        read(dir.join("tls.key")).await?,
    ])
}

/// The certified key in `[tls.crt, tls.key]` of `dir`.
fn parse(dir: &Path, [crt_pem, key_pem]: &[Vec<u8>; 2]) -> Result<Arc<CertifiedKey>, CertError> {
    let (crt, key) = (dir.join("tls.crt"), dir.join("tls.key"));
    let invalid = |path: &Path, message: String| CertError::Invalid {
        path: path.to_owned(),
        message,
    };
    let chain = CertificateDer::pem_slice_iter(crt_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(&crt, format!("not a PEM certificate chain: {e}")))?;
    if chain.is_empty() {
        return Err(invalid(&crt, "holds no certificate".to_owned()));
    }
    let private = PrivateKeyDer::from_pem_slice(key_pem)
        .map_err(|e| invalid(&key, format!("not a PEM private key: {e}")))?;
    let provider: CryptoProvider = ring::default_provider();
    let signing = provider
        .key_provider
        .load_private_key(private)
        .map_err(|e| invalid(&key, format!("unusable private key: {e}")))?;
    Ok(Arc::new(CertifiedKey::new(chain, signing)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A self-signed certificate for `name` written to `dir`; returns its DER.
    fn write_certificate(dir: &Path, name: &str) -> Vec<u8> {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec![name.to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        std::fs::write(dir.join("tls.crt"), cert.pem()).unwrap();
        std::fs::write(dir.join("tls.key"), key.serialize_pem()).unwrap();
        cert.der().to_vec()
    }

    fn served(certificate: &Certificate) -> Vec<u8> {
        certificate.current().cert[0].to_vec()
    }

    #[tokio::test]
    async fn a_renewed_secret_is_served_without_a_restart_and_garbage_keeps_the_old_one() {
        let dir = std::env::temp_dir().join(format!("webhook-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let first = write_certificate(&dir, "first.example");
        let certificate = Certificate::load(&dir).await.unwrap();
        assert_eq!(served(&certificate), first);
        assert!(!certificate.reload().await.unwrap(), "nothing changed");

        // Unreadable files: an error naming the file, and the old certificate stays.
        std::fs::write(dir.join("tls.key"), "not a key").unwrap();
        let refused = certificate.reload().await.unwrap_err().to_string();
        assert!(refused.contains("tls.key"), "{refused}");
        assert_eq!(served(&certificate), first);

        // Renewed: the loop serves the new one.
        let stop = CancellationToken::new();
        let every = Duration::from_millis(20);
        tokio::spawn(certificate.clone().reload_until(every, stop.clone()));
        let second = write_certificate(&dir, "second.example");
        let renewed = tokio::time::timeout(Duration::from_secs(5), async {
            while served(&certificate) != second {
                tokio::time::sleep(every).await;
            }
        })
        .await;
        stop.cancel();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(
            renewed.is_ok(),
            "the renewed certificate was not served within 5 s"
        );
        let missing = Certificate::load(Path::new("/nonexistent"))
            .await
            .unwrap_err();
        assert!(
            missing.to_string().contains("/nonexistent/tls.crt"),
            "{missing}"
        );
    }
}
