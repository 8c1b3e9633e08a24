//! The chart's observability pack (PrometheusRule and Grafana dashboard), checked with the real
//! promtool and helm (both built by `tests/e2e/build-bins.sh`; `with-control-plane.sh` puts
//! them first on PATH):
//!
//! - `promtool test rules` runs `tests/monitoring/alerts.test.yaml` (synthetic series, one case
//!   that fires and one that must not per alert) against the rules as the chart renders them;
//! - every PromQL expression of the rules and the dashboard parses (`promtool check rules`) and
//!   names only metrics a real worker serves on `/metrics` (a worker process against the test
//!   PostgreSQL, `TEST_DATABASE_URL` from `tests/pg/pg.sh`) or the operator's exporter renders.

mod support;

use std::collections::BTreeSet;
use std::env;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::runtime::{reflector, watcher};
use perspective_operator::crd::{PerspectiveDeployment, PerspectiveDeploymentStatus};
use perspective_operator::metrics::OperatorMetrics;
use perspective_operator::status::condition as conditions;
use serde::Deserialize;
use serde_json::Value as Json;
use serde_yaml::Value;
use support::{repo_root, tool, worker_binary};

/// A fresh directory for one test's files.
fn work_dir(tag: &str) -> PathBuf {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("monitoring")
        .join(format!("{tag}-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn run(cmd: &mut Command) -> Output {
    cmd.output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

fn run_ok(cmd: &mut Command) -> String {
    let out = run(cmd);
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The chart rendered with the rules and the dashboard enabled (default thresholds, which the
/// promtool cases are written for).
fn rendered_pack() -> (Value, Json) {
    let state = work_dir("helm");
    let yaml = run_ok(
        Command::new(tool("helm"))
            .env("HELM_CACHE_HOME", state.join("cache"))
            .env("HELM_CONFIG_HOME", state.join("config"))
            .env("HELM_DATA_HOME", state.join("data"))
            .args(["template", "pack"])
            .arg(repo_root().join("charts/perspective-operator"))
            .args([
                "--api-versions",
                "monitoring.coreos.com/v1/PrometheusRule",
                "--set",
                "metrics.prometheusRule.enabled=true",
                "--set",
                "metrics.grafanaDashboard.enabled=true",
            ]),
    );
    let docs: Vec<Value> = serde_yaml::Deserializer::from_str(&yaml)
        .map(|d| Value::deserialize(d).unwrap())
        .filter(|d| !d.is_null())
        .collect();
    let kind = |k: &str| {
        docs.iter()
            .find(|d| d["kind"].as_str() == Some(k))
            .unwrap_or_else(|| panic!("no {k} rendered"))
    };
    let rules = kind("PrometheusRule")["spec"].clone();
    let dashboard = kind("ConfigMap")["data"]["perspective-operator.json"]
        .as_str()
        .expect("dashboard JSON in the ConfigMap");
    (
        rules,
        serde_json::from_str(dashboard).expect("dashboard is JSON"),
    )
}

fn alert_exprs(rules: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for group in rules["groups"].as_sequence().unwrap() {
        for rule in group["rules"].as_sequence().unwrap() {
            out.push((
                rule["alert"].as_str().unwrap().to_owned(),
                rule["expr"].as_str().unwrap().to_owned(),
            ));
        }
    }
    out
}

/// Every query of the dashboard: panel targets, and the metric selector of each template
/// variable's `label_values(selector, label)`.
fn dashboard_exprs(dashboard: &Json) -> Vec<String> {
    let mut out = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            out.push(target["expr"].as_str().unwrap().to_owned());
        }
    }
    for var in dashboard["templating"]["list"].as_array().unwrap() {
        if var["type"] == "query" {
            let q = var["query"]["query"].as_str().unwrap();
            let inner = q
                .strip_prefix("label_values(")
                .and_then(|r| r.rsplit_once(','))
                .map(|(selector, _label)| selector.to_owned())
                .unwrap_or_else(|| {
                    panic!("variable query {q:?} is not label_values(selector, label)")
                });
            out.push(inner);
        }
    }
    assert!(out.len() > 10, "dashboard has too few queries: {out:?}");
    out
}

/// A dashboard query as Prometheus sees it once Grafana substituted its variables.
fn substitute_variables(expr: &str, dashboard: &Json) -> String {
    let mut e = expr.replace("$__rate_interval", "5m");
    for var in dashboard["templating"]["list"].as_array().unwrap() {
        let name = var["name"].as_str().unwrap();
        e = e.replace(&format!("${{{name}}}"), ".*");
        e = e.replace(&format!("${name}"), ".*");
    }
    assert!(!e.contains('$'), "unknown variable left in {e}");
    e
}

const AGGREGATIONS: &[&str] = &[
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
];
/// Keywords followed by a parenthesised list of label names.
const LABEL_LISTS: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];
const KEYWORDS: &[&str] = &[
    "and", "or", "unless", "bool", "offset", "atan2", "inf", "nan",
];

/// The metric names a PromQL expression selects. A lexical scan, enough for the chart's own
/// queries (which `promtool` parses separately): string literals, label matchers `{…}` and
/// ranges `[…]` are dropped, then an identifier is a metric unless it is a function (followed by
/// `(`), an aggregation, a keyword, or a label in `by (…)`-style lists.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut cleaned = String::new();
    let (mut quote, mut braces, mut brackets) = (None, 0, 0);
    for c in expr.chars() {
        if let Some(q) = quote {
            if c == q {
                quote = None;
            }
            continue;
        }
        match c {
            '"' | '\'' | '`' => quote = Some(c),
            '{' => braces += 1,
            '}' => braces -= 1,
            '[' => brackets += 1,
            ']' => brackets -= 1,
            _ if braces == 0 && brackets == 0 => cleaned.push(c),
            _ => {}
        }
        if !matches!(c, '(' | ')') && (braces > 0 || brackets > 0 || quote.is_some()) {
            cleaned.push(' ');
        }
    }
    let chars: Vec<char> = cleaned.chars().collect();
    let mut names = BTreeSet::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_ascii_digit() || c == '.' {
            // A number or a duration, with any unit letters.
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                i += 1;
            }
            continue;
        }
        if !(c.is_ascii_alphabetic() || c == '_' || c == ':') {
            i += 1;
            continue;
        }
        let start = i;
        while i < chars.len() && (chars[i].is_ascii_alphanumeric() || matches!(chars[i], '_' | ':'))
        {
            i += 1;
        }
        let ident: String = chars[start..i].iter().collect();
        let mut next = i;
        while next < chars.len() && chars[next].is_whitespace() {
            next += 1;
        }
        let followed_by_paren = chars.get(next) == Some(&'(');
        if LABEL_LISTS.contains(&ident.as_str()) {
            if followed_by_paren {
                i = next + chars[next..].iter().position(|&c| c == ')').unwrap() + 1;
            }
        } else if !(followed_by_paren
            || AGGREGATIONS.contains(&ident.as_str())
            || KEYWORDS.contains(&ident.as_str()))
        {
            names.insert(ident);
        }
    }
    names
}

