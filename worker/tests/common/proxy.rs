//! A TCP proxy the tests own, between a worker and PostgreSQL, to make network faults on demand:
//!
//! - [`Proxy::cut`] stops forwarding in both directions without closing any socket, like a
//!   partition that silently drops packets: bytes already read wait in the proxy, new
//!   connections are accepted but never reach the server, and nothing tells either side.
//!   [`Proxy::heal`] resumes forwarding (what waited is delivered, as TCP's retransmission would).
//! - [`Proxy::set_upstream`] points new connections at another server (a promoted standby);
//!   [`Proxy::reset_connections`] closes every open one, like a server that went away.
//!
//! The proxy's own sockets stay alive during a cut, so TCP keepalives between the proxy and
//! either side are answered: a cut looks like a hung peer, not a dead host. That is the harder
//! case for the worker (only its statement deadlines notice it).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

pub struct Proxy {
    addr: SocketAddr,
    state: Arc<State>,
}

struct State {
    upstream: Mutex<SocketAddr>,
    /// True while cut.
    cut: watch::Sender<bool>,
    /// Cancelled to close every open connection (a fresh token replaces it).
    connections: Mutex<CancellationToken>,
    /// Ends the proxy.
    stop: CancellationToken,
}

impl Proxy {
    /// Listens on a free loopback port and forwards each connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy address");
        let state = Arc::new(State {
            upstream: Mutex::new(upstream),
            cut: watch::channel(false).0,
            connections: Mutex::new(CancellationToken::new()),
            stop: CancellationToken::new(),
        });
        tokio::spawn(accept(listener, state.clone()));
        Proxy { addr, state }
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `url` (a PostgreSQL URL) with its host and port replaced by the proxy's.
    pub fn url_for(&self, url: &str) -> String {
        with_address(url, self.addr)
    }

    /// Stop forwarding both ways; every socket stays open.
    pub fn cut(&self) {
        self.state.cut.send_replace(true);
    }

    /// Forward again, delivering what waited.
    pub fn heal(&self) {
        self.state.cut.send_replace(false);
    }

    /// New connections go to `upstream`; open ones stay where they are.
    pub fn set_upstream(&self, upstream: SocketAddr) {
        *self.state.upstream.lock().unwrap() = upstream;
    }

    /// Close every open connection (both sides see the socket close).
    pub fn reset_connections(&self) {
        let mut token = self.state.connections.lock().unwrap();
        token.cancel();
        *token = CancellationToken::new();
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.state.stop.cancel();
        self.state.connections.lock().unwrap().cancel();
    }
}

async fn accept(listener: TcpListener, state: Arc<State>) {
    loop {
        let client = tokio::select! {
            _ = state.stop.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((client, _)) => client,
                Err(_) => continue,
            },
        };
        let closed = state.connections.lock().unwrap().clone();
        tokio::spawn(connection(client, state.clone(), closed));
    }
}

/// One client connection: reaches the server once not cut, then pumps both ways until either
/// side closes or the connection is reset.
async fn connection(client: TcpStream, state: Arc<State>, closed: CancellationToken) {
    let _ = client.set_nodelay(true);
    let mut cut = state.cut.subscribe();
    let reached = async {
        wait_forwarding(&mut cut).await;
        let upstream = *state.upstream.lock().unwrap();
        TcpStream::connect(upstream).await
    };
    let server = tokio::select! {
        _ = closed.cancelled() => return,
        server = reached => match server {
            Ok(server) => server,
            Err(_) => return,
        },
    };
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    tokio::select! {
        _ = closed.cancelled() => {}
        _ = pump(client_read, server_write, state.cut.subscribe()) => {}
        _ = pump(server_read, client_write, state.cut.subscribe()) => {}
    }
}

/// Copies `from` to `to`, holding each chunk while the proxy is cut.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut cut: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        wait_forwarding(&mut cut).await;
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        wait_forwarding(&mut cut).await;
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

async fn wait_forwarding(cut: &mut watch::Receiver<bool>) {
    // The sender lives as long as the proxy's state, which every pump holds.
    let _ = cut.wait_for(|is_cut| !is_cut).await;
}

/// `url` (`postgres://[user[:password]@]host[:port][/db][?params]`) pointed at `addr`.
pub fn with_address(url: &str, addr: SocketAddr) -> String {
    let (scheme, rest) = url.split_once("://").expect("a postgres:// URL");
    let (start, end) = authority(rest);
    format!("{scheme}://{}{addr}{}", &rest[..start], &rest[end..])
}

/// The host and port of `url`, resolved.
pub fn address_of(url: &str) -> SocketAddr {
    use std::net::ToSocketAddrs;
    let (_, rest) = url.split_once("://").expect("a postgres:// URL");
    let (start, end) = authority(rest);
    let host_port = &rest[start..end];
    let host_port = match host_port.contains(':') {
        true => host_port.to_string(),
        false => format!("{host_port}:5432"),
    };
    host_port
        .to_socket_addrs()
        .expect("resolve the database host")
        .next()
        .expect("an address for the database host")
}

/// Where `host[:port]` is in a URL after its `scheme://`.
fn authority(rest: &str) -> (usize, usize) {
    let start = rest.find('@').map_or(0, |at| at + 1);
    let end = rest[start..]
        .find(['/', '?'])
        .map_or(rest.len(), |i| start + i);
    (start, end)
}
