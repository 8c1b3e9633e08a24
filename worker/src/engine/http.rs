//! The worker's HTTP endpoints: `/livez`, `/readyz` and `/metrics`.
//!
//! Kubernetes probes and Prometheus scrape these (the operator points the StatefulSet's probes
//! and metrics port at them, DESIGN §7), so their semantics are deliberately narrow:
//!
//! - `/livez` answers 200 `ok` while the process serves HTTP, and 503 with the reason once the
//!   engine gave up through [`Readiness::set_not_live`]. It sends nothing to the database
//!   itself: the engine fails it only when its peers abandoned it (its heartbeat went stale)
//!   and its attempts to register again got no answer at all for a further stale threshold (a
//!   dead link; the engine's `health` and `epoch` modules). A database that answers with errors
//!   (down, dropped, not migrated) never fails it: restarting every worker pod would only add a
//!   thundering herd to the outage.
//! - `/readyz` answers 200 `ready` once the engine has said so through the shared
//!   [`Readiness`] handle (schema verified, first claim done), and 503 with the reason
//!   otherwise, so `kubectl describe pod` tells a person *why* a pod is not ready: it goes
//!   not ready within seconds when a claim or heartbeat fails or goes unanswered, and while an
//!   abandoned worker registers again. Shutdown flips it back to not ready first.
//! - `/metrics` renders [`WorkerMetrics`] in the Prometheus text format.
//!
//! The server binds before returning, so `127.0.0.1:0` yields a free port that the caller
//! learns (and logs), and it drains in-flight requests when the cancellation token fires.
//!
//! Slow clients cannot starve the probes ([`Limits`]): a connection has a few seconds to send
//! each request's headers, and at most a fixed number are open at once — a new connection
//! beyond that closes the oldest one, so a flood of idle or trickling connections (slow-loris)
//! cannot keep the kubelet's `/livez` out and get the pod restarted.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::engine::metrics::WorkerMetrics;

/// The content type of the Prometheus text exposition format.
pub const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4";

/// Whether the worker is ready for traffic, and if not, why. Cheap to clone; all clones share
/// one state.
#[derive(Clone)]
pub struct Readiness {
    inner: Arc<ReadinessInner>,
}

struct ReadinessInner {
    ready: AtomicBool,
    reason: Mutex<String>,
    /// Why `/livez` fails; `None` while the worker is live.
    not_live: Mutex<Option<String>>,
}

impl Readiness {
    /// A handle that is not ready, for `reason` (e.g. "migrations not verified").
    pub fn new(reason: impl Into<String>) -> Self {
        Readiness {
            inner: Arc::new(ReadinessInner {
                ready: AtomicBool::new(false),
                reason: Mutex::new(reason.into()),
                not_live: Mutex::new(None),
            }),
        }
    }

    /// Marks the worker ready.
    pub fn set_ready(&self) {
        self.inner.ready.store(true, Ordering::SeqCst);
    }

    /// Marks the worker not ready, for `reason` (shown in the 503 body).
    pub fn set_not_ready(&self, reason: impl Into<String>) {
        // Reason first, so a reader that sees "not ready" never sees a stale reason.
        *self.reason_lock() = reason.into();
        self.inner.ready.store(false, Ordering::SeqCst);
    }

    /// True once [`Readiness::set_ready`] was called (and not undone).
    pub fn is_ready(&self) -> bool {
        self.inner.ready.load(Ordering::SeqCst)
    }

    /// Why the worker is not ready; `None` when it is ready.
    pub fn reason(&self) -> Option<String> {
        if self.is_ready() {
            None
        } else {
            Some(self.reason_lock().clone())
        }
    }

    /// Makes `/livez` fail with `reason` (the kubelet restarts the pod after its failure
    /// threshold): for a worker that cannot recover by itself.
    pub fn set_not_live(&self, reason: impl Into<String>) {
        *lock(&self.inner.not_live) = Some(reason.into());
    }

    /// Makes `/livez` answer 200 again.
    pub fn set_live(&self) {
        *lock(&self.inner.not_live) = None;
    }

    /// Why `/livez` fails; `None` while the worker is live (the default).
    pub fn not_live(&self) -> Option<String> {
        lock(&self.inner.not_live).clone()
    }

