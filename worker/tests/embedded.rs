//! The embedded PostgreSQL (used when DATABASE_URL is unset) against the machine's real server
//! binaries: data survives a restart, and a second start while a server runs reuses it. Needs
//! no TEST_DATABASE_URL.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::PathBuf;
use std::time::Duration;

use perspective_worker::db::embedded::EmbeddedPostgres;
use sqlx::{Connection, PgConnection};

/// A fresh directory under /tmp that the `postgres` user can traverse (the server runs as that
/// user when the tests run as root); removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(prefix: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        let dir = PathBuf::from(format!("/tmp/{prefix}-{}-{nanos}", std::process::id()));
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

async fn connect(pg: &EmbeddedPostgres) -> PgConnection {
    tokio::time::timeout(Duration::from_secs(10), PgConnection::connect(&pg.url()))
        .await
        .expect("connect timed out")
        .unwrap_or_else(|e| panic!("connect to {}: {e}", pg.url()))
}

fn init_logs() {
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter("perspective_worker=debug")
        .try_init();
}

#[tokio::test]
async fn data_survives_restart_and_running_server_is_reused() {
    init_logs();
    let tmp = TempDir::new("perspective-embedded");
    let data = tmp.0.join("data");

    // First start: initdb, then start.
    let pg = EmbeddedPostgres::start(&data).await.expect("first start");
    assert!(!pg.is_reused());
    assert!(pg.is_owner());
    assert!(data.join("PG_VERSION").exists());
    assert_eq!(
        pg.url(),
        format!("postgres://postgres@127.0.0.1:{}/postgres", pg.port())
    );
    let mut conn = connect(&pg).await;
    sqlx::query("CREATE TABLE kept (id int PRIMARY KEY, note text)")
        .execute(&mut conn)
        .await
        .unwrap();
    sqlx::query("INSERT INTO kept VALUES (1, 'survives restarts')")
        .execute(&mut conn)
        .await
        .unwrap();
    conn.close().await.unwrap();

    // A second start while the server runs reuses it instead of failing on the lock file.
    let again = EmbeddedPostgres::start(&data)
        .await
        .expect("start while running");
    assert!(again.is_reused());
    assert!(
        !again.is_owner(),
        "the starting process is alive and owns the server"
    );
    assert_eq!(again.port(), pg.port());
    let mut conn = connect(&again).await;
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM kept")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(n, 1);
    conn.close().await.unwrap();
    // Stopping (or dropping) the reusing handle leaves the server to its owner.
    again.stop().await.expect("stop of a reused handle");
    let conn = connect(&pg).await;
    conn.close().await.unwrap();

    let first_port = pg.port();
    pg.stop().await.expect("stop");
    assert!(
        !data.join("postmaster.pid").exists(),
        "the server is down after stop"
    );
    assert!(
        tokio::net::TcpStream::connect(("127.0.0.1", first_port))
            .await
            .is_err(),
        "nothing listens on the old port"
    );

    // Restart on the same directory: no initdb, same data.
    let pg = EmbeddedPostgres::start(&data).await.expect("restart");
    assert!(!pg.is_reused());
    let mut conn = connect(&pg).await;
    let note: String = sqlx::query_scalar("SELECT note FROM kept WHERE id = 1")
        .fetch_one(&mut conn)
        .await
        .expect("the table survived the restart");
    assert_eq!(note, "survives restarts");
    conn.close().await.unwrap();

    // The owner vanishes without stopping the server (as after SIGKILL): the next start adopts
    // the orphan and stops it when done.
    let orphan_port = pg.port();
    std::mem::forget(pg);
    let mut exited = std::process::Command::new("true").spawn().unwrap();
    exited.wait().unwrap();
    std::fs::write(data.join("embedded-owner.pid"), exited.id().to_string()).unwrap();
    let adopted = EmbeddedPostgres::start(&data)
        .await
        .expect("adopting start");
    assert!(adopted.is_reused());
    assert!(adopted.is_owner(), "an orphaned server is adopted");
    assert_eq!(adopted.port(), orphan_port);

    // Dropping the owning handle stops the server too.
    drop(adopted);
    assert!(
        !data.join("postmaster.pid").exists(),
        "drop stops the server it owns"
    );
}

#[tokio::test]
async fn initdb_failure_carries_command_and_output() {
    init_logs();
    let tmp = TempDir::new("perspective-embedded-bad");
    let data = tmp.0.join("data");
    std::fs::create_dir(&data).unwrap();
    std::fs::write(data.join("stray.txt"), "not a data directory").unwrap();
    let err = EmbeddedPostgres::start(&data)
        .await
        .expect_err("initdb refuses a non-empty directory");
    let text = err.to_string();
    assert!(text.contains("initdb"), "{text}");
    assert!(text.contains("exit status"), "{text}");
    assert!(text.contains("not empty"), "{text}");
}

/// As root the server runs as `postgres`, which must be able to reach the data directory.
#[tokio::test]
async fn unreachable_data_dir_is_explained_when_root() {
    let tmp = TempDir::new("perspective-embedded-private");
    std::fs::set_permissions(&tmp.0, std::fs::Permissions::from_mode(0o700)).unwrap();
    let data = tmp.0.join("data");
    let result = EmbeddedPostgres::start(&data).await;
    let euid = std::fs::metadata("/proc/self").map(|m| m.uid()).ok();
    if euid != Some(0) {
        // Not root: the server runs as us and the private parent is no obstacle.
        result
            .expect("start as the directory owner")
            .stop()
            .await
            .unwrap();
        return;
    }
    let text = result
        .expect_err("postgres cannot traverse a 0700 root-owned directory")
        .to_string();
    assert!(text.contains("`postgres` user"), "{text}");
    assert!(text.contains(&tmp.0.display().to_string()), "{text}");
}

#[tokio::test]
async fn start_failure_carries_server_log_tail() {
    init_logs();
    let tmp = TempDir::new("perspective-embedded-conf");
    let data = tmp.0.join("data");
    EmbeddedPostgres::start(&data)
        .await
        .expect("first start")
        .stop()
        .await
        .expect("stop");
    let conf = data.join("postgresql.conf");
    let mut text = std::fs::read_to_string(&conf).unwrap();
    text.push_str("\nno_such_setting_for_the_test = on\n");
    std::fs::write(&conf, text).unwrap();

    let err = EmbeddedPostgres::start(&data)
        .await
        .expect_err("the server refuses a broken config");
    let text = err.to_string();
    assert!(text.contains("pg_ctl"), "{text}");
    assert!(text.contains("exit status"), "{text}");
    assert!(text.contains("embedded-server.log"), "{text}");
    assert!(text.contains("no_such_setting_for_the_test"), "{text}");
}
