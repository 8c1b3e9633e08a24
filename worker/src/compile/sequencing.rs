//! The SQL of a perspective's sequencing (DESIGN §12.2) for `wh_drain` (`drain.sql`): which
//! advisory lock an event of a `key` or `serial` perspective takes.
//!
//! A lock is (class, slot): the class names the perspective in its schema, the slot the key.
//! Keys are folded into [`KEY_LOCK_SLOTS`] slots: a call takes at most that many locks per
//! perspective however many keys its rows carry (PostgreSQL's shared lock table is sized by
//! `max_locks_per_transaction`), at the price of serializing two keys that share a slot.
//! A `serial` perspective has one slot.

use minijinja::{context, Value};

use super::quote_literal;
use crate::config::sql_params::Param;
use crate::config::{PerspectiveConfig, Sequencing};

/// How many advisory locks the keys of one `key` perspective fold into.
pub const KEY_LOCK_SLOTS: u32 = 64;

/// The lock of a sequenced perspective's events, for `drain.sql`: `class` and `slot` are SQL
/// over an event row `e` of the store (`slot` reads it only when `from_store`), and `join`
/// brings `e` in for a row `x(s, v)` (stream, version). None for `sequencing: stream`.
pub fn lock_slots(schema: &str, perspective: &PerspectiveConfig) -> Option<Value> {
    let class = format!(
        "hashtext({})",
        quote_literal(&format!("{schema}.{}", perspective.name))
    );
    let (slot, from_store) = match perspective.sequencing {
        Sequencing::Stream => return None,
        Sequencing::Serial => ("0".to_owned(), false),
        Sequencing::Key => (key_slot(perspective), true),
    };
    let join = if from_store {
        format!("JOIN {schema}.wh_event_store e ON e.stream_id = x.s AND e.stream_version = x.v")
    } else {
        String::new()
    };
    Some(context! { name => &perspective.name, class, slot, from_store, join })
}

/// The lock slot of an event row `e` of the store of a `key` perspective: its key, hashed and
/// folded into [`KEY_LOCK_SLOTS`].
fn key_slot(perspective: &PerspectiveConfig) -> String {
    let key = perspective
        .compiled_sequencing_key()
        .expect("sequencing: key without a validated sequencingKey")
        .render_with(event_column);
    format!(
        "(hashtext(coalesce(({key})::text, '')) & {})",
        KEY_LOCK_SLOTS - 1
    )
}

/// For a `key` perspective, a query that `migrate` prepares to prove its `sequencingKey`
/// compiles against the event store (a misspelt function or column, a type error, a
/// set-returning or aggregate function), as `wh_drain` uses it: over an event row `e`, in a
/// WHERE clause. `wh_drain` itself would compile it only when first called, and fail every call.
/// None for the other modes.
pub fn sequencing_key_check(schema: &str, perspective: &PerspectiveConfig) -> Option<String> {
    (perspective.sequencing == Sequencing::Key).then(|| {
        format!(
            "SELECT 1 FROM {schema}.wh_event_store e WHERE {} IS NULL LIMIT 0",
            key_slot(perspective)
        )
    })
}

/// A handler parameter as the column of the store's event row `e` it is bound from.
fn event_column(param: Param) -> String {
    let identity = |key: &str| {
        format!(
            "coalesce(CASE WHEN jsonb_typeof(e.metadata -> '{key}') = 'string' THEN e.metadata ->> '{key}' END, \
             CASE WHEN jsonb_typeof(e.scope -> '{key}') = 'string' THEN e.scope ->> '{key}' END, '')"
        )
    };
    match param {
        Param::StreamId => "e.stream_id".into(),
        Param::EventId => "e.event_id".into(),
        Param::StreamVersion => "e.stream_version".into(),
        Param::EventType => "e.event_type".into(),
        Param::Data => "e.event_data".into(),
        Param::Metadata => "e.metadata".into(),
        Param::Scope => "e.scope".into(),
        Param::CreatedAt => "e.created_at".into(),
        Param::UserId => identity("user_id"),
        Param::TenantId => identity("tenant_id"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn perspective(lines: &str) -> PerspectiveConfig {
        let yaml = format!(
            "schema: s\nperspectives:\n  - name: p\n{lines}    handlers:\n      A: SELECT 1\n"
        );
        Config::from_yaml_str(&yaml, "t")
            .unwrap()
            .perspectives
            .remove(0)
    }

    #[test]
    fn a_key_folds_into_slots_read_from_the_event_row() {
        let p = perspective("    sequencing: key\n    sequencingKey: \":data->>'customer'\"\n");
        let lock = lock_slots("s", &p).unwrap();
        assert_eq!(
            lock.get_attr("class").unwrap().to_string(),
            "hashtext('s.p')"
        );
        assert_eq!(
            lock.get_attr("slot").unwrap().to_string(),
            "(hashtext(coalesce((e.event_data->>'customer')::text, '')) & 63)"
        );
        assert!(lock.get_attr("from_store").unwrap().is_true());
        assert!(lock
            .get_attr("join")
            .unwrap()
            .to_string()
            .contains("e.stream_id = x.s"));
    }

    #[test]
    fn serial_has_one_slot_and_stream_none() {
        let lock = lock_slots("s", &perspective("    sequencing: serial\n")).unwrap();
        assert_eq!(lock.get_attr("slot").unwrap().to_string(), "0");
        assert!(!lock.get_attr("from_store").unwrap().is_true());
        assert!(lock_slots("s", &perspective("")).is_none());
    }

    #[test]
    fn only_a_key_is_checked_over_the_event_store() {
        let p = perspective("    sequencing: key\n    sequencingKey: \":data->>'customer'\"\n");
        assert_eq!(
            sequencing_key_check("s", &p).unwrap(),
            "SELECT 1 FROM s.wh_event_store e WHERE (hashtext(coalesce((e.event_data->>'customer')::text, '')) & 63) IS NULL LIMIT 0"
        );
        assert!(sequencing_key_check("s", &perspective("    sequencing: serial\n")).is_none());
        assert!(sequencing_key_check("s", &perspective("")).is_none());
    }

    #[test]
    fn every_parameter_has_a_column() {
        for param in Param::ALL {
            assert!(event_column(param).contains("e."), "{param:?}");
        }
    }
}
