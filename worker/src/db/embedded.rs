//! A zero-setup PostgreSQL for `perspective-worker run` and `demo` when `DATABASE_URL` is unset.
//!
//! Trying the worker should not start with "first provision a database". When no URL is given,
//! the CLI starts a private PostgreSQL server from the machine's own server binaries (the
//! Debian/Ubuntu `postgresql` package layout, `$PG_BINDIR`, or `pg_config --bindir`) in a local
//! data directory, and says so. The data directory is initialized once and reused on every
//! later start, so read models and events survive restarts like they would with a real server.
//!
//! Choices worth knowing:
//!
//! - **Loopback only, trust auth.** The server listens on `127.0.0.1` on a port picked fresh at
//!   every start (bind port 0), and its Unix socket lives inside the data directory, so it never
//!   collides with a system cluster on 5432 or `/var/run/postgresql`. Trust auth is acceptable
//!   because only local processes can reach it; it is a development convenience, not a
//!   deployment mode (in Kubernetes, the operator always passes a real `DATABASE_URL`).
//! - **Root.** PostgreSQL refuses to run as root, and containers and CI often run as root. Then
//!   `initdb` and `pg_ctl` run as the `postgres` system user (created by the `postgresql`
//!   package) through `runuser`, the data directory is chowned to that user, and every ancestor
//!   of the data directory must be traversable by it; that is checked up front so the user gets a
//!   plain sentence instead of a server log.
//! - **One server per data directory.** When a server is already running on the data directory
//!   (another `run` or `demo` in a second terminal), it is reused: its port is read from
//!   `postmaster.pid`. Only the process that started a server stops it, so the second process
//!   exiting never pulls the database from under the first. The starting process records its
//!   pid in `embedded-owner.pid`; a server whose owner died without stopping it (SIGKILL, a
//!   crash) is adopted by the next start, so it does not keep running forever.
//! - **Failures are explained.** Every error carries the command line, its exit status, its
//!   output and the tail of the server log.

use std::fmt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use tokio::process::Command;

/// How many fresh ports `start` tries before giving up (another process may grab the port
/// between our probe and the server's bind).
const START_ATTEMPTS: usize = 5;
/// `pg_ctl -w` timeout, in seconds, for start (crash recovery after an unclean stop included).
const PG_CTL_TIMEOUT_SECS: &str = "120";
/// How many server log lines an error shows.
const LOG_TAIL_LINES: usize = 25;
/// The server log, inside the data directory (written by `pg_ctl -l`).
const SERVER_LOG: &str = "embedded-server.log";
/// The pid of the process that started the running server, inside the data directory.
const OWNER_FILE: &str = "embedded-owner.pid";
/// Longest socket directory that still fits `<dir>/.s.PGSQL.65535` in `sun_path` (108 bytes).
const MAX_SOCKET_DIR_LEN: usize = 107 - "/.s.PGSQL.65535".len();

/// Why the embedded server could not be started or stopped.
#[derive(Debug, thiserror::Error)]
pub enum EmbeddedError {
    /// No PostgreSQL server binaries on this machine.
    #[error(
        "DATABASE_URL is not set and no PostgreSQL server binaries were found to start an \
         embedded server (looked at $PG_BINDIR, /usr/lib/postgresql/*/bin and `pg_config \
         --bindir`). Install the `postgresql` package (e.g. `apt-get install postgresql`), set \
         PG_BINDIR to the directory holding `postgres` and `initdb`, or set DATABASE_URL to use \
         an existing server"
    )]
    BinariesNotFound,

    /// Running as root without a `postgres` user to run the server as.
    #[error(
        "running as root, and PostgreSQL refuses to run as root, but there is no `postgres` \
         system user to run it as ({detail}). Install the `postgresql` package (it creates the \
         user), run as an unprivileged user, or set DATABASE_URL"
    )]
    NoPostgresUser { detail: String },

    /// Running as root, and the `postgres` user cannot reach the data directory.
    #[error(
        "running as root, so the embedded PostgreSQL runs as the `postgres` user, but that user \
         cannot traverse {dir} to reach the data directory {data_dir}. Choose a data directory \
         the `postgres` user can reach (e.g. under /var/lib or /tmp), make every parent \
         directory traversable (`chmod o+x`), or set DATABASE_URL"
    )]
    NotTraversable { dir: PathBuf, data_dir: PathBuf },

    /// The data directory belongs to another major version than the server binaries.
    #[error(
        "the data directory {data_dir} was initialized by PostgreSQL {data_version}, but the \
         server binaries in {bindir} are PostgreSQL {binary_version}. Use a new data \
         directory, point PG_BINDIR at PostgreSQL {data_version} binaries, or upgrade the data \
         with pg_upgrade"
    )]
    VersionMismatch {
        data_dir: PathBuf,
        data_version: String,
        binary_version: String,
        bindir: PathBuf,
    },

    /// A file-system operation failed.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },

    /// A command (`initdb`, `pg_ctl`, …) failed or could not be run.
    #[error("{}", describe_command_failure(.command, .status, .output, .log_path, .log_tail))]
    Command {
        /// The command line, arguments separated by spaces.
        command: String,
        /// Its exit status, or why it could not be run at all.
        status: String,
        /// What it printed (stdout and stderr), trimmed.
        output: String,
        /// The server log the tail was read from, if any.
        log_path: Option<PathBuf>,
        /// The last lines of the server log (empty when there is none).
        log_tail: String,
    },
}

