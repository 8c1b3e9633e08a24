//! `/livez`, `/readyz` and `/metrics` of the operator process.
//!
//! `/readyz` is ready once the API server answered; a standby replica (not the leader) is ready
//! too, so a rollout of the operator Deployment does not wait on leadership.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use perspective_worker::http::{Readiness, METRICS_CONTENT_TYPE};
use tokio_util::sync::CancellationToken;

use crate::metrics::OperatorMetrics;

#[derive(Clone)]
struct AppState {
    readiness: Readiness,
    metrics: Arc<OperatorMetrics>,
}

/// Binds `addr` (port 0 picks a free one), returns the bound address, serves until `shutdown`.
pub async fn serve(
    addr: SocketAddr,
    readiness: Readiness,
    metrics: Arc<OperatorMetrics>,
    shutdown: CancellationToken,
) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let app = Router::new()
        .route("/livez", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(render_metrics))
        .with_state(AppState { readiness, metrics });
    tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await;
    });
    Ok(bound)
}

async fn readyz(State(state): State<AppState>) -> Response {
    match state.readiness.reason() {
        None => (StatusCode::OK, "ready").into_response(),
        Some(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {reason}"),
        )
            .into_response(),
    }
}

async fn render_metrics(State(state): State<AppState>) -> Response {
    (
        [(header::CONTENT_TYPE, METRICS_CONTENT_TYPE)],
        state.metrics.render(),
    )
        .into_response()
}
