//! The slots of `wh_drain` (`drain.sql`).

use minijinja::{context, Value};

use super::sequencing::{lock_slots, KEY_LOCK_SLOTS};
use super::{apply_function_name, batch_function_name, quote_literal, render};
use crate::config::{Ordering, PerspectiveConfig, Sequencing};
use crate::store::failure::retry_delay_sql;
use crate::store::names::{cursor_status, SEQUENCING_BUSY, SWITCHED_AWAY};

/// How long a `wh_drain` call waits for a lock before it gives the pair up as contended
/// (55P03, retried soon, not a failure): far below PostgreSQL's `deadlock_timeout` (1 s by
/// default), so a call never sits in a lock cycle holding the rows of the pairs it applied
/// until the server notices — under cross-stream contention that second per cycle, with every
/// other applier queued behind the call, was most of the time. A shorter `lock_timeout` of the
/// role or database is kept.
pub const LOCK_TIMEOUT_MS: u32 = 100;

/// `CREATE OR REPLACE FUNCTION <schema>.wh_drain(...)`, dispatching to the apply function of
/// each of `perspectives` (see `drain.sql`), preceded by the drop of an older shape.
pub fn create_drain_function(schema: &str, perspectives: &[PerspectiveConfig]) -> String {
    let names = |keep: &dyn Fn(&PerspectiveConfig) -> bool| {
        let literals: Vec<String> = perspectives
            .iter()
            .filter(|p| keep(p))
            .map(|p| quote_literal(&p.name))
            .collect();
        format!("ARRAY[{}]::text[]", literals.join(", "))
    };
    let event_id_ordering = perspectives.iter().any(|p| p.ordering == Ordering::EventId);
    let event_id_perspectives = names(&|p| p.ordering == Ordering::EventId);
    let compiled_perspectives = names(&|_| true);
    let keyed_names = names(&|p| p.sequencing == Sequencing::Key);
    let sequenced: Vec<Value> = perspectives
        .iter()
        .filter_map(|p| lock_slots(schema, p))
        .collect();
    let perspectives: Vec<Value> = perspectives
        .iter()
        .map(|p| {
            context! {
                name => &p.name,
                function => apply_function_name(&p.name),
                batch => batch_function_name(&p.name),
                lock => lock_slots(schema, p),
            }
        })
        .collect();
    render(
        "drain.sql",
        context! {
            schema,
            perspectives,
            event_id_perspectives,
            event_id_ordering,
            compiled_perspectives,
            sequenced,
            keyed_names,
            sequencing_busy => SEQUENCING_BUSY,
            switched_away => SWITCHED_AWAY,
            key_slots => KEY_LOCK_SLOTS,
            cursor_completed => cursor_status::COMPLETED,
            cursor_failed => cursor_status::FAILED,
            lock_timeout_ms => LOCK_TIMEOUT_MS,
            // The head row's failure count after this failure: its attempts plus this one.
            retry_delay => retry_delay_sql("p_retry_base_ms", "p_retry_max_ms", "w.attempts + 1"),
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn drain_dispatches_to_every_apply_function() {
        let mut config =
            Config::from_yaml_str(include_str!("../../../examples/shop.yaml"), "shop.yaml")
                .unwrap();
        // (customer_stats is serial: its branches check its key first, see the test below.)
        for p in &mut config.perspectives {
            p.sequencing = Sequencing::Stream;
        }
        let sql = create_drain_function("shop", &config.perspectives);
        assert!(sql.starts_with("DO $wh_drop$"), "{sql}");
        assert!(sql.contains("p.proname = 'wh_drain'"));
        assert!(sql.contains("CREATE OR REPLACE FUNCTION shop.wh_drain("));
        for (i, p) in config.perspectives.iter().enumerate() {
            let keyword = if i == 0 { "IF" } else { "ELSIF" };
            assert!(
                sql.contains(&format!(
                    "{keyword} r.perspective_name = '{}' THEN\n        SELECT * INTO o FROM shop.{}(",
                    p.name,
                    apply_function_name(&p.name)
                )),
                "{sql}"
            );
        }
        // The due-work probe, once past the cursor and once past what was applied.
        assert!(sql.contains("AND w.stream_version > v_last AND w.processed_at IS NULL"));
        assert!(sql.contains(
            "AND w.stream_version > coalesce(o.o_last_version, v_last) AND w.processed_at IS NULL"
        ));
        assert!(sql.contains("PERFORM shop.move_to_dead_letters("));
        // Each pair in its own subtransaction; its failure is recorded on its head row with
        // the backoff after one more failure.
        assert!(sql.contains("EXCEPTION WHEN OTHERS OR query_canceled THEN"));
        // A pair whose own apply function a blue/green switch dropped is retried, not failed.
        for p in &config.perspectives {
            let when = format!(
                "WHEN '{}' THEN 'shop.{}'",
                p.name,
                apply_function_name(&p.name)
            );
            assert!(sql.contains(&when), "{when}: {sql}");
        }
        assert!(sql.contains("IF SQLSTATE = '42883' AND to_regproc(CASE r.perspective_name"));
        assert!(sql.contains(&format!(
            "'{{}}'::uuid[], '{SWITCHED_AWAY}';\n        CONTINUE;"
        )));
        assert!(sql.contains("attempts = w.attempts + 1,\n               scheduled_for = clock_timestamp() + make_interval(secs => least(p_retry_base_ms * power(2, least(greatest((w.attempts + 1) - 1, 0), 30)), p_retry_max_ms) / 1000.0)"), "{sql}");
        // Retired rows after the apply are those at or below the cursor read with them and at
        // or below the cursor the window followed (none for a first window: no statement).
        assert!(
            sql.contains("IF v_last > 0 THEN\n        v_retire := ARRAY("),
            "{sql}"
        );
        assert!(sql.contains("AND w.stream_version <= v_last\n"), "{sql}");
        assert!(!sql.contains("o_done_work_ids) AS d(id)"), "{sql}");
        // Shallow pairs: one batch call per perspective, which then no longer has its pairs
        // applied one by one unless the set-based attempt failed.
        for (i, p) in config.perspectives.iter().enumerate() {
            let keyword = if i == 0 { "IF" } else { "ELSIF" };
            assert!(
                sql.contains(&format!(
                    "{keyword} g_names[v_j] = '{}' THEN\n          SELECT * INTO b FROM shop.{}(",
                    p.name,
                    batch_function_name(&p.name)
                )),
                "{sql}"
            );
        }
        assert!(
            sql.contains(
                "WHERE v_fallback AND (v_cancel_i IS NULL OR x.k <> v_k)\n    ORDER BY 1, 2"
            ),
            "{sql}"
        );
        assert!(sql.contains("RAISE EXCEPTION '%', v_cancel_err USING ERRCODE = 'WH408';"));
    }

    /// Only perspectives ordered by event id have their windows checked for a rewind.
    #[test]
    fn rewind_checks_only_for_event_id_ordering() {
        let yaml = "schema: s
perspectives:
  - name: a
    handlers:
      A: SELECT 1
  - name: b
    ordering: eventId
    reset: SELECT 1
    handlers:
      A: SELECT 1
";
        let config = Config::from_yaml_str(yaml, "t").unwrap();
        let sql = create_drain_function("s", &config.perspectives);
        assert!(
            sql.contains("AND (p.perspective_name <> ALL (ARRAY['b']::text[])"),
            "{sql}"
        );
        assert!(sql.contains("AND p.perspective_name = ANY (ARRAY['a', 'b']::text[])"));
        assert!(sql.contains("lag(w0.event_id) OVER (ORDER BY w0.stream_version) AS prev_event"));
        let commit_only = create_drain_function("s", &config.perspectives[..1]);
        assert!(commit_only.contains("AND (p.perspective_name <> ALL (ARRAY[]::text[])"));
        assert!(
            commit_only.contains("NULL::uuid AS prev_event"),
            "{commit_only}"
        );
    }

    /// A sequenced perspective's pairs take their keys' locks (if free) before anything is
    /// applied, and a key that arrived since only if it is free; stream ones take none.
    #[test]
    fn sequenced_perspectives_lock_their_keys_first_and_check_them_before_applying() {
        let yaml = "schema: s
perspectives:
  - name: a
    handlers:
      A: SELECT 1
  - name: by_key
    sequencing: key
    sequencingKey: \":data->>'customer'\"
    handlers:
      A: SELECT 1
  - name: one
    sequencing: serial
    handlers:
      A: SELECT 1
";
        let config = Config::from_yaml_str(yaml, "t").unwrap();
        let sql = create_drain_function("s", &config.perspectives);
        assert!(sql.contains("p_perspectives text[] DEFAULT NULL)"), "{sql}");
        assert!(sql
            .contains("WHERE p_perspectives IS NULL OR s.perspective_name = ANY (p_perspectives)"));
        assert!(sql.contains(
            "IF p_perspectives IS NULL OR p_perspectives && ARRAY['by_key']::text[] THEN"
        ));
        let take = sql
            .find("THEN pg_try_advisory_xact_lock(t.class, t.slot) END AS got")
            .expect("the keys taken");
        assert!(
            take < sql.find("WITH pair AS").unwrap(),
            "keys are taken before any row is read for applying"
        );
        assert_eq!(
            sql.matches("NOT IN (SELECT * FROM unnest(v_busy_streams, v_busy_names))")
                .count(),
            2,
            "busy pairs are left out of both listings"
        );
        assert!(
            sql.contains("'{}'::uuid[], busy.st\n               FROM unnest(v_busy_streams, v_busy_names, v_busy_states) AS busy(s, p, st)"),
            "{sql}"
        );
        assert!(
            !sql.contains("pg_advisory_xact_lock("),
            "never waits for a key"
        );
        assert!(sql.contains("SELECT x.s AS stream_id, x.perspective_name, hashtext('s.by_key') AS class, s.wh_key_by_key(e::s.wh_event_store) AS slot"), "{sql}");
        // Index probes per stream and per row, not joins the planner may hash whole.
        assert_eq!(
            sql.matches("AND w.processed_at IS NULL OFFSET 0) x\n      CROSS JOIN LATERAL (SELECT e0.* FROM s.wh_event_store e0 WHERE e0.stream_id = x.s AND e0.stream_version = x.v LIMIT 1) e")
                .count(),
            2,
            "{sql}"
        );
        // The keys are first taken with the expression inline; through the key function only
        // after an error.
        let inline = sql
            .find("hashtext('s.by_key') AS class, (hashtext(coalesce((e.event_data->>'customer')::text, '')) & 63) AS slot")
            .expect("the inline key");
        let safe = sql
            .find("hashtext('s.by_key') AS class, s.wh_key_by_key(e::s.wh_event_store) AS slot")
            .unwrap();
        let handler = sql[inline..safe].find("EXCEPTION WHEN OTHERS THEN");
        assert!(handler.is_some(), "{sql}");
        // A serial perspective takes its one lock without reading its rows first.
        assert!(
            sql.contains("IF (p_perspectives IS NULL OR 'one' = ANY (p_perspectives))\n       AND NOT pg_try_advisory_xact_lock(hashtext('s.one'), 0) THEN\n      v_busy_serial := v_busy_serial || 'one'::text;"),
            "{sql}"
        );
        assert!(!sql.contains("hashtext('s.one') AS class"), "{sql}");
        // The check before each apply, in both paths, for the sequenced perspectives only.
        assert_eq!(
            sql.matches("NOT pg_try_advisory_xact_lock(hashtext('s.by_key')")
                .count(),
            2
        );
        assert_eq!(
            sql.matches("NOT pg_try_advisory_xact_lock(hashtext('s.one'), 0)")
                .count(),
            3,
            "the lock up front and the check in both paths"
        );
        assert!(!sql.contains("hashtext('s.a')"));
        // Without sequenced perspectives there is no wait at all.
        let plain = create_drain_function("s", &config.perspectives[..1]);
        assert!(!plain.contains("pg_advisory_xact_lock"), "{plain}");
        assert!(plain
            .contains("WHERE p_perspectives IS NULL OR s.perspective_name = ANY (p_perspectives)"));
    }
}
