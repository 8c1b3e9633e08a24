//! The webhook's serving certificate: `tls.crt` (the chain, PEM) and `tls.key` (PEM) in one
//! directory — a mounted `kubernetes.io/tls` Secret. The files are read again when they change
//! (checked every [`RELOAD_EVERY`]), so a renewed Secret is served without a restart.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

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
    current: RwLock<(Arc<CertifiedKey>, Option<SystemTime>)>,
}

impl ResolvesServerCert for Certificate {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let current = self.current.read().unwrap_or_else(|p| p.into_inner());
        Some(current.0.clone())
    }
}

impl Certificate {
    /// Reads `dir`'s `tls.crt` and `tls.key`.
    pub async fn load(dir: &Path) -> Result<Arc<Certificate>, CertError> {
        let (key, modified) = read(dir).await?;
        Ok(Arc::new(Certificate {
            dir: dir.to_owned(),
            current: RwLock::new((key, modified)),
        }))
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

    /// Reads the files again whenever their modification time changes, until `stop`; a
    /// change that cannot be read keeps the previous certificate (and is logged).
    pub async fn reload_until(self: Arc<Self>, stop: CancellationToken) {
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(RELOAD_EVERY) => {}
            }
            let seen = self.current.read().unwrap_or_else(|p| p.into_inner()).1;
            if modified(&self.dir).await == seen {
                continue;
            }
            match read(&self.dir).await {
                Ok(fresh) => {
                    *self.current.write().unwrap_or_else(|p| p.into_inner()) = fresh;
                    tracing::info!(dir = %self.dir.display(), "webhook certificate reloaded");
                }
                Err(e) => tracing::warn!("webhook certificate not reloaded: {e}"),
            }
        }
    }
}

/// The newest modification time of the two files (none when unreadable).
async fn modified(dir: &Path) -> Option<SystemTime> {
    let mut newest = None;
    for name in ["tls.crt", "tls.key"] {
        let m = tokio::fs::metadata(dir.join(name))
            .await
            .ok()?
            .modified()
            .ok()?;
        newest = newest.max(Some(m));
    }
    newest
}

async fn read(dir: &Path) -> Result<(Arc<CertifiedKey>, Option<SystemTime>), CertError> {
    let stamp = modified(dir).await;
    let (crt, key) = (dir.join("tls.crt"), dir.join("tls.key"));
    let read = |path: PathBuf| async move {
        tokio::fs::read(&path)
            .await
            .map_err(|source| CertError::Read { path, source })
    };
    let (crt_pem, key_pem) = (read(crt.clone()).await?, read(key.clone()).await?);
    let invalid = |path: &Path, message: String| CertError::Invalid {
        path: path.to_owned(),
        message,
    };
    let chain = CertificateDer::pem_slice_iter(&crt_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(&crt, format!("not a PEM certificate chain: {e}")))?;
    if chain.is_empty() {
        return Err(invalid(&crt, "holds no certificate".to_owned()));
    }
    let private = PrivateKeyDer::from_pem_slice(&key_pem)
        .map_err(|e| invalid(&key, format!("not a PEM private key: {e}")))?;
    let provider: CryptoProvider = ring::default_provider();
    let signing = provider
        .key_provider
        .load_private_key(private)
        .map_err(|e| invalid(&key, format!("unusable private key: {e}")))?;
    Ok((Arc::new(CertifiedKey::new(chain, signing)), stamp))
}
