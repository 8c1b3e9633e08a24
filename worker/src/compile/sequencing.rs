//! The SQL of a perspective's sequencing (DESIGN §12.2) for `wh_drain` (`drain.sql`): which
//! advisory lock an event of a `key` or `serial` perspective takes.
//!
//! A lock is (class, slot): the class names the perspective in its schema, the slot the key.
//! Keys are folded into [`KEY_LOCK_SLOTS`] slots: a call takes at most that many locks per
//! perspective however many keys its rows carry (PostgreSQL's shared lock table is sized by
//! `max_locks_per_transaction`), at the price of serializing two keys that share a slot.
//! A `serial` perspective has one slot. A `key` perspective's slot is computed by its key
//! function, `<schema>.wh_key_<perspective>(event row)` ([`create_key_function`]): one place
//! for the expression, resolved like the handlers (the schema on the search_path), and an
//! event whose key cannot be computed (bad data: a cast that fails) takes the empty key's
//! slot instead of failing every `wh_drain` call that meets it; its handler then applies it or
//! fails it as for any event.

use minijinja::{context, Value};

use super::{dollar_tag, quote_literal};
use crate::config::sql_params::Param;
use crate::config::{PerspectiveConfig, Sequencing};
use crate::store::names::key_function_name;

/// How many advisory locks the keys of one `key` perspective fold into.
pub const KEY_LOCK_SLOTS: u32 = 64;

/// The lock of a sequenced perspective's events, for `drain.sql`: `class` and `slot` are SQL
/// over an event row `e` of the store (`slot` reads it only when `from_store`), and `join`
/// brings `e` in for a row `x(s, v)` (stream, version). `fast_slot` is the same slot with the
/// key expression inline: 14 times cheaper than the key function (0.25 against 3.6 µs an
/// event; the function's error handler is a subtransaction), but it raises on an event whose
/// key fails. `wh_drain` takes the keys of all its pending rows with it, and through the
/// function only after such an error. None for `sequencing: stream`.
pub fn lock_slots(schema: &str, perspective: &PerspectiveConfig) -> Option<Value> {
    let class = format!(
        "hashtext({})",
        quote_literal(&format!("{schema}.{}", perspective.name))
    );
    let (slot, fast_slot, from_store) = match perspective.sequencing {
        Sequencing::Stream => return None,
        Sequencing::Serial => ("0".to_owned(), "0".to_owned(), false),
        Sequencing::Key => (
            // (`e` may be a LATERAL subquery's row, a record: cast to the store's row type.)
            format!(
                "{schema}.{}(e::{schema}.wh_event_store)",
                key_function_name(&perspective.name)
            ),
            key_slot(perspective),
            true,
        ),
    };
    // One index probe per row, forced by LATERAL … LIMIT 1: as a plain join, a custom plan of
    // a store of tens of thousands of events hashed all of it for a few hundred rows.
    let join = if from_store {
        format!(
            "CROSS JOIN LATERAL (SELECT e0.* FROM {schema}.wh_event_store e0 \
             WHERE e0.stream_id = x.s AND e0.stream_version = x.v LIMIT 1) e"
        )
    } else {
        String::new()
    };
    Some(context! { name => &perspective.name, class, slot, fast_slot, from_store, join })
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

/// `CREATE OR REPLACE FUNCTION <schema>.wh_key_<perspective>(e <schema>.wh_event_store)`, the
/// lock slot of an event of a `sequencing: key` perspective; for any other sequencing, the drop
/// of one an earlier `key` config left.
pub fn create_key_function(schema: &str, perspective: &PerspectiveConfig) -> String {
    let name = key_function_name(&perspective.name);
    if perspective.sequencing != Sequencing::Key {
        return format!("DROP FUNCTION IF EXISTS {schema}.{name}({schema}.wh_event_store)");
    }
    let body = format!(
        "
BEGIN
  RETURN {};
EXCEPTION WHEN OTHERS THEN
  -- The key cannot be computed for this event: the empty key's slot (see compile::sequencing).
  RETURN hashtext('') & {};
END
",
        key_slot(perspective),
        KEY_LOCK_SLOTS - 1
    );
    let tag = dollar_tag(&body);
    format!(
        "CREATE OR REPLACE FUNCTION {schema}.{name}(e {schema}.wh_event_store) RETURNS integer
LANGUAGE plpgsql STABLE
-- The key may name the perspective's tables as its handlers do.
SET search_path TO {schema}, public
AS {tag}{body}{tag}"
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
        // Validation refuses `:events` in a key (one event's expression).
        Param::Events => unreachable!("a sequencingKey never reads :events (validated)"),
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
            "s.wh_key_p(e::s.wh_event_store)"
        );
        let f = create_key_function("s", &p);
        assert!(
            f.starts_with(
                "CREATE OR REPLACE FUNCTION s.wh_key_p(e s.wh_event_store) RETURNS integer"
            ),
            "{f}"
        );
        assert!(
            f.contains("RETURN (hashtext(coalesce((e.event_data->>'customer')::text, '')) & 63);"),
            "{f}"
        );
        assert!(f.contains("EXCEPTION WHEN OTHERS THEN\n"), "{f}");
        assert!(f.contains("RETURN hashtext('') & 63;"), "{f}");
        assert!(f.contains("SET search_path TO s, public"), "{f}");
        assert!(lock.get_attr("from_store").unwrap().is_true());
        assert!(lock
            .get_attr("join")
            .unwrap()
            .to_string()
            .contains("e0.stream_id = x.s AND e0.stream_version = x.v LIMIT 1) e"));
    }

    #[test]
    fn serial_has_one_slot_and_stream_none() {
        let lock = lock_slots("s", &perspective("    sequencing: serial\n")).unwrap();
        assert_eq!(lock.get_attr("slot").unwrap().to_string(), "0");
        assert!(!lock.get_attr("from_store").unwrap().is_true());
        assert!(lock_slots("s", &perspective("")).is_none());
        assert_eq!(
            create_key_function("s", &perspective("")),
            "DROP FUNCTION IF EXISTS s.wh_key_p(s.wh_event_store)"
        );
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
        for &param in Param::PER_EVENT {
            assert!(event_column(param).contains("e."), "{param:?}");
        }
    }
}
