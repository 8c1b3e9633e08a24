//! Each database role of a deployment with the rights `perspective-worker grants` gives it, and
//! nothing more (issue 26, DESIGN §12.3): a producer appends, the engine runs, `status` reads,
//! each as its own role that owns nothing, and each is refused what is not its job.

mod common;

use std::process::Output;
use std::time::Duration;

use common::*;
use perspective_worker::engine::EngineOptions;
use sqlx::Connection;
use uuid::Uuid;

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producer_worker_and_reader_each_run_with_their_grants_alone() {
    let schema = unique_schema("roles");
    let yaml = recording_yaml(&schema, QUICK_OPTIONS);
    let config = parse_config(&yaml);
    migrate_config(&config).await;
    let file = std::env::temp_dir().join(format!("perspective-roles-{schema}.yaml"));
    std::fs::write(&file, &yaml).unwrap();
    let roles = ["producer", "worker", "reader"].map(|kind| (kind, format!("{schema}_{kind}")));
    for (kind, role) in &roles {
        let out = psql(&format!("CREATE ROLE {role} LOGIN"));
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let out = worker_bin()
            .arg("--config")
            .arg(&file)
            .args(["grants", kind, role])
            .output()
            .unwrap();
        assert!(out.status.success(), "grants {kind}: {}", text(&out));
        assert!(
            text(&out).contains(&format!("granted \"{role}\" the {kind} rights")),
            "{}",
            text(&out)
        );
    }
    let [(_, producer), (_, worker), (_, reader)] = &roles;

    // The producer appends both ways.
    let mut p = sqlx::PgConnection::connect(&url_as(producer))
        .await
        .unwrap();
    let (s1, s2) = (Uuid::now_v7(), Uuid::now_v7());
    sqlx::query(&format!(
        "INSERT INTO {schema}.wh_event_store (stream_id, event_type) VALUES ($1, 'A'), ($1, 'B')"
    ))
    .bind(s1)
    .execute(&mut p)
    .await
    .expect("a plain INSERT as the producer");
    sqlx::query(&format!(
        "SELECT * FROM {schema}.append_events($1, 0, '[{{\"event_type\": \"A\"}}]')"
    ))
    .bind(s2)
    .execute(&mut p)
    .await
    .expect("append_events as the producer");

    // The engine, as the worker role, applies them.
    let options = EngineOptions::new(config.clone(), url_as(worker));
    let engine = RunningEngine::start_with(options).await;
    wait_drained(&schema, Duration::from_secs(30)).await;
    engine.stop().await;
    assert_exactly_once(&schema, 2).await;

    // `status`, as the reader role.
    let out = worker_bin()
        .env("DATABASE_URL", url_as(reader))
        .arg("--config")
        .arg(&file)
        .args(["status", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "status as the reader: {}", text(&out));
    assert!(text(&out).contains("\"p1\""), "{}", text(&out));

    // Each is refused what is not its job.
    let mut w = connect_as(worker).await;
    for sql in [
        format!("UPDATE {schema}.wh_event_store SET event_type = 'B'"),
        format!("INSERT INTO {schema}.wh_event_store (stream_id, event_type) VALUES (gen_random_uuid(), 'A')"),
        format!("CREATE TABLE {schema}.intruder (a int)"),
    ] {
        assert_eq!(refused(&mut w, &sql).await, "42501", "worker: {sql}");
    }
    let mut r = connect_as(reader).await;
    for sql in [
        format!("SELECT * FROM {schema}.wh_event_store"),
        format!("SELECT * FROM {schema}.seen_p1"),
        format!("DELETE FROM {schema}.wh_dead_letters"),
        format!(
            "SELECT {schema}.append_events(gen_random_uuid(), 0, '[{{\"event_type\": \"A\"}}]')"
        ),
    ] {
        assert_eq!(refused(&mut r, &sql).await, "42501", "reader: {sql}");
    }
    drop((p, w, r));
    let names: Vec<&str> = roles.iter().map(|(_, r)| r.as_str()).collect();
    let out = psql(&format!(
        "DROP OWNED BY {0}; DROP ROLE {1}; DROP ROLE {2}; DROP ROLE {3};",
        names.join(", "),
        names[0],
        names[1],
        names[2]
    ));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_file(&file);
}
