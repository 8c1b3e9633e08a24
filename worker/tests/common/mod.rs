//! Shared helpers for the integration tests. They need a real PostgreSQL: `make test` starts a
//! throwaway cluster and sets TEST_DATABASE_URL. Every test works in its own schema, so tests
//! run in parallel against one cluster.
#![allow(dead_code)]

use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use perspective_worker::config::Config;
use perspective_worker::migrate::{migrate, MigrateOptions};
use sqlx::postgres::{PgConnection, PgPool, PgPoolOptions};
use sqlx::Connection;

pub fn database_url() -> String {
    std::env::var("TEST_DATABASE_URL").unwrap_or_else(|_| {
        panic!(
            "TEST_DATABASE_URL is not set: these tests need a real PostgreSQL. Run `make test`, \
             or `tests/pg/pg.sh with cargo test` to start a throwaway cluster"
        )
    })
}

/// A schema name no other test (or test process) uses.
pub fn unique_schema(prefix: &str) -> String {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let name = format!("t_{prefix}_{}_{n}", std::process::id());
    assert!(
        name.len() <= 40,
        "schema name {name} too long; shorten the prefix"
    );
    name
}

/// Two perspectives: `alpha` handles A and B, `beta` handles B and C. Event type D has no
/// subscriber. Each handler records the event it saw.
pub fn two_perspective_yaml(schema: &str) -> String {
    format!(
        r#"
schema: {schema}
perspectives:
  - name: alpha
    setup: |
      CREATE TABLE IF NOT EXISTS alpha_seen (stream_id uuid, stream_version bigint, event_type text);
    handlers:
      A: INSERT INTO alpha_seen VALUES (:stream_id, :stream_version, :event_type)
      B: INSERT INTO alpha_seen VALUES (:stream_id, :stream_version, :event_type)
  - name: beta
    setup: |
      CREATE TABLE IF NOT EXISTS beta_seen (stream_id uuid, stream_version bigint, total numeric);
    handlers:
      B: INSERT INTO beta_seen VALUES (:stream_id, :stream_version, (:data->>'total')::numeric)
      C: INSERT INTO beta_seen VALUES (:stream_id, :stream_version, NULL)
"#
    )
}

pub fn parse_config(yaml: &str) -> Config {
    Config::from_yaml_str(yaml, "test.yaml").unwrap_or_else(|e| panic!("test config invalid: {e}"))
}

pub async fn connect() -> PgConnection {
    PgConnection::connect(&database_url())
        .await
        .expect("connect to the test database")
}

pub async fn pool(max: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(max)
        .connect(&database_url())
        .await
        .expect("test pool")
}

/// A fresh schema with the two-perspective config migrated into it.
pub async fn migrated_schema(prefix: &str) -> (String, Config) {
    let schema = unique_schema(prefix);
    let config = parse_config(&two_perspective_yaml(&schema));
    let mut conn = connect().await;
    migrate(&mut conn, &config, "test.yaml", MigrateOptions::default())
        .await
        .expect("migrate");
    (schema, config)
}

/// Run SQL through the real `psql` client (not through Rust), stopping at the first error.
pub fn psql(sql: &str) -> Output {
    Command::new("psql")
        .arg(database_url())
        .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "-At", "-c", sql])
        .output()
        .expect("run psql")
}

/// The worker binary built for this test run.
pub fn worker_bin() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_perspective-worker"));
    cmd.env("DATABASE_URL", database_url())
        .env("RUST_LOG", "warn");
    cmd
}

/// Poll `check` until it returns true or `timeout` passes.
pub async fn wait_until<F, Fut>(what: &str, timeout: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if check().await {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