    fn reason_lock(&self) -> std::sync::MutexGuard<'_, String> {
        // A panic while holding the lock cannot leave a String half-written; keep serving.
        self.inner
            .reason
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// A panic while holding the lock cannot leave the value half-written; keep serving.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Default for Readiness {
    /// Not ready: "starting".
    fn default() -> Self {
        Readiness::new("starting")
    }
}

impl std::fmt::Debug for Readiness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Readiness")
            .field("ready", &self.is_ready())
            .field("reason", &self.reason())
            .finish()
    }
}

/// Anything that renders Prometheus text: the worker's metrics, and the operator's, which
/// serves the same three endpoints.
pub trait MetricsSource: Send + Sync {
    /// The metrics in the Prometheus text exposition format.
    fn render(&self) -> String;
}

impl MetricsSource for WorkerMetrics {
    fn render(&self) -> String {
        WorkerMetrics::render(self)
    }
}

#[derive(Clone)]
struct AppState {
    readiness: Readiness,
    metrics: Arc<dyn MetricsSource>,
}

/// The endpoint router, for embedding in another server or testing without a socket.
pub fn router<M: MetricsSource + 'static>(readiness: Readiness, metrics: Arc<M>) -> Router {
    Router::new()
        .route("/livez", get(livez))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_handler))
        .with_state(AppState { readiness, metrics })
}

async fn livez(State(state): State<AppState>) -> Response {
    match state.readiness.not_live() {
        None => (StatusCode::OK, "ok").into_response(),
        Some(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not live: {reason}"),
        )
            .into_response(),
    }
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

async fn metrics_handler(State(state): State<AppState>) -> Response {
    (
        [(header::CONTENT_TYPE, METRICS_CONTENT_TYPE)],
        state.metrics.render(),
    )
        .into_response()
}

/// What one client may hold of the server.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Time to send a request's headers, from the connection's start or its previous response
    /// (so also how long an idle keep-alive connection stays open).
    pub header_read_timeout: Duration,
    /// Connections open at once; one more closes the oldest.
    pub max_connections: usize,
}

impl Default for Limits {
    /// 5 s for the headers (probes and scrapers send theirs at once), 128 connections.
    fn default() -> Self {
        Limits {
            header_read_timeout: Duration::from_secs(5),
            max_connections: 128,
        }
    }
}

/// Binds `addr` and serves the endpoints until `shutdown` is cancelled, then finishes the
/// requests in flight and returns. Returns the bound address (the real port when `addr` asked
/// for port 0) and the server task.
pub async fn serve<M: MetricsSource + 'static>(
    addr: SocketAddr,
    readiness: Readiness,
    metrics: Arc<M>,
    shutdown: CancellationToken,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>), std::io::Error> {
    serve_with(addr, readiness, metrics, shutdown, Limits::default()).await
}

/// [`serve`] with `limits`.
pub async fn serve_with<M: MetricsSource + 'static>(
    addr: SocketAddr,
    readiness: Readiness,
    metrics: Arc<M>,
    shutdown: CancellationToken,
    limits: Limits,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>), std::io::Error> {
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!("could not listen for HTTP on {addr}: {e}"),
        )
    })?;
    let local = listener.local_addr()?;
    tracing::info!("HTTP endpoints on http://{local} (/livez, /readyz, /metrics)");
    let app = router(readiness, metrics);
    let task = tokio::spawn(async move {
        let connections = TaskTracker::new();
        let open = OpenConnections::default();
        loop {
            let stream = tokio::select! {
                _ = shutdown.cancelled() => break,
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        // Out of file descriptors and the like: wait rather than spin.
                        tracing::warn!("HTTP endpoints on {local}: accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                },
            };
            let (id, evicted) = open.admit(limits.max_connections);
            let (open, shutdown, app) = (open.clone(), shutdown.clone(), app.clone());
            connections.spawn(async move {
                let connection = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(limits.header_read_timeout)
                    .serve_connection(TokioIo::new(stream), TowerToHyperService::new(app));
                tokio::pin!(connection);
                tokio::select! {
                    // Closed by the client, or timed out reading headers: either way done.
                    _ = connection.as_mut() => {}
                    // Dropping the connection closes it.
                    _ = evicted.cancelled() => {}
                    _ = shutdown.cancelled() => {
                        connection.as_mut().graceful_shutdown();
                        let _ = connection.await;
                    }
                }
                open.remove(id);
            });
        }
        connections.close();
        connections.wait().await;
        tracing::debug!("HTTP endpoints on {local} stopped");
    });
    Ok((local, task))
}

