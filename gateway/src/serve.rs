//! Serving the app over plain HTTP, or HTTPS with rustls when a certificate
//! and key are given (so `--http 0.0.0.0:443` works without an edge proxy).

use std::path::PathBuf;
use std::sync::Arc;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::TcpListener;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::TlsAcceptor;

/// PEM certificate chain and private key.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    /// Certificate chain (PEM).
    pub cert: PathBuf,
    /// Private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
}

/// A TLS setup problem.
#[derive(Debug, thiserror::Error)]
#[error("TLS: {0}")]
pub struct TlsError(String);

/// Loads the certificate and key into a rustls acceptor (HTTP/1.1 ALPN).
pub fn acceptor(files: &TlsFiles) -> Result<TlsAcceptor, TlsError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&files.cert)
        .map_err(|e| TlsError(format!("{}: {e}", files.cert.display())))?
        .collect::<Result<_, _>>()
        .map_err(|e| TlsError(format!("{}: {e}", files.cert.display())))?;
    if certs.is_empty() {
        return Err(TlsError(format!("{}: no certificate", files.cert.display())));
    }
    let key = PrivateKeyDer::from_pem_file(&files.key)
        .map_err(|e| TlsError(format!("{}: {e}", files.key.display())))?;
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let mut cfg = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| TlsError(e.to_string()))?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(cfg)))
}

/// Serves `app` on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    tls: Option<TlsAcceptor>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let Some(tls) = tls else {
        return axum::serve(listener, app).with_graceful_shutdown(shutdown).await;
    };
    tokio::pin!(shutdown);
    loop {
        let (tcp, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    continue;
                }
            },
            _ = &mut shutdown => return Ok(()),
        };
        let (tls, app) = (tls.clone(), app.clone());
        tokio::spawn(async move {
            let stream = match tls.accept(tcp).await {
                Ok(s) => s,
                Err(e) => {
                    tracing::debug!(%peer, error = %e, "TLS handshake failed");
                    return;
                }
            };
            let service = TowerToHyperService::new(app);
            let r = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
            if let Err(e) = r {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
}
