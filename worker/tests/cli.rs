//! The `append` and `status` commands, run as the real binary against a real PostgreSQL.

mod common;

use std::io::Write;
use std::process::{Output, Stdio};

use common::*;
use uuid::Uuid;

fn run_with_stdin(args: &[&str], config: &std::path::Path, stdin: &str) -> Output {
    let mut child = worker_bin()
        .arg("--config")
        .arg(config)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

async fn count(schema: &str, table: &str) -> i64 {
    let mut conn = connect().await;
    sqlx::query_scalar(&format!("SELECT count(*) FROM {schema}.{table}"))
        .fetch_one(&mut conn)
        .await
        .unwrap()
}

fn config_file(schema: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("perspective-cli-{schema}.yaml"));
    std::fs::write(&path, two_perspective_yaml(schema)).unwrap();
    path
}

#[tokio::test]
async fn append_writes_lines_in_order_through_the_producer_path() {
    let (schema, _) = migrated_schema("cliappend").await;
    let config = config_file(&schema);
    let (s1, s2) = (Uuid::now_v7(), Uuid::now_v7());
    let fixed = Uuid::now_v7();
    let input = format!(
        "# orders\n\
         {{\"stream_id\":\"{s1}\",\"event_type\":\"A\",\"event_data\":{{\"n\":1}},\"metadata\":{{\"user_id\":\"u-1\"}}}}\n\
         {{\"stream_id\":\"{s2}\",\"event_type\":\"C\"}}\n\
         \n\
         {{\"stream_id\":\"{s1}\",\"event_type\":\"B\",\"event_data\":{{\"total\":3}},\"event_id\":\"{fixed}\",\"stream_version\":2}}\n\
         {{\"stream_id\":\"{s1}\",\"event_type\":\"D\",\"scope\":{{\"tenant_id\":\"t-9\"}}}}\n"
    );
    let out = run_with_stdin(&["append"], &config, &input);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("appended 4 event(s) to 2 stream(s)"),
        "{}",
        text(&out)
    );

    let mut conn = connect().await;
    let rows: Vec<(Uuid, i64, String, serde_json::Value, serde_json::Value)> =
        sqlx::query_as(&format!(
        "SELECT event_id, stream_version, event_type, metadata, scope FROM {schema}.wh_event_store
         WHERE stream_id = $1 ORDER BY stream_version"
    ))
        .bind(s1)
        .fetch_all(&mut conn)
        .await
        .unwrap();
    let types: Vec<&str> = rows.iter().map(|r| r.2.as_str()).collect();
    assert_eq!(types, vec!["A", "B", "D"], "input order is stream order");
    assert_eq!(rows[1].0, fixed, "a given event_id is kept");
    assert_eq!(rows[0].3, serde_json::json!({"user_id": "u-1"}));
    assert_eq!(rows[2].4, serde_json::json!({"tenant_id": "t-9"}));
    // A→alpha, C→beta, B→alpha+beta, D→nothing
    assert_eq!(count(&schema, "wh_perspective_events").await, 4);
}

#[tokio::test]
async fn append_with_a_malformed_line_reports_it_and_writes_nothing() {
    let (schema, _) = migrated_schema("clibad").await;
    let config = config_file(&schema);
    let s = Uuid::now_v7();
    let input = format!(
        "{{\"stream_id\":\"{s}\",\"event_type\":\"A\"}}\n\
         {{\"stream_id\":\"{s}\",\"event_type\":\"A\",}}\n\
         {{\"stream_id\":\"{s}\",\"event_type\":\"A\"}}\n\
         {{\"stream_id\":\"{s}\"}}\n"
    );
    let out = run_with_stdin(&["append"], &config, &input);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let msg = text(&out);
    assert!(
        msg.contains("stdin: 2 malformed line(s), nothing appended"),
        "{msg}"
    );
    assert!(msg.contains("line 2:"), "{msg}");
    assert!(msg.contains("line 4: missing field `event_type`"), "{msg}");
    assert_eq!(count(&schema, "wh_event_store").await, 0);

    // An escaped NUL, valid JSON that PostgreSQL cannot store, is input error too (issue 26,
    // finding 7: it used to fail the whole append at the server, exit 1, naming no line).
    let input = format!(
        "{{\"stream_id\":\"{s}\",\"event_type\":\"A\"}}\n\
         {{\"stream_id\":\"{s}\",\"event_type\":\"A\",\"event_data\":{{\"n\":\"a\\u0000\"}}}}\n"
    );
    let out = run_with_stdin(&["append"], &config, &input);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("line 2: event_data contains a NUL character"),
        "{}",
        text(&out)
    );
    assert_eq!(count(&schema, "wh_event_store").await, 0);

    // A failure inside the database (a stale stream_version on the third line) also leaves
    // nothing: the whole input is one transaction.
    let input = format!(
        "{{\"stream_id\":\"{s}\",\"event_type\":\"A\"}}\n\
         {{\"stream_id\":\"{s}\",\"event_type\":\"B\"}}\n\
         {{\"stream_id\":\"{s}\",\"event_type\":\"A\",\"stream_version\":7}}\n"
    );
    let out = run_with_stdin(&["append"], &config, &input);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("expected version 6 but the stream is at version 2"),
        "{}",
        text(&out)
    );
    assert_eq!(count(&schema, "wh_event_store").await, 0);
    assert_eq!(count(&schema, "wh_perspective_events").await, 0);
}