#[test]
fn metric_names_finds_selectors_and_nothing_else() {
    let expr = r#"histogram_quantile(0.99, sum by (pod, le) (rate(a_seconds_bucket{pod=~"$pod", x="y{z}"}[5m])))
        > 0.5 and on (namespace) max without (le) (b_total offset 5m) == bool 1 unless c:recorded"#;
    assert_eq!(
        metric_names(expr),
        BTreeSet::from(["a_seconds_bucket", "b_total", "c:recorded"].map(String::from))
    );
}

/// Metric names in a Prometheus text exposition.
fn exposed_names(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| l.split(['{', ' ']).next().unwrap().to_owned())
        .collect()
}

/// A worker process serving HTTP, killed on drop.
struct Worker(Child);

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn http_get(addr: &str, path: &str) -> std::io::Result<String> {
    let mut stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    Ok(response)
}

/// `/metrics` of a real worker: `migrate`, then `run` against the test PostgreSQL, scraped once
/// it reports its perspectives and its LISTEN connection.
fn scrape_worker() -> String {
    let url = env::var("TEST_DATABASE_URL").expect(
        "TEST_DATABASE_URL is not set: run through `tests/pg/pg.sh with tests/e2e/with-control-plane.sh cargo test ...`",
    );
    let dir = work_dir("worker");
    let schema = format!(
        "mon_{}",
        dir.file_name().unwrap().to_str().unwrap().replace('-', "_")
    );
    let schema = &schema[..schema.len().min(40)];
    let config = dir.join("worker.yaml");
    std::fs::write(
        &config,
        format!(
            "schema: {schema}
perspectives:
  - name: totals
    setup: CREATE TABLE IF NOT EXISTS totals (stream_id uuid PRIMARY KEY)
    handlers:
      A: INSERT INTO totals VALUES (:stream_id) ON CONFLICT DO NOTHING
"
        ),
    )
    .unwrap();
    let worker = || {
        let mut cmd = Command::new(worker_binary());
        cmd.arg("--config")
            .arg(&config)
            .env("DATABASE_URL", &url)
            .env("RUST_LOG", "warn");
        cmd
    };
    run_ok(worker().arg("migrate"));
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let _worker = Worker(
        worker()
            .args(["run", "--http-addr", &addr])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the worker"),
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(response) = http_get(&addr, "/metrics") {
            if response.contains(r#"perspective_lag_seconds{perspective="totals"}"#)
                && response.contains("perspective_listener_connected 1")
            {
                return response;
            }
        }
        assert!(
            Instant::now() < deadline,
            "the worker on {addr} never served its perspective's metrics"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// What the operator's exporter renders once its controller caches a deployment whose status
/// knows everything (database read, every condition set) and it has seen a failed reconcile.
fn operator_exposition() -> String {
    let m = OperatorMetrics::new();
    m.observe_reconcile(Duration::from_millis(3), Some("Kube"));
    m.leader.set(1);
    let mut pd: PerspectiveDeployment = serde_json::from_value(serde_json::json!({
        "apiVersion": "perspectives.dev/v1alpha1",
        "kind": "PerspectiveDeployment",
        "metadata": { "name": "pd", "namespace": "ns" },
        "spec": {
            "database": { "secretRef": { "name": "db" } },
            "schema": "s",
            "perspectives": [{ "name": "p", "handlers": { "A": "SELECT 1" } }]
        }
    }))
    .unwrap();
    pd.status = Some(PerspectiveDeploymentStatus {
        conditions: conditions::TYPES
            .iter()
            .map(|t| Condition {
                type_: (*t).to_owned(),
                status: "True".to_owned(),
                reason: "Test".to_owned(),
                message: String::new(),
                observed_generation: None,
                last_transition_time: Time(Timestamp::UNIX_EPOCH),
            })
            .collect(),
        live_instances: Some(1),
        dead_letters: Some(0),
        ..Default::default()
    });
    let (store, mut writer) = reflector::store();
    writer.apply_watcher_event(&watcher::Event::Apply(pd));
    m.export_deployments(store);
    m.render()
}

#[test]
fn alerts_fire_on_synthetic_series_as_promtool_cases_expect() {
    let (rules, _) = rendered_pack();
    let dir = work_dir("rules");
    std::fs::write(
        dir.join("rules.yaml"),
        serde_yaml::to_string(&rules).unwrap(),
    )
    .unwrap();
    let cases = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/monitoring/alerts.test.yaml"),
    )
    .unwrap();
    std::fs::write(dir.join("alerts.test.yaml"), &cases).unwrap();
    // Every alert has cases.
    for (alert, _) in alert_exprs(&rules) {
        assert!(
            cases.contains(&format!("alertname: {alert}\n")),
            "alerts.test.yaml has no case for {alert}"
        );
    }
    let promtool = tool("promtool");
    run_ok(
        Command::new(&promtool)
            .current_dir(&dir)
            .args(["check", "rules", "rules.yaml"]),
    );
    run_ok(
        Command::new(&promtool)
            .current_dir(&dir)
            .args(["test", "rules", "alerts.test.yaml"]),
    );
}

#[test]
fn every_query_parses_and_names_only_exported_metrics() {
    let (rules, dashboard) = rendered_pack();
    let mut queries: Vec<(String, String)> = alert_exprs(&rules);
    for (i, expr) in dashboard_exprs(&dashboard).iter().enumerate() {
        queries.push((
            format!("dashboard_query_{i}"),
            substitute_variables(expr, &dashboard),
        ));
    }

    // Parse: every query as a recording rule, checked by promtool; a broken one must fail.
    let dir = work_dir("queries");
    let as_rules = |qs: &[(String, String)]| {
        let rules: Vec<Value> = qs
            .iter()
            .enumerate()
            .map(|(i, (_, expr))| {
                serde_yaml::to_value(
                    serde_json::json!({ "record": format!("check_{i}"), "expr": expr }),
                )
                .unwrap()
            })
            .collect();
        serde_yaml::to_string(
            &serde_json::json!({ "groups": [{ "name": "queries", "rules": rules }] }),
        )
        .unwrap()
    };
    std::fs::write(dir.join("queries.yaml"), as_rules(&queries)).unwrap();
    std::fs::write(
        dir.join("broken.yaml"),
        as_rules(&[("broken".into(), "sum(rate(x[5m])".into())]),
    )
    .unwrap();
    let promtool = tool("promtool");
    run_ok(
        Command::new(&promtool)
            .current_dir(&dir)
            .args(["check", "rules", "queries.yaml"]),
    );
    assert!(
        !run(Command::new(&promtool)
            .current_dir(&dir)
            .args(["check", "rules", "broken.yaml"]))
        .status
        .success(),
        "promtool accepted a query that does not parse"
    );

    // Names: only what a real worker serves or the operator's exporter renders.
    let worker = exposed_names(&scrape_worker());
    let operator = exposed_names(&operator_exposition());
    assert!(worker.contains("perspective_lag_seconds"), "{worker:?}");
    assert!(
        operator.contains("perspective_operator_dead_letters"),
        "{operator:?}"
    );
    let mut unknown = Vec::new();
    let mut used = BTreeSet::new();
    for (what, expr) in &queries {
        for name in metric_names(expr) {
            if !worker.contains(&name) && !operator.contains(&name) {
                unknown.push(format!("{what}: {name} in {expr}"));
            }
            used.insert(name);
        }
    }
    assert!(
        unknown.is_empty(),
        "metrics nobody exports:\n{}",
        unknown.join("\n")
    );
    assert!(used.len() >= 15, "suspiciously few metrics used: {used:?}");
}
