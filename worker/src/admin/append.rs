//! `perspective-worker append`: JSON lines in, events out.
//!
//! Every line is parsed before anything is written; a malformed line is reported with its
//! line number and nothing is appended. The events then go in through the producer contract
//! (plain INSERTs into `wh_event_store`, in input order) inside one transaction, so a failure
//! half-way (say a stale `stream_version`) leaves nothing behind either.

use std::collections::HashSet;
use std::io::BufRead;

use sqlx::postgres::PgConnection;
use sqlx::Connection;
use uuid::Uuid;

use crate::config::MAX_EVENT_TYPE_LEN;

/// Rows per INSERT statement.
const CHUNK: usize = 1000;

pub use crate::contract::NewEvent;

/// Lines that could not be read as events.
#[derive(Debug, thiserror::Error)]
#[error("{source_name}: {} malformed line(s), nothing appended:\n{}", problems.len(), render(problems))]
pub struct InputError {
    pub source_name: String,
    /// (1-based line number, what is wrong)
    pub problems: Vec<(usize, String)>,
}

fn render(problems: &[(usize, String)]) -> String {
    const SHOWN: usize = 20;
    let mut out: Vec<String> = problems
        .iter()
        .take(SHOWN)
        .map(|(l, m)| format!("  line {l}: {m}"))
        .collect();
    if problems.len() > SHOWN {
        out.push(format!("  … and {} more", problems.len() - SHOWN));
    }
    out.join("\n")
}

/// Parse JSON lines. Blank lines and lines starting with `#` are skipped.
pub fn parse_lines(reader: impl BufRead, source_name: &str) -> Result<Vec<NewEvent>, InputError> {
    let mut events = Vec::new();
    let mut problems = Vec::new();
    for (index, line) in reader.lines().enumerate() {
        let number = index + 1;
        let line = match line {
            Ok(l) => l,
            Err(e) => {
                problems.push((number, format!("cannot read: {e}")));
                break;
            }
        };
        let trimmed = line.trim();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        match serde_json::from_str::<NewEvent>(trimmed) {
            Ok(ev) => match check(&ev) {
                Ok(()) => events.push(ev),
                Err(m) => problems.push((number, m)),
            },
            Err(e) => problems.push((number, e.to_string())),
        }
    }
    if problems.is_empty() {
        Ok(events)
    } else {
        Err(InputError {
            source_name: source_name.to_string(),
            problems,
        })
    }
}

fn check(ev: &NewEvent) -> Result<(), String> {
    if ev.event_type.trim().is_empty() {
        return Err("event_type must not be empty".into());
    }
    // No handler can be declared for a longer type (config), so such an event would never
    // reach any perspective.
    let len = ev.event_type.chars().count();
    if len > MAX_EVENT_TYPE_LEN {
        return Err(format!(
            "event_type is {len} characters long; at most {MAX_EVENT_TYPE_LEN} are allowed"
        ));
    }
    if ev.event_data.is_null() {
        return Err("event_data must not be null (omit it for {})".into());
    }
    for (field, v) in [("metadata", &ev.metadata), ("scope", &ev.scope)] {
        if !v.is_object() {
            return Err(format!("{field} must be a JSON object"));
        }
    }
    if matches!(ev.stream_version, Some(v) if v < 1) {
        return Err("stream_version must be 1 or more".into());
    }
    if ev.event_type.contains('\0') {
        return Err(NUL_REFUSED.replace("{field}", "event_type"));
    }
    for (field, v) in [
        ("event_data", &ev.event_data),
        ("metadata", &ev.metadata),
        ("scope", &ev.scope),
    ] {
        if holds_nul(v) {
            return Err(NUL_REFUSED.replace("{field}", field));
        }
    }
    Ok(())
}

/// Valid JSON may escape a NUL (`\u0000`), but PostgreSQL's text and jsonb cannot hold one: the
/// whole append would fail at the server, naming no line.
const NUL_REFUSED: &str =
    "{field} contains a NUL character (\\u0000), which PostgreSQL cannot store in text or jsonb";

/// Whether any string of `value` (key or value, at any depth) contains a NUL.
fn holds_nul(value: &serde_json::Value) -> bool {
    match value {
        serde_json::Value::String(s) => s.contains('\0'),
        serde_json::Value::Array(items) => items.iter().any(holds_nul),
        serde_json::Value::Object(map) => map.iter().any(|(k, v)| k.contains('\0') || holds_nul(v)),
        _ => false,
    }
}

/// What was appended.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct AppendReport {
    pub events: usize,
    pub streams: usize,
    /// (event_id, stream_id, stream_version) of every event, in input order.
    #[serde(skip)]
    pub appended: Vec<(Uuid, Uuid, i64)>,
}

