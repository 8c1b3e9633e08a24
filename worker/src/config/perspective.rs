//! One perspective's configuration: its name and version, the order its streams' events are
//! applied in, its `setup` and `reset` SQL and its handlers (event type to SQL, in file order).
//!
//! The handler SQL is lexed with [`super::sql_params`]; the rules a perspective must follow
//! are checked in `validate`.

use std::collections::BTreeMap;
use std::fmt;

use indexmap::IndexMap;
use schemars::JsonSchema;
use serde::de::{Deserializer, Error as _, MapAccess, Visitor};
use serde::{Deserialize, Serialize};

use super::names::PERSPECTIVE_NAME_PATTERN;
use super::sql_params::{self, ParsedStatement};

/// One perspective: a read model maintained by SQL handlers, one per event type.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PerspectiveConfig {
    /// Perspective name, unique in the deployment (lower-case letters, digits and underscores).
    #[schemars(pattern(PERSPECTIVE_NAME_PATTERN))]
    pub name: String,
    /// Version of the model built by these handlers (default 1). Raising it makes migrate rebuild the perspective online from the event store: stream by stream in place (needs `reset`), or beside the old version with rebuild: blueGreen.
    #[serde(default = "default_perspective_version")]
    #[schemars(range(min = 1))]
    pub version: u32,
    /// Order of applying a stream's events: commit (default) or eventId (rewinds on late events).
    #[serde(default)]
    pub ordering: Ordering,
    /// Which events may apply concurrently: stream (default: streams in parallel, each in order), key (events with the same sequencingKey never concurrently) or serial (one applier at a time, many events per transaction). Choose key or serial when handlers write rows that many streams share.
    #[serde(default)]
    pub sequencing: Sequencing,
    /// With sequencing: key, an SQL expression over the event's parameters naming the rows the handlers share, e.g. :data->>'customer'.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 4096))]
    pub sequencing_key: Option<String>,
    /// Idempotent DDL run by migrate with the schema on the search_path; cannot use :parameters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub setup: Option<String>,
    /// SQL that removes one stream's share of the model (may use :stream_id); enables rewind and rebuild.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reset: Option<String>,
    /// How a version bump rebuilds the model: inPlace (default: each stream reset and replayed in the live tables) or blueGreen (the new version is built in a shadow schema while the old one serves, then one transaction switches the tables).
    #[serde(default)]
    pub rebuild: Rebuild,
    /// With rebuild: blueGreen, how many previous versions are kept (tables and progress) so that setting version back to one switches back without a rebuild (0-5, default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 5))]
    pub keep_previous_versions: Option<u32>,
    /// Event type to SQL run once per event in the apply transaction, with :stream_id, :data and other parameters.
    // Kept in file order: handlers are listed, registered and reported as the user wrote them.
    #[serde(deserialize_with = "deserialize_handlers")]
    #[schemars(with = "BTreeMap<String, String>", extend("minProperties" = 1))]
    pub handlers: IndexMap<String, String>,
}

fn default_perspective_version() -> u32 {
    1
}

/// The order in which a stream's events are applied to a perspective.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum Ordering {
    /// Apply in stream version (commit) order.
    #[default]
    Commit,
    /// Apply in event id order; an event older than the last applied one rewinds the stream.
    EventId,
}

/// Which of a perspective's events may be applied at the same time (DESIGN §12.2). Per-stream
/// order and exactly-once hold in every mode; the mode decides how appliers share the rows
/// that many streams write.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum Sequencing {
    /// Streams apply in parallel, each in order: for rows owned by one stream.
    #[default]
    Stream,
    /// Events with the same `sequencingKey` never apply concurrently: for rows owned by the key
    /// (one row per customer, per day).
    Key,
    /// One applier at a time, many events per transaction: for rows every event writes (a
    /// global counter, a dashboard).
    Serial,
}

/// How a version bump rebuilds a perspective (DESIGN §12.6).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum Rebuild {
    /// Each stream is reset and replayed in the live tables, one commit per chunk of streams.
    #[default]
    InPlace,
    /// The new version is built in a shadow schema while the old one serves; once caught up,
    /// one transaction moves the new tables in and the old ones out.
    BlueGreen,
}

/// Default of `keepPreviousVersions`.
pub const DEFAULT_KEEP_PREVIOUS_VERSIONS: u32 = 1;
/// Most previous versions a blue/green perspective keeps.
pub const MAX_KEEP_PREVIOUS_VERSIONS: u32 = 5;

impl Sequencing {
    /// The name used in the config.
    pub fn as_str(self) -> &'static str {
        match self {
            Sequencing::Stream => "stream",
            Sequencing::Key => "key",
            Sequencing::Serial => "serial",
        }
    }
}

impl PerspectiveConfig {
    /// How many previous versions a blue/green perspective keeps.
    pub fn keep_previous_versions(&self) -> u32 {
        self.keep_previous_versions
            .unwrap_or(DEFAULT_KEEP_PREVIOUS_VERSIONS)
    }

    /// The `sequencingKey` expression, lexed.
    ///
    /// # Panics
    /// If the key does not lex; call only on a config that passed validation.
    pub fn compiled_sequencing_key(&self) -> Option<ParsedStatement> {
        self.sequencing_key.as_deref().map(|sql| {
            let mut statements = sql_params::parse_statements(sql)
                .unwrap_or_else(|e| panic!("sequencingKey of {} is not validated: {e}", self.name));
            assert_eq!(
                statements.len(),
                1,
                "sequencingKey of {} is not validated",
                self.name
            );
            statements.remove(0)
        })
    }

    /// The event types this perspective handles, in config order.
    pub fn event_types(&self) -> impl Iterator<Item = &str> {
        self.handlers.keys().map(String::as_str)
    }

