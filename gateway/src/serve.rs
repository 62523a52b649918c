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
pub use tokio_rustls::TlsAcceptor;

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

/// hyper's own per-connection write buffer: small, so that the bytes a slow
/// client has not taken stay in the stream's bounded queue, where they are
/// counted (hyper's default would hold ~400 KiB more per connection).
const HYPER_BUF: usize = 64 * 1024;

/// Kernel send buffer per connection (Linux doubles the value it is given).
const SEND_BUF: usize = 128 * 1024;

/// Serves `app` on `listener` (over TLS when `tls` is set) until `shutdown`
/// resolves; connections in progress finish on their own.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    tls: Option<TlsAcceptor>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    tokio::pin!(shutdown);
    loop {
        let (tcp, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    // Out of file descriptors and the like: back off, keep serving.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => return Ok(()),
        };
        let _ = tcp.set_nodelay(true);
        // A fixed send buffer (no kernel autotuning up to 4 MiB): what a
        // client does not read backs up into the stream's counted queue
        // within ~SEND_BUF, so a stalled client is noticed and its job
        // cancelled, instead of the kernel quietly absorbing megabytes.
        let _ = socket2::SockRef::from(&tcp).set_send_buffer_size(SEND_BUF);
        let (tls, app) = (tls.clone(), app.clone());
        tokio::spawn(async move {
            match tls {
                None => connection(TokioIo::new(tcp), app, peer).await,
                Some(tls) => match tls.accept(tcp).await {
                    Ok(s) => connection(TokioIo::new(s), app, peer).await,
                    Err(e) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                },
            }
        });
    }
}

async fn connection<I>(io: I, app: Router, peer: std::net::SocketAddr)
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let mut b = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    b.http1().max_buf_size(HYPER_BUF);
    let r = b.serve_connection(io, TowerToHyperService::new(app)).await;
    if let Err(e) = r {
        tracing::debug!(%peer, error = %e, "connection ended with an error");
    }
}