#[tokio::test]
async fn status_reports_pending_work_per_perspective() {
    let (schema, _) = migrated_schema("clistatus").await;
    let config = config_file(&schema);
    let s = Uuid::now_v7();
    let input: String = ["A", "B", "B", "C", "D"]
        .iter()
        .map(|t| format!("{{\"stream_id\":\"{s}\",\"event_type\":\"{t}\"}}\n"))
        .collect();
    assert!(run_with_stdin(&["append"], &config, &input)
        .status
        .success());

    let out = run_with_stdin(&["status", "--json"], &config, "");
    assert!(out.status.success(), "{}", text(&out));
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let pending: Vec<(String, i64, bool)> = status["perspectives"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["name"].as_str().unwrap().to_string(),
                p["pendingEvents"].as_i64().unwrap(),
                p["configured"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        pending,
        vec![
            ("alpha".to_string(), 3, true),
            ("beta".to_string(), 3, true)
        ]
    );
    assert_eq!(status["activeStreams"], 1);
    assert_eq!(
        status["schemaVersion"],
        perspective_worker::store::migrations::latest_version()
    );
    assert!(
        status["perspectives"][0]["oldestPendingSeconds"]
            .as_f64()
            .unwrap()
            >= 0.0
    );

    let table = run_with_stdin(&["status"], &config, "");
    let table = text(&table);
    assert!(
        table.contains("PERSPECTIVE") && table.contains("alpha") && table.contains("beta"),
        "{table}"
    );
}

#[test]
fn help_explains_the_commands_and_environment() {
    let out = worker_bin().arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "migrate",
        "append",
        "status",
        "DATABASE_URL",
        "PERSPECTIVE_CONFIG",
    ] {
        assert!(help.contains(needle), "--help lacks {needle}:\n{help}");
    }
    let out = worker_bin().args(["append", "--help"]).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("JSON lines"));
}

#[test]
fn missing_config_or_database_is_invalid_input() {
    let out = worker_bin()
        .env_remove("PERSPECTIVE_CONFIG")
        .arg("status")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out).contains("no config"), "{}", text(&out));
    let path = config_file("t_nodb");
    let out = worker_bin()
        .env_remove("DATABASE_URL")
        .arg("--config")
        .arg(&path)
        .arg("status")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out).contains("no database"), "{}", text(&out));
}

/// Issue 12: a reader that closes the pipe (`status --json | head -0`) ends the command
/// quietly, not with a panic.
#[tokio::test]
async fn a_closed_stdout_is_not_a_panic() {
    let (schema, _) = migrated_schema("clipipe").await;
    let config = config_file(&schema);
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = worker_bin()
        .arg("--config")
        .arg(&config)
        .args(["status", "--json"])
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(out.status.code(), Some(0), "{stderr}");
}

/// Issue 12: a URL that is not a PostgreSQL URL is refused as invalid input, without echoing it
/// (it may hold a password).
#[test]
fn a_database_url_that_is_not_postgres_is_refused() {
    let path = config_file("t_badurl");
    for (url, says) in [
        (
            "mysql://app:s3cret@db/shop",
            "is a mysql:// URL; it must be a PostgreSQL URL",
        ),
        (
            "host=db password=s3cret",
            "is not a URL; it must be a PostgreSQL URL",
        ),
    ] {
        let out = worker_bin()
            .env("DATABASE_URL", url)
            .arg("--config")
            .arg(&path)
            .arg("status")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{}", text(&out));
        assert!(text(&out).contains(says), "{}", text(&out));
        assert!(!text(&out).contains("s3cret"), "{}", text(&out));
    }
}

/// Issue 12: an error names its cause once ("X: X" was sqlx's I/O error printed by itself and
/// again as its source).
#[test]
fn an_error_names_its_cause_once() {
    // Port 1 on loopback: nothing listens, the connection is refused.
    let path = config_file("t_refused");
    let out = worker_bin()
        .env("DATABASE_URL", "postgres://app@127.0.0.1:1/shop")
        .arg("--config")
        .arg(&path)
        .arg("status")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let line = stderr.lines().find(|l| l.starts_with("error: ")).unwrap();
    assert!(line.contains("Connection refused"), "{line}");
    assert_eq!(line.matches("Connection refused").count(), 1, "{line}");
}

/// Issue 12: `append` refuses an event type no handler could subscribe to (longer than the
/// config allows), writing nothing.
#[test]
fn append_refuses_event_types_longer_than_the_config_allows() {
    let path = config_file("t_longtype");
    let long = "E".repeat(perspective_worker::config::MAX_EVENT_TYPE_LEN + 1);
    let line = format!(
        "{{\"stream_id\":\"0190f5c2-0000-7000-8000-000000000001\",\"event_type\":\"{long}\"}}\n"
    );
    let out = run_with_stdin(&["append"], &path, &line);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("line 1: event_type is 201 characters long; at most 200 are allowed"),
        "{}",
        text(&out)
    );
}

#[test]
fn max_connections_is_bounded_and_overrides_the_config() {
    let out = worker_bin().args(["run", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(
        help.contains("overrides the config") && help.contains("worker.database.maxConnections"),
        "{help}"
    );
    for bad in ["1", "1001"] {
        let out = worker_bin()
            .arg("--config")
            .arg(config_file("t_maxconn"))
            .args(["run", "--max-connections", bad])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{}", text(&out));
        assert!(
            text(&out).contains("--max-connections") && text(&out).contains("2..=1000"),
            "{}",
            text(&out)
        );
    }
}