    /// Each handler's statements, in config order.
    ///
    /// # Panics
    /// If a handler does not lex; call only on a config that passed validation.
    pub fn compiled_handlers(&self) -> Vec<(String, Vec<ParsedStatement>)> {
        self.handlers
            .iter()
            .map(|(event_type, sql)| {
                let statements = sql_params::parse_statements(sql).unwrap_or_else(|e| {
                    panic!(
                        "handler {event_type} of {} is not validated: {e}",
                        self.name
                    )
                });
                (event_type.clone(), statements)
            })
            .collect()
    }

    /// The `reset` statements, if the perspective has any.
    ///
    /// # Panics
    /// If `reset` does not lex; call only on a config that passed validation.
    pub fn compiled_reset(&self) -> Option<Vec<ParsedStatement>> {
        self.reset.as_deref().map(|sql| {
            sql_params::parse_statements(sql)
                .unwrap_or_else(|e| panic!("reset of {} is not validated: {e}", self.name))
        })
    }
}

/// Deserializes the handler map, keeping file order and rejecting a repeated event type
/// (plain map deserialization would silently keep only the last one).
fn deserialize_handlers<'de, D>(deserializer: D) -> Result<IndexMap<String, String>, D::Error>
where
    D: Deserializer<'de>,
{
    struct HandlersVisitor;

    impl<'de> Visitor<'de> for HandlersVisitor {
        type Value = IndexMap<String, String>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a mapping from event type to handler SQL")
        }

        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut handlers = IndexMap::with_capacity(map.size_hint().unwrap_or(0));
            while let Some(event_type) = map.next_key::<String>()? {
                if handlers.contains_key(&event_type) {
                    return Err(A::Error::custom(format!(
                        "duplicate event type `{event_type}` in handlers"
                    )));
                }
                let sql = map.next_value::<String>()?;
                handlers.insert(event_type, sql);
            }
            Ok(handlers)
        }
    }

    deserializer.deserialize_map(HandlersVisitor)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::{parse, MINIMAL};

    #[test]
    fn ordering_event_id_is_accepted_with_a_reset() {
        let text = MINIMAL.replace(
            "    handlers:",
            "    ordering: eventId\n    reset: DELETE FROM t WHERE id = :stream_id\n    handlers:",
        );
        let config = parse(&text).unwrap();
        assert_eq!(config.perspectives[0].ordering, Ordering::EventId);
        let without = MINIMAL.replace("    handlers:", "    ordering: eventId\n    handlers:");
        let err = parse(&without).unwrap_err().to_string();
        assert!(
            err.contains(".reset: ordering: eventId needs a reset"),
            "{err}"
        );
    }

    #[test]
    fn handler_order_is_preserved() {
        let config = parse(
            "schema: s
perspectives:
  - name: p
    handlers:
      Zeta: SELECT 1
      Alpha: SELECT 2
      Mid.Event: SELECT 3
",
        )
        .unwrap();
        let perspective = &config.perspectives[0];
        assert_eq!(
            perspective.event_types().collect::<Vec<_>>(),
            ["Zeta", "Alpha", "Mid.Event"]
        );
        let compiled: Vec<_> = perspective
            .compiled_handlers()
            .into_iter()
            .map(|(event_type, statements)| (event_type, statements[0].to_positional().0))
            .collect();
        assert_eq!(compiled[1], ("Alpha".to_owned(), "SELECT 2".to_owned()));
    }

    #[test]
    fn sequencing_defaults_to_stream_and_accepts_key_and_serial() {
        assert_eq!(
            parse(MINIMAL).unwrap().perspectives[0].sequencing,
            Sequencing::Stream
        );
        let serial = MINIMAL.replace("    handlers:", "    sequencing: serial\n    handlers:");
        assert_eq!(
            parse(&serial).unwrap().perspectives[0].sequencing,
            Sequencing::Serial
        );
        let key = MINIMAL.replace(
            "    handlers:",
            "    sequencing: key\n    sequencingKey: \":data->>'customer'\"\n    handlers:",
        );
        let p = &parse(&key).unwrap().perspectives[0];
        assert_eq!(p.sequencing, Sequencing::Key);
        assert_eq!(
            p.compiled_sequencing_key()
                .unwrap()
                .render_with(|p| format!("<{}>", p.name())),
            "<data>->>'customer'"
        );
    }

    #[test]
    fn a_sequencing_key_goes_with_sequencing_key_only_and_is_one_expression() {
        let with = |lines: &str| {
            parse(&MINIMAL.replace("    handlers:", &format!("{lines}\n    handlers:")))
        };
        let err = with("    sequencing: key").unwrap_err().to_string();
        assert!(
            err.contains(".sequencingKey: sequencing: key needs a sequencingKey"),
            "{err}"
        );
        let err = with("    sequencingKey: :data->>'c'")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("sequencingKey is used only with sequencing: key (this perspective has sequencing: stream)"),
            "{err}"
        );
        let err = with("    sequencing: serial\n    sequencingKey: :data->>'c'")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("(this perspective has sequencing: serial)"),
            "{err}"
        );
        for bad in [
            "\"SELECT 1\"",
            "\":data->>'a'; :data->>'b'\"",
            "\":data->>'a';\"",
            "\"'unterminated\"",
        ] {
            let err = with(&format!("    sequencing: key\n    sequencingKey: {bad}"))
                .unwrap_err()
                .to_string();
            assert!(err.contains(".sequencingKey: "), "{bad}: {err}");
        }
        let err = with("    sequencing: sideways").unwrap_err().to_string();
        assert!(err.contains("sideways"), "{err}");
        // A semicolon inside a literal is part of the expression.
        with("    sequencing: key\n    sequencingKey: \"coalesce(:data->>'a', ';')\"").unwrap();
    }
}