fn describe_command_failure(
    command: &str,
    status: &str,
    output: &str,
    log_path: &Option<PathBuf>,
    log_tail: &str,
) -> String {
    let mut s = format!("`{command}` failed ({status})");
    if !output.trim().is_empty() {
        s.push_str("\ncommand output:\n");
        s.push_str(output.trim_end());
    }
    if let Some(path) = log_path {
        if !log_tail.trim().is_empty() {
            s.push_str(&format!(
                "\nlast lines of the server log {}:\n",
                path.display()
            ));
            s.push_str(log_tail.trim_end());
        }
    }
    s
}

fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> EmbeddedError {
    let context = context.into();
    move |source| EmbeddedError::Io { context, source }
}

/// A PostgreSQL server running on a local data directory, reachable on `127.0.0.1`.
///
/// Stop it with [`EmbeddedPostgres::stop`]; dropping an owning handle stops the server too
/// (synchronously, best effort). A handle is the owner when it started the server, or adopted
/// one whose starting process is gone; a handle that reused a server another live process
/// started never stops it.
pub struct EmbeddedPostgres {
    bindir: PathBuf,
    data_dir: PathBuf,
    port: u16,
    version: String,
    /// Run server commands as the `postgres` user through `runuser` (we are root).
    as_postgres: bool,
    /// `start` found the server already running.
    reused: bool,
    /// This handle stops the server (it started it, or adopted an orphan).
    owned: bool,
    stopped: bool,
}

impl fmt::Debug for EmbeddedPostgres {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EmbeddedPostgres")
            .field("url", &self.url())
            .field("data_dir", &self.data_dir)
            .field("version", &self.version)
            .field("bindir", &self.bindir)
            .field("as_postgres", &self.as_postgres)
            .field("reused", &self.reused)
            .field("owner", &self.owned)
            .field("stopped", &self.stopped)
            .finish()
    }
}

impl EmbeddedPostgres {
    /// Starts (or reuses) a server on `data_dir`, initializing the directory on first use.
    ///
    /// `data_dir` is the PostgreSQL data directory itself; it and its parents are created when
    /// missing.
    pub async fn start(data_dir: &Path) -> Result<EmbeddedPostgres, EmbeddedError> {
        let bindir = find_bindir().await.ok_or(EmbeddedError::BinariesNotFound)?;
        let version = server_version(&bindir).await?;
        let as_postgres = effective_uid().await == Some(0);

        let data_dir = std::path::absolute(data_dir).map_err(io_err(format!(
            "resolving the data directory {}",
            data_dir.display()
        )))?;
        prepare_data_dir(&data_dir, as_postgres).await?;
        // Resolve symlinks once the directory exists: postmaster.pid records the real path.
        let data_dir = data_dir.canonicalize().map_err(io_err(format!(
            "resolving the data directory {}",
            data_dir.display()
        )))?;

        let mut pg = EmbeddedPostgres {
            bindir,
            data_dir,
            port: 0,
            version,
            as_postgres,
            reused: false,
            owned: false,
            stopped: false,
        };

        if pg.data_dir.join("PG_VERSION").exists() {
            pg.check_data_version()?;
            if let Some(port) = pg.running_server_port().await? {
                pg.port = port;
                pg.reused = true;
                match pg.live_owner() {
                    Some(owner) => tracing::info!(
                        "reusing embedded PostgreSQL {} already running on 127.0.0.1:{} (data \
                         directory {}; started by process {owner}, which will stop it)",
                        pg.version,
                        pg.port,
                        pg.data_dir.display()
                    ),
                    None => {
                        pg.write_owner_file();
                        pg.owned = true;
                        tracing::info!(
                            "adopting embedded PostgreSQL {} left running on 127.0.0.1:{} \
                             (data directory {}) by a process that has exited",
                            pg.version,
                            pg.port,
                            pg.data_dir.display()
                        );
                    }
                }
                return Ok(pg);
            }
        } else {
            pg.initdb().await?;
        }

        pg.start_server().await?;
        pg.write_owner_file();
        pg.owned = true;
        tracing::info!(
            "started embedded PostgreSQL {} on 127.0.0.1:{} (data directory {})",
            pg.version,
            pg.port,
            pg.data_dir.display()
        );
        Ok(pg)
    }

