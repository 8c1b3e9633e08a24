//! The slots of a perspective's apply function (`apply_function.sql`, `apply_body.sql` and the
//! pieces it includes).

use std::collections::{BTreeMap, BTreeSet};

use minijinja::{context, Value};

use super::dollar_tag;
use super::sequencing::lock_slots;
use super::{apply_function_name, batch_function_name, render};
use crate::config::sql_params::{Param, ParsedStatement};
use crate::config::{Ordering, PerspectiveConfig};
use crate::store::failure::retry_delay_sql;
use crate::store::names::{applied_channel, cursor_status};

/// `CREATE OR REPLACE FUNCTION` for `perspective` in `schema`, preceded by the drop of overloads
/// of an older shape. The perspective must be valid (see [`crate::config::Config::validate`]).
pub fn create_apply_function(schema: &str, perspective: &PerspectiveConfig) -> String {
    let body = render(
        "apply_body.sql",
        context! {
            schema,
            perspective => &perspective.name,
            event_id_order => perspective.ordering == Ordering::EventId,
            handled_types => perspective.handlers.keys().cloned().collect::<Vec<_>>(),
            uses => uses(perspective),
            reads => reads(perspective),
            handlers => handlers(schema, perspective),
            batch_types => batch_types(perspective),
            reset => reset(schema, perspective),
            lock => lock_slots(schema, perspective),
            lock_mode => perspective.sequencing.as_str(),
            cursor_completed => cursor_status::COMPLETED,
            cursor_failed => cursor_status::FAILED,
            applied_channel => applied_channel(schema),
            retry_delay => retry_delay_sql(
                "p_retry_base_ms",
                "p_retry_max_ms",
                "w.attempts + CASE WHEN p_count_failure THEN 1 ELSE 0 END",
            ),
        },
    );
    render(
        "apply_function.sql",
        context! {
            schema,
            function => apply_function_name(&perspective.name),
            tag => dollar_tag(&body),
            body,
        },
    )
}

/// `CREATE OR REPLACE FUNCTION` of `perspective`'s batch function (`batch_function.sql`: the
/// events of many shallow pairs in one loop, for `wh_drain`'s set-based path), preceded by the
/// drop of overloads of an older shape. The perspective must be valid.
pub fn create_batch_function(schema: &str, perspective: &PerspectiveConfig) -> String {
    // The only text in it not spelled by this binary is the handlers'.
    let handler_sql: Vec<String> = perspective
        .compiled_handlers()
        .iter()
        .flat_map(|(_, statements)| statements.iter().map(|s| statement(schema, s)))
        .collect();
    render(
        "batch_function.sql",
        context! {
            schema,
            function => batch_function_name(&perspective.name),
            tag => dollar_tag(&handler_sql.join("\n")),
            uses => uses(perspective),
            reads => reads(perspective),
            handlers => handlers(schema, perspective),
            batch_types => batch_types(perspective),
        },
    )
}

/// Per parameter name, whether any handler uses it: only those are bound, and only their
/// columns read (every assignment costs, per event).
fn uses(perspective: &PerspectiveConfig) -> Value {
    let used: BTreeSet<Param> = perspective
        .compiled_handlers()
        .iter()
        .flat_map(|(_, statements)| statements.iter().flat_map(|s| s.params()))
        .collect();
    Param::ALL
        .iter()
        .map(|p| (p.name(), used.contains(p)))
        .collect::<BTreeMap<_, _>>()
        .into()
}

/// Per event column, whether the events are read with it: when a handler uses its parameter,
/// and every column when a batch handler reads `:events` (its relation has them all).
fn reads(perspective: &PerspectiveConfig) -> Value {
    let batch = !batch_types(perspective).is_empty();
    let used: BTreeSet<Param> = perspective
        .compiled_handlers()
        .iter()
        .flat_map(|(_, statements)| statements.iter().flat_map(|s| s.params()))
        .collect();
    Param::PER_EVENT
        .iter()
        .map(|p| (p.name(), batch || used.contains(p)))
        .collect::<BTreeMap<_, _>>()
        .into()
}