/// Append `events` to `schema` in one transaction. `progress` is called after each chunk with
/// the number of events written so far.
pub async fn append(
    conn: &mut PgConnection,
    schema: &str,
    events: &[NewEvent],
    mut progress: impl FnMut(usize),
) -> Result<AppendReport, sqlx::Error> {
    let mut report = AppendReport::default();
    let mut tx = conn.begin().await?;
    for chunk in events.chunks(CHUNK) {
        let rows = crate::store::append::insert_events(&mut tx, schema, chunk).await?;
        report.appended.extend(rows);
        progress(report.appended.len());
    }
    tx.commit().await?;
    report.events = report.appended.len();
    report.streams = report
        .appended
        .iter()
        .map(|(_, s, _)| *s)
        .collect::<HashSet<_>>()
        .len();
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_lines_and_defaults() {
        let input = r#"
# a comment
{"stream_id":"0190f5c2-0000-7000-8000-000000000001","event_type":"OrderPlaced","event_data":{"total":42}}

{"stream_id":"0190f5c2-0000-7000-8000-000000000001","event_type":"OrderShipped","metadata":{"user_id":"u-1"},"stream_version":2}
"#;
        let events = parse_lines(input.as_bytes(), "stdin").unwrap();
        assert_eq!(events.len(), 2);
        assert_eq!(events[0].metadata, serde_json::json!({}));
        assert_eq!(events[1].event_data, serde_json::json!({}));
        assert_eq!(events[1].stream_version, Some(2));
    }

    #[test]
    fn reports_every_bad_line_with_its_number() {
        let input = [
            r#"{"stream_id":"0190f5c2-0000-7000-8000-000000000001","event_type":"A"}"#,
            r#"{"stream_id":"not-a-uuid","event_type":"A"}"#,
            r#"{"stream_id":"0190f5c2-0000-7000-8000-000000000001","event_type":"A","colour":1}"#,
            r#"{"stream_id":"0190f5c2-0000-7000-8000-000000000001","event_type":"A""#,
            r#"{"stream_id":"0190f5c2-0000-7000-8000-000000000001","event_type":" "}"#,
            r#"{"stream_id":"0190f5c2-0000-7000-8000-000000000001","event_type":"A","scope":[1]}"#,
            r#"{"event_type":"A"}"#,
        ]
        .join("\n");
        let err = parse_lines(input.as_bytes(), "events.jsonl").unwrap_err();
        let lines: Vec<usize> = err.problems.iter().map(|(l, _)| *l).collect();
        assert_eq!(lines, vec![2, 3, 4, 5, 6, 7]);
        let text = err.to_string();
        assert!(
            text.starts_with("events.jsonl: 6 malformed line(s), nothing appended"),
            "{text}"
        );
        assert!(text.contains("line 3: unknown field `colour`"), "{text}");
        assert!(
            text.contains("line 6: scope must be a JSON object"),
            "{text}"
        );
        assert!(text.contains("line 7: missing field `stream_id`"), "{text}");
    }

    /// Issue 26, finding 7: an escaped NUL anywhere is refused naming its line (it used to
    /// reach the server and fail the whole append with no line number).
    #[test]
    fn refuses_a_nul_naming_the_line_and_field() {
        let input = concat!(
            r#"{"stream_id": "0190f5c2-6c1a-7000-8000-000000000001", "event_type": "A"}"#,
            "\n",
            r#"{"stream_id": "0190f5c2-6c1a-7000-8000-000000000001", "event_type": "A", "event_data": {"a": ["x\u0000y"]}}"#,
            "\n",
            r#"{"stream_id": "0190f5c2-6c1a-7000-8000-000000000001", "event_type": "A\u0000"}"#,
            "\n",
            r#"{"stream_id": "0190f5c2-6c1a-7000-8000-000000000001", "event_type": "A", "metadata": {"k\u0000": 1}}"#,
            "\n",
        );
        let err = parse_lines(input.as_bytes(), "stdin").unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("line 2: event_data contains a NUL character"),
            "{text}"
        );
        assert!(
            text.contains("line 3: event_type contains a NUL character"),
            "{text}"
        );
        assert!(
            text.contains("line 4: metadata contains a NUL character"),
            "{text}"
        );
        assert_eq!(err.problems.len(), 3, "{text}");
    }

    #[test]
    fn refuses_event_types_no_handler_can_subscribe_to() {
        let line = |event_type: &str| {
            format!(
                r#"{{"stream_id":"0190f5c2-0000-7000-8000-000000000001","event_type":"{event_type}"}}"#
            )
        };
        let longest = "A".repeat(MAX_EVENT_TYPE_LEN);
        assert!(parse_lines(line(&longest).as_bytes(), "stdin").is_ok());
        let err = parse_lines(line(&format!("{longest}B")).as_bytes(), "stdin").unwrap_err();
        assert_eq!(
            err.problems,
            vec![(
                1,
                format!(
                    "event_type is {} characters long; at most {MAX_EVENT_TYPE_LEN} are allowed",
                    MAX_EVENT_TYPE_LEN + 1
                )
            )]
        );
    }
}