    /// `postgres://postgres@127.0.0.1:PORT/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// The TCP port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The (absolute, canonical) data directory.
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// The server version, e.g. `15.18`.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// True when `start` found a server already running on the data directory and reused it.
    pub fn is_reused(&self) -> bool {
        self.reused
    }

    /// True when this handle stops the server on [`EmbeddedPostgres::stop`] and drop: it
    /// started the server, or reused one whose starting process has exited.
    pub fn is_owner(&self) -> bool {
        self.owned
    }

    /// Stops the server (`pg_ctl -m fast -w stop`) if this handle owns it; a server another
    /// live process started keeps running for that process.
    pub async fn stop(mut self) -> Result<(), EmbeddedError> {
        self.stopped = true;
        if !self.owned {
            tracing::info!(
                "leaving embedded PostgreSQL on 127.0.0.1:{} running: another process started it",
                self.port
            );
            return Ok(());
        }
        let data_dir = self.data_dir.to_string_lossy().into_owned();
        let log = self.log_path();
        self.run_pg(
            "pg_ctl",
            &["-D", &data_dir, "-m", "fast", "-w", "stop"],
            Some(&log),
        )
        .await?;
        let _ = std::fs::remove_file(self.data_dir.join(OWNER_FILE));
        tracing::info!(
            "stopped embedded PostgreSQL on 127.0.0.1:{} (data directory {})",
            self.port,
            self.data_dir.display()
        );
        Ok(())
    }

    fn log_path(&self) -> PathBuf {
        self.data_dir.join(SERVER_LOG)
    }

    /// Records this process as the one that stops the server.
    fn write_owner_file(&self) {
        let path = self.data_dir.join(OWNER_FILE);
        if let Err(e) = std::fs::write(&path, format!("{}\n", std::process::id())) {
            tracing::warn!("could not write {}: {e}", path.display());
        }
    }

    /// The pid in the owner file, if that process still runs. Without `/proc` we cannot tell,
    /// and assume it does (never stopping a server is safer than stopping someone else's).
    fn live_owner(&self) -> Option<u32> {
        let text = std::fs::read_to_string(self.data_dir.join(OWNER_FILE)).ok()?;
        let pid: u32 = text.trim().parse().ok()?;
        let alive =
            !Path::new("/proc/self").exists() || Path::new(&format!("/proc/{pid}")).exists();
        alive.then_some(pid)
    }

    fn check_data_version(&self) -> Result<(), EmbeddedError> {
        let path = self.data_dir.join("PG_VERSION");
        let data_version = std::fs::read_to_string(&path)
            .map_err(io_err(format!("reading {}", path.display())))?
            .trim()
            .to_string();
        let binary_major = major_version(&self.version);
        if !binary_major.is_empty() && data_version != binary_major {
            return Err(EmbeddedError::VersionMismatch {
                data_dir: self.data_dir.clone(),
                data_version,
                binary_version: self.version.clone(),
                bindir: self.bindir.clone(),
            });
        }
        Ok(())
    }