/// The open connections, oldest first, each with the token that closes it.
#[derive(Clone, Default)]
struct OpenConnections {
    inner: Arc<Mutex<(u64, BTreeMap<u64, CancellationToken>)>>,
}

impl OpenConnections {
    /// Registers a new connection, closing the oldest ones beyond `max` - 1; returns its id and
    /// the token that closes it.
    fn admit(&self, max: usize) -> (u64, CancellationToken) {
        let mut guard = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let (next, open) = &mut *guard;
        while open.len() >= max.max(1) {
            if let Some((_, oldest)) = open.pop_first() {
                oldest.cancel();
            }
        }
        let id = *next;
        *next += 1;
        let token = CancellationToken::new();
        open.insert(id, token.clone());
        (id, token)
    }

    fn remove(&self, id: u64) {
        let mut guard = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        guard.1.remove(&id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    struct Reply {
        status: u16,
        headers: String,
        body: String,
    }

    /// A minimal HTTP/1.1 GET: one request, `Connection: close`, read to EOF.
    async fn get(addr: SocketAddr, path: &str) -> std::io::Result<Reply> {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        stream
            .write_all(
                format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")
                    .as_bytes(),
            )
            .await?;
        let mut raw = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut raw))
            .await
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no reply"))??;
        let text = String::from_utf8(raw).expect("utf-8 reply");
        let (head, body) = text.split_once("\r\n\r\n").expect("header/body separator");
        let (status_line, headers) = head.split_once("\r\n").unwrap_or((head, ""));
        let status = status_line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .expect("status code");
        Ok(Reply {
            status,
            headers: headers.to_ascii_lowercase(),
            body: body.to_string(),
        })
    }

    async fn start() -> (
        SocketAddr,
        tokio::task::JoinHandle<()>,
        Readiness,
        Arc<WorkerMetrics>,
        CancellationToken,
    ) {
        let readiness = Readiness::new("migrations not verified");
        let metrics = Arc::new(WorkerMetrics::new());
        let token = CancellationToken::new();
        let (addr, task) = serve(
            "127.0.0.1:0".parse().unwrap(),
            readiness.clone(),
            metrics.clone(),
            token.clone(),
        )
        .await
        .expect("bind");
        assert_ne!(addr.port(), 0, "the real port is returned");
        (addr, task, readiness, metrics, token)
    }

    #[tokio::test]
    async fn livez_is_ok() {
        let (addr, _task, _r, _m, token) = start().await;
        let reply = get(addr, "/livez").await.unwrap();
        assert_eq!(reply.status, 200);
        assert_eq!(reply.body, "ok");
        token.cancel();
    }

    #[tokio::test]
    async fn livez_fails_with_the_reason_once_the_engine_gives_up() {
        let (addr, _task, readiness, _m, token) = start().await;
        readiness.set_not_live("abandoned and could not register again for 30 s");
        let reply = get(addr, "/livez").await.unwrap();
        assert_eq!(reply.status, 503);
        assert!(
            reply.body.contains("could not register again"),
            "{}",
            reply.body
        );
        readiness.set_live();
        let reply = get(addr, "/livez").await.unwrap();
        assert_eq!(reply.status, 200);
        assert_eq!(reply.body, "ok");
        token.cancel();
    }

    #[tokio::test]
    async fn readyz_reports_reason_until_ready() {
        let (addr, _task, readiness, _m, token) = start().await;
        let reply = get(addr, "/readyz").await.unwrap();
        assert_eq!(reply.status, 503);
        assert!(
            reply.body.contains("migrations not verified"),
            "{}",
            reply.body
        );

        readiness.set_not_ready("first claim pending");
        let reply = get(addr, "/readyz").await.unwrap();
        assert_eq!(reply.status, 503);
        assert!(reply.body.contains("first claim pending"), "{}", reply.body);

        readiness.set_ready();
        let reply = get(addr, "/readyz").await.unwrap();
        assert_eq!(reply.status, 200);
        assert_eq!(reply.body, "ready");

        readiness.set_not_ready("shutting down");
        let reply = get(addr, "/readyz").await.unwrap();
        assert_eq!(reply.status, 503);
        assert!(reply.body.contains("shutting down"), "{}", reply.body);
        token.cancel();
    }

