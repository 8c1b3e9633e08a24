//! The HTTPS endpoint `POST /validate-perspectivedeployment` that the API server calls for
//! every create and update of a `PerspectiveDeployment` (the chart's
//! `ValidatingWebhookConfiguration`). Every replica serves it, leader or not.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::review;
use super::tls::Certificate;
use crate::reconcile::context::Options;
use crate::reconcile::validate::spec_problems;

/// The path the webhook configuration names.
pub const PATH: &str = "/validate-perspectivedeployment";
/// A review carries the object and the old object; the CRD caps a spec's text at 256 KiB.
const MAX_BODY: usize = 4 << 20;
/// A client gets this long for its TLS handshake, and for the headers of each request.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves the webhook on `addr` with `certificate` until `shutdown`; returns the bound address
/// (port 0 picks one) and the server's task.
pub async fn serve(
    addr: SocketAddr,
    certificate: Arc<Certificate>,
    options: Options,
    shutdown: CancellationToken,
) -> anyhow::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
        anyhow::anyhow!("could not listen for the admission webhook on {addr}: {e}")
    })?;
    let local = listener.local_addr()?;
    let acceptor = TlsAcceptor::from(certificate.server_config()?);
    tokio::spawn(certificate.reload_until(super::tls::RELOAD_EVERY, shutdown.clone()));
    let app = Router::new()
        .route(PATH, post(validate))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(Arc::new(options));
    let task = tokio::spawn(async move {
        let connections = TaskTracker::new();
        loop {
            let stream = tokio::select! {
                _ = shutdown.cancelled() => break,
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        tracing::warn!("admission webhook on {local}: accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                },
            };
            let (acceptor, app, shutdown) = (acceptor.clone(), app.clone(), shutdown.clone());
            connections.spawn(async move {
                let tls =
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                        Ok(Ok(tls)) => tls,
                        Ok(Err(e)) => return tracing::debug!("webhook TLS handshake failed: {e}"),
                        Err(_) => return tracing::debug!("webhook TLS handshake timed out"),
                    };
                let connection = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(HANDSHAKE_TIMEOUT)
                    .serve_connection(TokioIo::new(tls), TowerToHyperService::new(app));
                tokio::pin!(connection);
                tokio::select! {
                    _ = connection.as_mut() => {}
                    _ = shutdown.cancelled() => {
                        connection.as_mut().graceful_shutdown();
                        let _ = connection.await;
                    }
                }
            });
        }
        connections.close();
        connections.wait().await;
    });
    Ok((local, task))
}

async fn validate(State(options): State<Arc<Options>>, body: Bytes) -> Response {
    match review::answer(&body, |name, spec| spec_problems(name, spec, &options)) {
        Ok(answer) => (
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            answer.to_string(),
        )
            .into_response(),
        Err(e) => (StatusCode::BAD_REQUEST, e.to_string()).into_response(),
    }
}