    async fn initdb(&self) -> Result<(), EmbeddedError> {
        tracing::info!(
            "initializing the embedded PostgreSQL data directory {}",
            self.data_dir.display()
        );
        let data_dir = self.data_dir.to_string_lossy().into_owned();
        self.run_pg(
            "initdb",
            &[
                "-D",
                &data_dir,
                "--auth=trust",
                "-U",
                "postgres",
                "-E",
                "UTF8",
                "--locale=C.UTF-8",
            ],
            None,
        )
        .await?;
        Ok(())
    }

    /// The port of a server already running on the data directory, waiting for one that is
    /// still starting up; `None` when no server runs there (a stale `postmaster.pid` included).
    async fn running_server_port(&self) -> Result<Option<u16>, EmbeddedError> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let Some(pid_file) = self.read_postmaster_pid() else {
                return Ok(None);
            };
            if !self.server_alive().await? {
                return Ok(None);
            }
            match pid_file.status.as_deref() {
                // Pre-10 servers write no status line; "ready" is the steady state.
                Some("ready") | None if pid_file.port.is_some() => return Ok(pid_file.port),
                _ if Instant::now() > deadline => {
                    return Err(EmbeddedError::Command {
                        command: format!(
                            "waiting for the server on {} to become ready",
                            self.data_dir.display()
                        ),
                        status: format!(
                            "postmaster.pid still says {:?} after 60 s",
                            pid_file.status.unwrap_or_default()
                        ),
                        output: String::new(),
                        log_path: Some(self.log_path()),
                        log_tail: log_tail(&self.log_path()),
                    })
                }
                // "starting", "stopping", "standby": wait for it to settle (a stopping server
                // disappears, and then we start our own).
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    /// `pg_ctl status`: 0 running, 3 not running; anything else is an error worth reporting.
    async fn server_alive(&self) -> Result<bool, EmbeddedError> {
        let data_dir = self.data_dir.to_string_lossy().into_owned();
        let (command, mut cmd) = self.pg_command("pg_ctl", &["-D", &data_dir, "status"]);
        let out = cmd
            .output()
            .await
            .map_err(|e| self.spawn_failure(&command, e, None))?;
        match out.status.code() {
            Some(0) => Ok(true),
            Some(3) => Ok(false),
            _ => Err(EmbeddedError::Command {
                command,
                status: out.status.to_string(),
                output: combined_output(&out.stdout, &out.stderr),
                log_path: None,
                log_tail: String::new(),
            }),
        }
    }

    fn read_postmaster_pid(&self) -> Option<PostmasterPid> {
        let text = std::fs::read_to_string(self.data_dir.join("postmaster.pid")).ok()?;
        Some(PostmasterPid::parse(&text))
    }

    /// `pg_ctl -w start` on a fresh free port, retrying a few ports.
    async fn start_server(&mut self) -> Result<(), EmbeddedError> {
        let data_dir = self.data_dir.to_string_lossy().into_owned();
        let log = self.log_path();
        let log_arg = log.to_string_lossy().into_owned();
        let socket_dir = socket_dir_setting(&self.data_dir);
        let mut last_err = None;
        for attempt in 1..=START_ATTEMPTS {
            let port = free_port().map_err(io_err("picking a free port on 127.0.0.1"))?;
            let log_offset = std::fs::metadata(&log).map(|m| m.len()).unwrap_or(0);
            // pg_ctl hands `-o` to /bin/sh, hence the shell quoting of the socket directory.
            let options = format!(
                "-c listen_addresses=127.0.0.1 -p {port} -c unix_socket_directories='{socket_dir}'"
            );
            match self
                .run_pg(
                    "pg_ctl",
                    &[
                        "-D",
                        &data_dir,
                        "-l",
                        &log_arg,
                        "-w",
                        "-t",
                        PG_CTL_TIMEOUT_SECS,
                        "-o",
                        &options,
                        "start",
                    ],
                    Some(&log),
                )
                .await
            {
                Ok(_) => {
                    self.port = port;
                    return Ok(());
                }
                Err(e) => {
                    // Only a lost race for the port is worth another try; a broken config or
                    // data directory fails the same way on every port.
                    let this_attempt = log_since(&log, log_offset);
                    let port_taken = this_attempt.contains("Address already in use")
                        || this_attempt.contains("could not create any TCP/IP sockets")
                        || this_attempt.contains("could not bind");
                    // A server that came up anyway (e.g. pg_ctl timed out) must not linger.
                    if self.server_alive().await.unwrap_or(false) {
                        let _ = self
                            .run_pg(
                                "pg_ctl",
                                &["-D", &data_dir, "-m", "immediate", "-w", "stop"],
                                None,
                            )
                            .await;
                    }
                    if !port_taken {
                        return Err(e);
                    }
                    tracing::warn!(
                        "embedded PostgreSQL could not bind 127.0.0.1:{port} (attempt \
                         {attempt}/{START_ATTEMPTS}); trying another port"
                    );
                    last_err = Some(e);
                }
            }
        }
        Err(last_err.expect("at least one attempt"))
    }

    /// Builds a server-side command, through `runuser -u postgres --` when we are root.
    /// Returns the printable command line and the command.
    fn pg_command(&self, program: &str, args: &[&str]) -> (String, Command) {
        let bin = self.bindir.join(program);
        let mut words: Vec<String> = Vec::new();
        if self.as_postgres {
            words.extend(["runuser", "-u", "postgres", "--"].map(String::from));
        }
        words.push(bin.to_string_lossy().into_owned());
        words.extend(args.iter().map(|a| a.to_string()));
        let printable = words
            .iter()
            .map(|w| shell_quote(w))
            .collect::<Vec<_>>()
            .join(" ");
        let mut cmd = Command::new(&words[0]);
        cmd.args(&words[1..])
            // The `postgres` user may not be able to enter our working directory; the server
            // tools complain when they cannot. All paths we pass are absolute.
            .current_dir("/")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Server tools read these; an inherited value would point them elsewhere.
            .env_remove("PGDATA")
            .env_remove("PGPORT")
            .env_remove("PGHOST");
        (printable, cmd)
    }

    /// Runs a server-side command to completion; a non-zero exit is an error carrying its
    /// output and, when given, the tail of the server log.
    async fn run_pg(
        &self,
        program: &str,
        args: &[&str],
        log: Option<&Path>,
    ) -> Result<String, EmbeddedError> {
        let (command, mut cmd) = self.pg_command(program, args);
        let out = cmd
            .output()
            .await
            .map_err(|e| self.spawn_failure(&command, e, log))?;
        let output = combined_output(&out.stdout, &out.stderr);
        if out.status.success() {
            tracing::debug!(command = %command, "{}", output.trim_end());
            Ok(output)
        } else {
            Err(command_error(command, out.status, output, log))
        }
    }

    fn spawn_failure(
        &self,
        command: &str,
        err: std::io::Error,
        log: Option<&Path>,
    ) -> EmbeddedError {
        let hint = if self.as_postgres && err.kind() == std::io::ErrorKind::NotFound {
            " (runuser, from util-linux, is needed to run PostgreSQL as the `postgres` user)"
        } else {
            ""
        };
        EmbeddedError::Command {
            command: command.to_string(),
            status: format!("could not be run: {err}{hint}"),
            output: String::new(),
            log_path: log.map(Path::to_path_buf),
            log_tail: log.map(log_tail).unwrap_or_default(),
        }
    }
}

impl Drop for EmbeddedPostgres {
    /// Best effort: stops a server this handle started and nobody stopped explicitly, so a
    /// panic or an early return does not leave a server behind. Blocking, but short.
    fn drop(&mut self) {
        if self.stopped || !self.owned {
            return;
        }
        let bin = self.bindir.join("pg_ctl");
        let mut cmd = if self.as_postgres {
            let mut c = std::process::Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(bin);
            c
        } else {
            std::process::Command::new(bin)
        };
        cmd.arg("-D")
            .arg(&self.data_dir)
            .args(["-m", "fast", "-w", "stop"])
            .current_dir("/")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        match cmd.status() {
            Ok(status) if status.success() => {
                let _ = std::fs::remove_file(self.data_dir.join(OWNER_FILE));
                tracing::info!(
                    "stopped embedded PostgreSQL on 127.0.0.1:{} (data directory {})",
                    self.port,
                    self.data_dir.display()
                )
            }
            Ok(status) => tracing::warn!(
                "could not stop embedded PostgreSQL on {} ({status})",
                self.data_dir.display()
            ),
            Err(e) => tracing::warn!(
                "could not stop embedded PostgreSQL on {}: {e}",
                self.data_dir.display()
            ),
        }
    }
}

/// The lines of `postmaster.pid` we use (see PostgreSQL's `pidfile.h`).
struct PostmasterPid {
    port: Option<u16>,
    status: Option<String>,
}

impl PostmasterPid {
    fn parse(text: &str) -> Self {
        let lines: Vec<&str> = text.lines().collect();
        PostmasterPid {
            port: lines.get(3).and_then(|l| l.trim().parse().ok()),
            status: lines
                .get(7)
                .map(|l| l.trim().to_string())
                .filter(|s| !s.is_empty()),
        }
    }
}

/// The server bin directory: `$PG_BINDIR`, the newest `/usr/lib/postgresql/*/bin`, or
/// `pg_config --bindir`; each must hold `postgres` and `initdb` (`pg_ctl` is checked too, as
/// we need it).
async fn find_bindir() -> Option<PathBuf> {
    let usable = |d: &Path| {
        ["postgres", "initdb", "pg_ctl"]
            .iter()
            .all(|b| d.join(b).is_file())
    };
    if let Some(d) = std::env::var_os("PG_BINDIR").map(PathBuf::from) {
        if usable(&d) {
            return Some(d);
        }
        tracing::warn!(
            "PG_BINDIR={} does not hold postgres, initdb and pg_ctl; looking elsewhere",
            d.display()
        );
    }
    if let Ok(entries) = std::fs::read_dir("/usr/lib/postgresql") {
        let mut versioned: Vec<(Vec<u64>, PathBuf)> = entries
            .filter_map(Result::ok)
            .map(|e| {
                let key = version_key(&e.file_name().to_string_lossy());
                (key, e.path().join("bin"))
            })
            .filter(|(_, bin)| usable(bin))
            .collect();
        versioned.sort();
        if let Some((_, bin)) = versioned.pop() {
            return Some(bin);
        }
    }
    let out = Command::new("pg_config")
        .arg("--bindir")
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .await
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let d = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    usable(&d).then_some(d)
}

/// "15" → [15], "9.6" → [9, 6]: a sort key like `sort -V`.
fn version_key(name: &str) -> Vec<u64> {
    name.split(|c: char| !c.is_ascii_digit())
        .filter(|p| !p.is_empty())
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// `postgres --version` → "15.18".
async fn server_version(bindir: &Path) -> Result<String, EmbeddedError> {
    let bin = bindir.join("postgres");
    let command = format!("{} --version", bin.display());
    let out = Command::new(&bin)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|e| EmbeddedError::Command {
            command: command.clone(),
            status: format!("could not be run: {e}"),
            output: String::new(),
            log_path: None,
            log_tail: String::new(),
        })?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        return Err(command_error(
            command,
            out.status,
            combined_output(&out.stdout, &out.stderr),
            None,
        ));
    }
    // "postgres (PostgreSQL) 15.18 (Debian 15.18-0+deb12u1)"
    let version = text
        .split_whitespace()
        .skip_while(|w| *w != "(PostgreSQL)")
        .nth(1)
        .or_else(|| text.split_whitespace().last())
        .unwrap_or("unknown")
        .to_string();
    Ok(version)
}