    #[tokio::test]
    async fn metrics_are_prometheus_text() {
        let (addr, _task, _r, metrics, token) = start().await;
        metrics.batches.inc();
        let reply = get(addr, "/metrics").await.unwrap();
        assert_eq!(reply.status, 200);
        assert!(
            reply
                .headers
                .contains("content-type: text/plain; version=0.0.4"),
            "{}",
            reply.headers
        );
        assert!(
            reply.body.contains("perspective_batches_total 1"),
            "{}",
            reply.body
        );
        token.cancel();
    }

    #[tokio::test]
    async fn unknown_path_is_404() {
        let (addr, _task, _r, _m, token) = start().await;
        assert_eq!(get(addr, "/nope").await.unwrap().status, 404);
        token.cancel();
    }

    #[tokio::test]
    async fn server_stops_after_cancel() {
        let (addr, task, _r, _m, token) = start().await;
        assert_eq!(get(addr, "/livez").await.unwrap().status, 200);
        token.cancel();
        tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("server task ends after cancel")
            .expect("server task did not panic");
        let err = tokio::net::TcpStream::connect(addr)
            .await
            .expect_err("nothing listens after shutdown");
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused);
    }

    #[tokio::test]
    async fn bind_conflict_is_an_error() {
        let (addr, _task, _r, _m, token) = start().await;
        let err = serve(
            addr,
            Readiness::default(),
            Arc::new(WorkerMetrics::new()),
            CancellationToken::new(),
        )
        .await
        .expect_err("port already taken");
        assert!(err.to_string().contains(&addr.to_string()), "{err}");
        token.cancel();
    }

    /// Reads until the server closes the connection (EOF or reset); false on `within` expiring.
    async fn closed_within(stream: &mut tokio::net::TcpStream, within: Duration) -> bool {
        let mut buf = [0u8; 256];
        tokio::time::timeout(within, async {
            loop {
                match stream.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        })
        .await
        .is_ok()
    }

    /// Issue 12: slow-loris. Connections that never finish their headers are closed after the
    /// header timeout, more than the cap close the oldest, and `/livez` answers at once all along.
    #[tokio::test]
    async fn slow_clients_cannot_starve_livez() {
        let token = CancellationToken::new();
        let limits = Limits {
            header_read_timeout: Duration::from_secs(2),
            max_connections: 16,
        };
        let (addr, _task) = serve_with(
            "127.0.0.1:0".parse().unwrap(),
            Readiness::default(),
            Arc::new(WorkerMetrics::new()),
            token.clone(),
            limits,
        )
        .await
        .unwrap();
        // Three times the cap of clients that send half a request and then nothing.
        let mut slow = Vec::new();
        for _ in 0..3 * limits.max_connections {
            let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
            stream
                .write_all(b"GET /livez HTTP/1.1\r\nHost: x\r\n")
                .await
                .unwrap();
            slow.push(stream);
        }
        // The probe still gets in, at once.
        let reply = tokio::time::timeout(Duration::from_secs(1), get(addr, "/livez"))
            .await
            .expect("/livez answers within a second")
            .unwrap();
        assert_eq!(reply.status, 200);
        // The oldest slow clients were closed to make room.
        assert!(closed_within(&mut slow[0], Duration::from_secs(1)).await);
        // The newest is closed by the header timeout.
        let newest = slow.last_mut().unwrap();
        assert!(closed_within(newest, limits.header_read_timeout * 3).await);
        token.cancel();
    }

    #[test]
    fn readiness_clones_share_state() {
        let a = Readiness::default();
        let b = a.clone();
        assert!(!b.is_ready());
        assert_eq!(b.reason().as_deref(), Some("starting"));
        a.set_ready();
        assert!(b.is_ready());
        assert_eq!(b.reason(), None);
        b.set_not_ready("draining");
        assert!(!a.is_ready());
        assert_eq!(a.reason().as_deref(), Some("draining"));
    }
}