/// The event types whose handler is a batch handler (reads `:events`), as SQL literals joined
/// by commas; empty when there is none.
fn batch_types(perspective: &PerspectiveConfig) -> String {
    perspective
        .compiled_handlers()
        .iter()
        .filter(|(_, statements)| statements.iter().any(is_batch))
        .map(|(event_type, _)| format!("'{}'", event_type.replace('\'', "''")))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Whether the statement reads `:events`, making its handler a batch handler.
fn is_batch(stmt: &ParsedStatement) -> bool {
    stmt.params().contains(&Param::Events)
}

/// The handlers in config order: event type and PL/pgSQL statements.
fn handlers(schema: &str, perspective: &PerspectiveConfig) -> Value {
    perspective
        .compiled_handlers()
        .iter()
        .map(|(event_type, statements)| {
            context! {
                event_type,
                statements => statements.iter().map(|s| statement(schema, s)).collect::<Vec<_>>(),
            }
        })
        .collect()
}

/// The `reset` statements as PL/pgSQL (none without a reset).
fn reset(schema: &str, perspective: &PerspectiveConfig) -> Value {
    perspective
        .compiled_reset()
        .unwrap_or_default()
        .iter()
        .map(|s| statement(schema, s))
        .collect()
}

/// Whether `stmt` runs as PERFORM, its rows discarded: a bare SELECT. PL/pgSQL refuses any
/// other statement that returns rows (`INSERT … RETURNING`, `WITH … SELECT`, `VALUES`) at run
/// time, so `migrate` rejects those (see `migrate::returns_rows_nowhere`).
pub fn runs_as_perform(stmt: &ParsedStatement) -> bool {
    stmt.leading_keyword().as_deref() == Some("select")
}

/// One handler statement as PL/pgSQL: parameters become variables, and `:events` the run of
/// events v_i..v_j (apply_event.sql) through `wh_run_events`; a bare SELECT becomes PERFORM
/// (PL/pgSQL refuses a SELECT whose result goes nowhere).
fn statement(schema: &str, stmt: &ParsedStatement) -> String {
    let text = stmt.render_with(|p| match p {
        Param::Events => format!(
            "{schema}.wh_run_events(_wh_run_streams, a_event_ids[v_i:v_j], a_versions[v_i:v_j], \
             a_types[v_i:v_j], a_data[v_i:v_j], a_metadata[v_i:v_j], a_scope[v_i:v_j], \
             a_created[v_i:v_j], a_users[v_i:v_j], a_tenants[v_i:v_j])"
        ),
        _ => format!("_wh_{}", p.name()),
    });
    if runs_as_perform(stmt) {
        format!("PERFORM{}", &text["select".len()..])
    } else {
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn shop() -> Config {
        Config::from_yaml_str(include_str!("../../../examples/shop.yaml"), "shop.yaml").unwrap()
    }

    /// A perspective `p` in schema `s` with the given extra YAML (indented under the perspective).
    fn perspective(extra: &str) -> PerspectiveConfig {
        let yaml = format!("schema: s\nperspectives:\n  - name: p\n{extra}");
        Config::from_yaml_str(&yaml, "t").unwrap().perspectives[0].clone()
    }

    fn event_id_ordered() -> PerspectiveConfig {
        perspective(
            "    ordering: eventId
    reset: DELETE FROM seen WHERE stream_id = :stream_id
    handlers:
      A: INSERT INTO seen VALUES (:stream_id, :data)
      B: INSERT INTO seen VALUES (:stream_id, NULL)
",
        )
    }

    fn commit_ordered() -> PerspectiveConfig {
        let mut p = event_id_ordered();
        p.ordering = Ordering::Commit;
        p
    }

    #[test]
    fn handlers_become_static_sql_with_variables() {
        let config = shop();
        let sql = create_apply_function("shop", &config.perspectives[0]);
        assert!(sql.starts_with("DO $wh_drop$"));
        assert!(sql.contains("CREATE OR REPLACE FUNCTION shop.wh_apply_order_summary("));
        assert!(sql.contains("IF a_types[v_i] = 'OrderPlaced' THEN"));
        assert!(sql.contains("ELSIF a_types[v_i] = 'OrderShipped' THEN"));
        assert!(
            sql.contains("_wh_data := a_data[v_i];"),
            "handlers use :data"
        );
        assert!(
            !sql.contains("_wh_scope := a_scope[v_i];"),
            "no handler uses :scope"
        );
        assert!(sql.contains("WHERE order_id = _wh_stream_id"));
        assert!(!sql.contains(":stream_id"), "no named parameter is left");
    }

    #[test]
    fn bare_select_becomes_perform() {
        let p = perspective("    handlers:\n      A: select pg_notify('x', :event_type)\n");
        let sql = create_apply_function("s", &p);
        assert!(
            sql.contains("PERFORM pg_notify('x', _wh_event_type);"),
            "{sql}"
        );
    }

    #[test]
    fn dollar_tag_avoids_collisions() {
        assert_eq!(dollar_tag("x"), "$wh_apply$");
        assert_eq!(dollar_tag("a $wh_apply$ b"), "$wh_apply1$");
        let p = perspective("    handlers:\n      A: SELECT '$wh_apply$'\n");
        let sql = create_apply_function("s", &p);
        assert!(sql.contains("AS $wh_apply1$\n"), "{sql}");
        assert!(sql.trim_end().ends_with("$wh_apply1$"), "{sql}");
    }

    /// event_arrays.sql: a column is read only when a handler uses it, in the slot's order.
    #[test]
    fn event_arrays_read_only_the_used_columns_in_version_order() {
        let sql = create_apply_function("s", &commit_ordered());
        assert!(sql.contains("array_agg(e.event_data ORDER BY e.stream_version)"));
        assert!(!sql.contains("array_agg(e.metadata ORDER BY"), "{sql}");
        assert!(
            sql.contains("NULL::timestamptz[]"),
            "no handler uses :created_at"
        );
        assert!(!sql.contains("ORDER BY e.event_id"), "{sql}");
    }

    /// rewind_detect.sql: with eventId ordering the replay reads the stream in event-id order.
    #[test]
    fn rewind_detection_only_with_event_id_ordering() {
        let sql = create_apply_function("s", &event_id_ordered());
        assert!(sql.contains("v_rewound := true;"), "{sql}");
        assert!(sql.contains(
            "SELECT array_agg(e.event_id ORDER BY e.event_id), array_agg(e.stream_version ORDER BY e.event_id),"
        ));
        assert!(sql.contains("array_agg(e.event_data ORDER BY e.event_id)"));
        assert!(sql.contains("AND e.event_type IN ('A', 'B');"), "{sql}");
        let commit = create_apply_function("s", &commit_ordered());
        assert!(!commit.contains("v_rewound := true;"));
        assert!(!commit.contains("ORDER BY e.event_id"));
    }

    /// rewind_detect.sql with sequencing: key: the replay takes the locks of the keys of every
    /// event it applies again, or gives the pair up as contention; serial (whose one lock
    /// wh_drain holds already) and stream take none.
    #[test]
    fn a_keyed_rewind_locks_the_keys_of_its_replay() {
        let keyed = {
            let mut p = event_id_ordered();
            p.sequencing = crate::config::Sequencing::Key;
            p.sequencing_key = Some(":data->>'c'".into());
            p
        };
        let sql = create_apply_function("s", &keyed);
        let replay = sql.find("v_last := 0;").expect("the replay's arrays");
        assert!(
            sql[replay..]
                .contains("FROM (SELECT p_stream_id AS s, u.v FROM unnest(a_versions) AS u(v)) x"),
            "the check of the replay's keys comes after the replay's arrays: {sql}"
        );
        assert!(sql.contains("CROSS JOIN LATERAL (SELECT e0.* FROM s.wh_event_store e0 WHERE e0.stream_id = x.s AND e0.stream_version = x.v LIMIT 1) e WHERE NOT pg_try_advisory_xact_lock(hashtext('s.p'), s.wh_key_p(e::s.wh_event_store))"), "{sql}");
        assert!(sql.contains("USING ERRCODE = 'lock_not_available'"));
        let serial = {
            let mut p = event_id_ordered();
            p.sequencing = crate::config::Sequencing::Serial;
            p
        };
        for p in [serial, event_id_ordered()] {
            let sql = create_apply_function("s", &p);
            assert!(!sql.contains("pg_try_advisory_xact_lock"), "{sql}");
        }
    }

    /// A dead-letter replay (p_force) of a key- or serial-sequenced perspective first waits for
    /// its events' keys, before the events are read; a stream-sequenced one takes none.
    #[test]
    fn a_forced_apply_waits_for_its_keys() {
        let mut keyed = commit_ordered();
        keyed.sequencing = crate::config::Sequencing::Key;
        keyed.sequencing_key = Some(":data->>'c'".into());
        let sql = create_apply_function("s", &keyed);
        let wait = sql
            .find("IF p_force THEN\n    -- A dead-letter replay applies outside wh_drain")
            .expect("the wait");
        assert!(sql[wait..].starts_with("IF p_force THEN"), "{sql}");
        assert!(
            sql.contains("PERFORM pg_advisory_xact_lock(k.class, k.slot)\n    FROM (SELECT DISTINCT hashtext('s.p') AS class, s.wh_key_p(e::s.wh_event_store) AS slot"),
            "{sql}"
        );
        assert!(wait < sql.find("array_agg(e.event_type").unwrap(), "{sql}");
        let mut serial = commit_ordered();
        serial.sequencing = crate::config::Sequencing::Serial;
        assert!(create_apply_function("s", &serial)
            .contains("FROM (SELECT DISTINCT hashtext('s.p') AS class, 0 AS slot"));
        assert!(!create_apply_function("s", &commit_ordered())
            .contains("pg_advisory_xact_lock(k.class"));
    }

    /// rewind_reset.sql: the reset runs before the replay, under the triggering event's
    /// identity, only with eventId ordering.
    #[test]
    fn rewind_reset_only_with_event_id_ordering() {
        let sql = create_apply_function("s", &event_id_ordered());
        assert!(
            sql.contains(
                "v_set_tenant := set_config('perspective.tenant_id', coalesce(a_tenants[v_trigger_i], ''), true);\n      DELETE FROM seen WHERE stream_id = _wh_stream_id;\n    END IF;"
            ),
            "{sql}"
        );
        let commit = create_apply_function("s", &commit_ordered());
        assert!(!commit.contains("DELETE FROM seen"), "{commit}");
    }

    /// apply_event.sql and slow_path.sql: the event is applied on the fast path and again, in
    /// its own subtransaction, on the slow path.
    #[test]
    fn slow_path_isolates_the_failing_event() {
        let sql = create_apply_function("s", &commit_ordered());
        assert!(sql.contains("-- Slow path: event by event"), "{sql}");
        assert!(sql.contains("        v_failed := v_i;"), "{sql}");
        assert_eq!(sql.matches("IF a_types[v_i] = 'A' THEN").count(), 2);
        assert_eq!(
            sql.matches("v_set_user := set_config('perspective.user_id'")
                .count(),
            2
        );
    }

    /// notify_applied.sql: applied ids, completed ids and the notification on `<schema>_applied`.
    #[test]
    fn lifecycle_notifies_completed_events() {
        let sql = create_apply_function("s", &commit_ordered());
        assert!(sql.contains("IF p_notify_applied AND v_applied > 0 THEN"));
        assert!(sql.contains("v_applied_ids := a_event_ids[v_start:v_last_i];"));
        assert!(
            sql.contains(
                "IN (SELECT v FROM s.wh_applied_by_all(p_stream_id, a_versions, a_types) AS v)"
            ),
            "{sql}"
        );
        assert!(
            sql.contains("PERFORM pg_notify('s_applied', c::text) FROM unnest(v_completed) AS c;")
        );
    }

    /// instant_completion.sql: done rows are completed in the apply transaction with p_instant.
    #[test]
    fn instant_completion_completes_done_rows() {
        let sql = create_apply_function("s", &commit_ordered());
        assert!(sql.contains(
            "IF p_instant AND cardinality(v_done) > 0 THEN\n      PERFORM s.complete_perspective_events(v_done, p_debug);"
        ), "{sql}");
    }

    /// apply_body.sql and slow_path.sql: a cancelled handler (statement timeout) fails its
    /// event without running again, and no event starts past wh_drain's budget.
    #[test]
    fn a_cancelled_handler_fails_its_event_and_is_not_run_again() {
        let sql = create_apply_function("s", &commit_ordered());
        assert!(
            sql.contains("p_contiguous boolean DEFAULT false, p_stop_at timestamptz DEFAULT NULL)")
        );
        assert_eq!(
            sql.matches("WHEN OTHERS OR query_canceled THEN").count(),
            2,
            "{sql}"
        );
        assert!(!sql.contains("EXCEPTION WHEN OTHERS THEN"), "{sql}");
        assert!(sql.contains("      v_running := v_i;\n"), "{sql}");
        assert!(sql.contains("IF SQLSTATE = '57014' THEN\n      v_cancelled := v_running;"));
        assert!(sql.contains(
            "IF v_i = v_cancelled THEN\n        -- Cancelled on the fast path (the call's timer is spent): not run again.\n        v_failed := v_i;"
        ), "{sql}");
        assert!(sql.contains(
            "IF v_i > v_start AND NOT v_rewound AND clock_timestamp() >= p_stop_at THEN"
        ));
        assert!(sql.contains(
            "IF v_cancelled IS NULL AND v_i > v_start AND clock_timestamp() >= p_stop_at THEN"
        ));
    }

    /// apply_body.sql and slow_path.sql: a lock conflict (deadlock, serialization failure, lock
    /// timeout) is caught before the failure handlers, records nothing, skips the slow path
    /// and is returned; a replay (p_force) raises it.
    #[test]
    fn a_lock_conflict_is_returned_not_recorded() {
        let sql = create_apply_function("s", &commit_ordered());
        assert!(sql.contains("o_applied_event_ids uuid[], o_contended_sqlstate text"));
        assert_eq!(
            sql.matches(
                "EXCEPTION WHEN deadlock_detected OR serialization_failure OR lock_not_available THEN"
            )
            .count(),
            2,
            "{sql}"
        );
        assert!(
            sql.contains(
                "lock_not_available THEN\n    IF p_force THEN\n      RAISE;\n    END IF;\n"
            ),
            "{sql}"
        );
        assert!(sql.contains("IF NOT v_ok AND NOT v_rewound AND v_contended IS NULL THEN"));
        assert!(sql.contains("EXIT WHEN v_failed IS NOT NULL OR v_contended IS NOT NULL;"));
        assert!(
            sql.contains("v_completed, v_applied_ids, v_contended;"),
            "{sql}"
        );
    }

    /// A failing event waits base × 2^(failures − 1): the drain path counts this failure, a
    /// custom runner's lease has counted it already.
    #[test]
    fn the_retry_delay_counts_this_failure_once() {
        let sql = create_apply_function("s", &commit_ordered());
        assert!(sql.contains(
            "scheduled_for = clock_timestamp() + make_interval(secs => least(p_retry_base_ms * power(2, least(greatest((w.attempts + CASE WHEN p_count_failure THEN 1 ELSE 0 END) - 1, 0), 30)), p_retry_max_ms) / 1000.0)"
        ), "{sql}");
    }

    /// batch_function.sql: many pairs' events in one loop, each bound to its own stream, with
    /// the identity set per event, the handler-timeout budget, and a cancelled handler reported
    /// by its index rather than raised.
    #[test]
    fn the_batch_function_applies_many_streams_in_one_loop() {
        let sql = create_batch_function("s", &commit_ordered());
        assert!(sql.starts_with("DO $wh_drop$"), "{sql}");
        assert!(sql.contains("p.proname = 'wh_batch_p'"));
        assert!(sql.contains(
            "oidvectortypes(p.proargtypes) <> 'uuid[], uuid[], bigint[], timestamp with time zone'"
        ));
        assert!(sql.contains("CREATE OR REPLACE FUNCTION s.wh_batch_p("));
        assert!(sql.contains("SET search_path TO s, public"));
        assert!(sql.contains("CROSS JOIN LATERAL (SELECT * FROM s.wh_event_store e0\n                      WHERE e0.stream_id = x.stream_id AND e0.stream_version = x.stream_version\n                      LIMIT 1) e;"), "{sql}");
        assert!(
            sql.contains("array_agg(e.event_data ORDER BY x.i)"),
            "{sql}"
        );
        assert!(
            sql.contains("      _wh_stream_id := a_streams[v_i];\n"),
            "{sql}"
        );
        assert!(sql.contains("IF a_types[v_i] = 'A' THEN"));
        assert!(sql.contains("INSERT INTO seen VALUES (_wh_stream_id, _wh_data);"));
        assert!(
            sql.contains("v_set_user := set_config('perspective.user_id', a_users[v_i], true);")
        );
        assert!(sql.contains("IF v_i > 1 AND clock_timestamp() >= p_stop_at THEN"));
        assert!(sql.contains(
            "EXCEPTION WHEN query_canceled THEN\n    RETURN QUERY SELECT 0, v_running, SQLERRM;"
        ));
        assert!(
            !sql.contains("DELETE FROM seen"),
            "no reset: shallow pairs never rewind"
        );
        assert!(sql.trim_end().ends_with("$wh_apply$"), "{sql}");
        let p = perspective("    handlers:\n      A: SELECT '$wh_apply$'\n");
        let sql = create_batch_function("s", &p);
        assert!(sql.contains("AS $wh_apply1$\n"), "{sql}");
        assert!(sql.trim_end().ends_with("$wh_apply1$"), "{sql}");
    }

    /// A handler that reads `:events` runs once per run of its type's consecutive events: the
    /// run's slices go to wh_run_events, every column is read, the identity set is the run's
    /// (or ''), and both loops go on past the run. A per-event handler beside it is unchanged.
    #[test]
    fn a_batch_handler_runs_once_per_run_of_its_type() {
        let p = perspective(
            "    handlers:\n      A: INSERT INTO n SELECT count(*) FROM :events\n      B: INSERT INTO seen VALUES (:stream_id, :data)\n",
        );
        for sql in [
            create_apply_function("s", &p),
            create_batch_function("s", &p),
        ] {
            assert!(
                sql.contains("IF a_types[v_i] IN ('A') THEN\n        WHILE v_j < "),
                "{sql}"
            );
            assert!(
                sql.contains("INSERT INTO n SELECT count(*) FROM s.wh_run_events(_wh_run_streams, a_event_ids[v_i:v_j], a_versions[v_i:v_j], a_types[v_i:v_j], a_data[v_i:v_j], a_metadata[v_i:v_j], a_scope[v_i:v_j], a_created[v_i:v_j], a_users[v_i:v_j], a_tenants[v_i:v_j]);"),
                "{sql}"
            );
            assert!(sql.contains("INSERT INTO seen VALUES (_wh_stream_id, _wh_data);"));
            assert!(
                sql.contains("array_agg(e.metadata ORDER BY"),
                "every column read: {sql}"
            );
            assert!(
                sql.contains("v_set_user := set_config('perspective.user_id', v_run_user, true);")
            );
            assert!(sql.contains("v_run_user := '';"));
            assert!(sql.contains("v_i := v_j + 1;"), "{sql}");
        }
        let apply = create_apply_function("s", &p);
        assert!(apply.contains("WHILE v_j < v_end AND a_types[v_j + 1] = a_types[v_i] LOOP"));
        assert!(apply.contains("_wh_run_streams := array_fill(p_stream_id, ARRAY[v_j - v_i + 1]);"));
        assert!(
            apply.contains("WHILE v_j < v_i AND"),
            "the slow path applies a run of one: {apply}"
        );
        let batch = create_batch_function("s", &p);
        assert!(batch.contains("WHILE v_j < v_n AND a_types[v_j + 1] = a_types[v_i] LOOP"));
        assert!(batch.contains("_wh_run_streams := a_streams[v_i:v_j];"));
        // Without a batch handler: no run, a FOR loop, and each event's own identity.
        let plain = create_batch_function("s", &commit_ordered());
        assert!(!plain.contains("v_run_user"), "{plain}");
        assert!(!plain.contains("v_j"), "{plain}");
        assert!(plain.contains("FOR v_i IN 1..v_n LOOP"), "{plain}");
        let plain = create_apply_function("s", &commit_ordered());
        assert!(!plain.contains("v_j"), "{plain}");
        assert!(plain.contains("FOR v_i IN v_start..v_end LOOP"), "{plain}");
    }

    /// apply_function.sql: the argument list the drop block keeps matches the CREATE statement.
    #[test]
    fn the_function_keeps_its_shape() {
        let sql = create_apply_function("s", &commit_ordered());
        assert!(sql.contains("CREATE OR REPLACE FUNCTION s.wh_apply_p("));
        assert!(sql.contains("p.proname = 'wh_apply_p'"));
        assert!(sql.contains(
            "oidvectortypes(p.proargtypes) <> 'uuid, bigint[], uuid[], bigint[], boolean, boolean, \
             boolean, double precision, double precision, boolean, boolean, boolean, \
             timestamp with time zone'"
        ));
        assert!(sql.contains("SET search_path TO s, public"));
        assert!(sql.contains("RETURNS TABLE (o_applied integer,"));
    }
}