/// "15.18" → "15"; "9.6.24" → "9.6" (the data directory's PG_VERSION format).
fn major_version(version: &str) -> String {
    let parts: Vec<&str> = version
        .split('.')
        .map(|p| {
            let digits = p.find(|c: char| !c.is_ascii_digit()).unwrap_or(p.len());
            &p[..digits]
        })
        .collect();
    match parts.first().and_then(|p| p.parse::<u32>().ok()) {
        Some(major) if major >= 10 => major.to_string(),
        Some(major) => match parts.get(1) {
            Some(minor) => format!("{major}.{minor}"),
            None => major.to_string(),
        },
        None => String::new(),
    }
}

/// The effective uid: the owner of `/proc/self`, else `id -u`.
async fn effective_uid() -> Option<u32> {
    if let Ok(meta) = std::fs::metadata("/proc/self") {
        return Some(meta.uid());
    }
    id_number(&["-u"]).await
}

/// `id ARGS` parsed as a number.
async fn id_number(args: &[&str]) -> Option<u32> {
    let out = Command::new("id")
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .await
        .ok()?;
    if !out.status.success() {
        return None;
    }
    String::from_utf8_lossy(&out.stdout).trim().parse().ok()
}

/// Creates the data directory (mode 0700, as PostgreSQL demands) and, when we are root, hands
/// it to the `postgres` user after checking that user can reach it.
async fn prepare_data_dir(data_dir: &Path, as_postgres: bool) -> Result<(), EmbeddedError> {
    let existed = data_dir.exists();
    std::fs::create_dir_all(data_dir).map_err(io_err(format!(
        "creating the data directory {}",
        data_dir.display()
    )))?;
    if !as_postgres {
        if !existed {
            std::fs::set_permissions(data_dir, std::fs::Permissions::from_mode(0o700)).map_err(
                io_err(format!("restricting permissions of {}", data_dir.display())),
            )?;
        }
        return Ok(());
    }

    let (Some(uid), Some(gid)) = (
        id_number(&["-u", "postgres"]).await,
        id_number(&["-g", "postgres"]).await,
    ) else {
        return Err(EmbeddedError::NoPostgresUser {
            detail: "`id -u postgres` found no such user".into(),
        });
    };

    // Every ancestor must be traversable by `postgres`; ask the kernel as that user, which
    // also honours ACLs, and name the first directory that blocks it.
    if let Some(parent) = data_dir.parent() {
        if !postgres_can_traverse(parent).await? {
            let blocker = parent
                .ancestors()
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .find(|a| {
                    std::fs::metadata(a)
                        .map(|m| {
                            let mode = m.mode();
                            let ok = if m.uid() == uid {
                                mode & 0o100 != 0
                            } else if m.gid() == gid {
                                mode & 0o010 != 0
                            } else {
                                mode & 0o001 != 0
                            };
                            !ok
                        })
                        .unwrap_or(true)
                })
                .unwrap_or(parent)
                .to_path_buf();
            return Err(EmbeddedError::NotTraversable {
                dir: blocker,
                data_dir: data_dir.to_path_buf(),
            });
        }
    }

    let meta = std::fs::metadata(data_dir)
        .map_err(io_err(format!("inspecting {}", data_dir.display())))?;
    if meta.uid() != uid {
        std::os::unix::fs::chown(data_dir, Some(uid), Some(gid)).map_err(io_err(format!(
            "handing the data directory {} to the `postgres` user",
            data_dir.display()
        )))?;
    }
    if meta.mode() & 0o077 != 0 && !data_dir.join("PG_VERSION").exists() {
        std::fs::set_permissions(data_dir, std::fs::Permissions::from_mode(0o700)).map_err(
            io_err(format!("restricting permissions of {}", data_dir.display())),
        )?;
    }
    Ok(())
}

