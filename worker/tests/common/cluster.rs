//! PostgreSQL servers a test owns, beside the suite's shared one: a primary and a streaming
//! standby of it on loopback, to kill the one and promote the other. The binaries are those of
//! the suite's server (`PG_BINDIR`, set by `tests/pg/pg.sh`); as root, the servers run as the
//! `postgres` user (PostgreSQL refuses root). Dropping a [`Server`] stops it and removes its
//! directory.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;

pub struct Server {
    bindir: PathBuf,
    /// Holds `data/` and the server's log and socket.
    dir: PathBuf,
    port: u16,
}

impl Server {
    /// A fresh primary (initdb, then started).
    pub fn primary() -> Server {
        let server = Server::new("primary");
        run(
            as_postgres(server.bin("initdb"))
                .arg("-D")
                .arg(server.data())
                .args(["-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8"])
                .arg("--locale=C.UTF-8"),
            "initdb",
        );
        server.start();
        server
    }

    /// A standby streaming from `primary` (a base backup with `-R`, then started).
    pub fn standby_of(primary: &Server) -> Server {
        let server = Server::new("standby");
        run(
            as_postgres(server.bin("pg_basebackup"))
                .args([
                    "-h",
                    "127.0.0.1",
                    "-p",
                    &primary.port.to_string(),
                    "-U",
                    "postgres",
                ])
                .arg("-D")
                .arg(server.data())
                .args(["-R", "-X", "stream", "--no-sync"]),
            "pg_basebackup",
        );
        server.start();
        server
    }

    fn new(role: &str) -> Server {
        let bindir = PathBuf::from(std::env::var("PG_BINDIR").unwrap_or_else(|_| {
            panic!(
                "PG_BINDIR is not set: this test starts PostgreSQL servers of its own with the \
                 suite's binaries. Run it under `tests/pg/pg.sh with cargo test` (make test does)"
            )
        }));
        let dir = std::env::temp_dir().join(format!(
            "perspective-{role}-{}-{}",
            std::process::id(),
            uuid::Uuid::now_v7().simple()
        ));
        std::fs::create_dir_all(&dir).expect("server dir");
        if is_root() {
            run(Command::new("chown").arg("postgres").arg(&dir), "chown");
        }
        Server {
            bindir,
            dir,
            port: free_port(),
        }
    }

    fn bin(&self, name: &str) -> PathBuf {
        self.bindir.join(name)
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn start(&self) {
        let options = format!(
            "-c listen_addresses=127.0.0.1 -p {} -c unix_socket_directories={} -c fsync=off \
             -c full_page_writes=off -c max_connections=100 -c wal_level=replica",
            self.port,
            self.dir.display()
        );
        run(
            as_postgres(self.bin("pg_ctl"))
                .arg("-D")
                .arg(self.data())
                .arg("-l")
                .arg(self.dir.join("server.log"))
                .args(["-w", "-t", "60", "start", "-o", &options]),
            "pg_ctl start",
        );
    }

    /// `postgres://postgres@127.0.0.1:PORT/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// Stop at once, as a crash would (no shutdown checkpoint; clients see their sockets close).
    pub fn kill(&self) {
        self.pg_ctl(&["-m", "immediate", "-w", "stop"]);
    }

    /// Promote a standby to a primary, waiting until it accepts writes.
    pub fn promote(&self) {
        self.pg_ctl(&["-w", "-t", "60", "promote"]);
    }

    fn pg_ctl(&self, args: &[&str]) {
        run(
            as_postgres(self.bin("pg_ctl"))
                .arg("-D")
                .arg(self.data())
                .args(args),
            "pg_ctl",
        );
    }

    /// The server's log, for failure messages.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = as_postgres(self.bin("pg_ctl"))
            .arg("-D")
            .arg(self.data())
            .args(["-m", "immediate", "-w", "stop"])
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn is_root() -> bool {
    // SAFETY: getuid has no preconditions.
    unsafe { libc_getuid() == 0 }
}

extern "C" {
    #[link_name = "getuid"]
    fn libc_getuid() -> u32;
}

fn as_postgres(program: PathBuf) -> Command {
    if is_root() {
        let mut cmd = Command::new("runuser");
        cmd.args(["-u", "postgres", "--"]).arg(program);
        cmd
    } else {
        Command::new(program)
    }
}

fn run(cmd: &mut Command, what: &str) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: could not run: {e}"));
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    listener.local_addr().expect("its address").port()
}