/// `runuser -u postgres -- test -x DIR`: can the `postgres` user search `dir` (and so every
/// directory on the way to it)?
async fn postgres_can_traverse(dir: &Path) -> Result<bool, EmbeddedError> {
    let out = Command::new("runuser")
        .args(["-u", "postgres", "--", "test", "-x"])
        .arg(dir)
        .current_dir("/")
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|e| EmbeddedError::Command {
            command: format!("runuser -u postgres -- test -x {}", dir.display()),
            status: format!(
                "could not be run: {e} (runuser, from util-linux, is needed to run PostgreSQL \
                 as the `postgres` user when running as root)"
            ),
            output: String::new(),
            log_path: None,
            log_tail: String::new(),
        })?;
    match out.status.code() {
        Some(0) => Ok(true),
        Some(1) => Ok(false),
        _ => Err(EmbeddedError::NoPostgresUser {
            detail: format!(
                "`runuser -u postgres` failed ({}): {}",
                out.status,
                combined_output(&out.stdout, &out.stderr).trim()
            ),
        }),
    }
}

/// The `unix_socket_directories` value: the data directory, or empty (TCP only) when its path
/// is too long for a socket address or would need quoting inside the setting.
fn socket_dir_setting(data_dir: &Path) -> String {
    match data_dir.to_str() {
        Some(s)
            if s.len() <= MAX_SOCKET_DIR_LEN
                && !s
                    .chars()
                    .any(|c| c.is_whitespace() || matches!(c, ',' | '"' | '\'' | '\\')) =>
        {
            s.to_string()
        }
        _ => String::new(),
    }
}

fn free_port() -> std::io::Result<u16> {
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0))?;
    Ok(listener.local_addr()?.port())
}

fn combined_output(stdout: &[u8], stderr: &[u8]) -> String {
    let mut s = String::from_utf8_lossy(stdout).into_owned();
    let err = String::from_utf8_lossy(stderr);
    if !err.trim().is_empty() {
        if !s.is_empty() && !s.ends_with('\n') {
            s.push('\n');
        }
        s.push_str(&err);
    }
    s
}

fn command_error(
    command: String,
    status: ExitStatus,
    output: String,
    log: Option<&Path>,
) -> EmbeddedError {
    EmbeddedError::Command {
        command,
        status: status.to_string(),
        output,
        log_path: log.map(Path::to_path_buf),
        log_tail: log.map(log_tail).unwrap_or_default(),
    }
}

/// The last lines of a log file ("" when it cannot be read).
fn log_tail(path: &Path) -> String {
    let Ok(bytes) = std::fs::read(path) else {
        return String::new();
    };
    let text = String::from_utf8_lossy(&bytes);
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join("\n")
}

/// What a log file gained after `offset` ("" when it cannot be read).
fn log_since(path: &Path, offset: u64) -> String {
    let Ok(bytes) = std::fs::read(path) else {
        return String::new();
    };
    let start = usize::try_from(offset)
        .unwrap_or(usize::MAX)
        .min(bytes.len());
    String::from_utf8_lossy(&bytes[start..]).into_owned()
}

/// Quotes a word for display (and copy-paste into a shell) when it needs it.
fn shell_quote(word: &str) -> String {
    if !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "/._-=:,+@%".contains(c))
    {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_postmaster_pid() {
        let text =
            "4242\n/tmp/x/data\n1700000000\n54321\n/tmp/x/data\n127.0.0.1\n  1 2\nready   \n";
        let pid = PostmasterPid::parse(text);
        assert_eq!(pid.port, Some(54321));
        assert_eq!(pid.status.as_deref(), Some("ready"));
        let starting = PostmasterPid::parse("1\n/d\n1\n5432\n\n127.0.0.1\n0 0\nstarting\n");
        assert_eq!(starting.status.as_deref(), Some("starting"));
        let partial = PostmasterPid::parse("1\n/d\n");
        assert_eq!(partial.port, None);
        assert_eq!(partial.status, None);
    }

    #[test]
    fn major_versions() {
        assert_eq!(major_version("15.18"), "15");
        assert_eq!(major_version("17beta1"), "17");
        assert_eq!(major_version("9.6.24"), "9.6");
        assert_eq!(major_version("unknown"), "");
    }

    #[test]
    fn version_sort_key_orders_numerically() {
        let mut v = vec![version_key("9.6"), version_key("15"), version_key("10")];
        v.sort();
        assert_eq!(v, vec![vec![9, 6], vec![10], vec![15]]);
    }

    #[test]
    fn socket_dir_falls_back_to_tcp_only() {
        assert_eq!(socket_dir_setting(Path::new("/tmp/x/data")), "/tmp/x/data");
        assert_eq!(socket_dir_setting(Path::new("/tmp/my dir/data")), "");
        let long = format!("/tmp/{}", "a".repeat(120));
        assert_eq!(socket_dir_setting(Path::new(&long)), "");
    }

    #[test]
    fn command_errors_show_command_status_output_and_log() {
        let err = EmbeddedError::Command {
            command: "pg_ctl -D /d start".into(),
            status: "exit status: 1".into(),
            output: "pg_ctl: could not start server\n".into(),
            log_path: Some(PathBuf::from("/d/embedded-server.log")),
            log_tail: "FATAL:  lock file \"postmaster.pid\" already exists".into(),
        };
        let text = err.to_string();
        assert!(
            text.contains("`pg_ctl -D /d start` failed (exit status: 1)"),
            "{text}"
        );
        assert!(text.contains("could not start server"), "{text}");
        assert!(text.contains("/d/embedded-server.log"), "{text}");
        assert!(text.contains("lock file"), "{text}");
    }

    #[test]
    fn shell_quoting_for_display() {
        assert_eq!(shell_quote("/usr/bin/pg_ctl"), "/usr/bin/pg_ctl");
        assert_eq!(shell_quote("-c a='b c'"), r"'-c a='\''b c'\'''");
    }
}
