//! Compiles a deployment's perspectives into server-side PL/pgSQL: one apply function per
//! perspective, which applies a whole (stream, perspective) group of events per round trip, and
//! `wh_drain`, which claims and applies an instance's pending work in one call.
//!
//! Round trips dominate the apply path, so instead of one client statement per event the worker
//! calls `<schema>.wh_apply_<perspective>(stream, work ids, event ids, versions, …)` once per
//! group; the function reads the events from the store itself. The handler SQL becomes static
//! SQL inside the function (plans are cached per session), `:params` become PL/pgSQL variables,
//! and per event the function sets `perspective.user_id` / `perspective.tenant_id` with
//! `set_config(…, true)` before running that event's handler.
//!
//! Exactly-once lives in the generated code: the function locks the group's cursor row, skips
//! events at or below `last_version`, refuses to apply past a pending row of the pair that is not
//! in the group (ordering), and advances the cursor in the same transaction as the model changes.
//! A group is first applied in one subtransaction; only if that fails is it replayed event by
//! event, each in its own subtransaction, to commit the good prefix and record the failing event
//! (error, backoff in `scheduled_for`, lease released; cursor status Failed).
//!
//! # Templates
//!
//! The SQL lives in the `.sql` files beside this one, one piece per concern, each opening with a
//! comment that names its slots: `apply_function.sql` (the CREATE statement) around
//! `apply_body.sql`, which includes `event_arrays.sql` (the events read, in a given order),
//! `rewind_detect.sql` and `rewind_reset.sql` (ordering eventId only), `apply_event.sql` (one
//! event: parameters, identity, handler), `slow_path.sql` (failure isolation),
//! `notify_applied.sql` (lifecycle) and `instant_completion.sql`; `drain.sql` is `wh_drain`, and
//! `drop_older_overloads.sql` removes functions of an older shape before either is created.
//!
//! They are rendered with `minijinja` rather than a hand-written slot filler: the pieces need
//! conditionals (`{% if event_id_order %}`, a column only when a handler uses it) and loops (one
//! branch per handler), which a plain slot filler would push back into Rust string building.
//! The environment never escapes (auto-escaping is for HTML; values are SQL spelled by the slot
//! fillers, literals quoted with the `literal` filter) and treats an undefined variable as an
//! error (`UndefinedBehavior::Strict`), so a misspelt or unfilled slot fails the unit tests
//! instead of rendering as empty SQL. A rendering error is a bug in this binary, never in the
//! user's config (which is validated before it gets here), so the public functions panic on it.
//!
//! # What a compiled function depends on
//!
//! [`definition_hash`] hashes every input of the generated code, and `migrate` records it per
//! perspective; `run` refuses a perspective whose recorded hash differs, and the operator names
//! its migration Job by it, so neither can go on with stale functions.

mod apply;
mod definition;
mod drain;
mod sequencing;

use std::sync::OnceLock;

use minijinja::syntax::SyntaxConfig;
use minijinja::{AutoEscape, Environment, UndefinedBehavior, Value};

pub use apply::{create_apply_function, create_batch_function, runs_as_perform};
pub use definition::{definition_hash, handlers_hash};
pub use drain::create_drain_function;
pub use sequencing::{create_key_function, sequencing_key_check};

use crate::store::names::{apply_function_name, batch_function_name};

/// `perspective`'s apply, batch and key functions, as `migrate` installs them. With `home` (a
/// blue/green version that is not live), their `search_path` puts `home` before the deployment
/// schema: handlers keep unqualified table names and write the version's own tables, while
/// tables only the deployment schema has (lookups) stay readable.
pub fn create_perspective_functions(
    schema: &str,
    perspective: &crate::config::PerspectiveConfig,
    home: Option<&str>,
) -> String {
    let sql = create_apply_function(schema, perspective)
        + ";\n"
        + &create_batch_function(schema, perspective)
        + ";\n"
        + &create_key_function(schema, perspective);
    let Some(home) = home else {
        return sql;
    };
    // Every generated function spells its search_path this way (one slot would have to be
    // threaded through every template for this one case).
    let from = format!("SET search_path TO {schema}, public\n");
    assert!(
        sql.contains(&from),
        "generated functions set their search_path"
    );
    sql.replace(
        &from,
        &format!("SET search_path TO {home}, {schema}, public\n"),
    )
}

/// The template pieces, by the name they are included by.
const TEMPLATES: [(&str, &str); 13] = [
    ("apply_function.sql", include_str!("apply_function.sql")),
    ("apply_body.sql", include_str!("apply_body.sql")),
    ("event_arrays.sql", include_str!("event_arrays.sql")),
    (
        "handler_variables.sql",
        include_str!("handler_variables.sql"),
    ),
    ("rewind_detect.sql", include_str!("rewind_detect.sql")),
    ("rewind_reset.sql", include_str!("rewind_reset.sql")),
    ("apply_event.sql", include_str!("apply_event.sql")),
    ("slow_path.sql", include_str!("slow_path.sql")),
    ("notify_applied.sql", include_str!("notify_applied.sql")),
    (
        "instant_completion.sql",
        include_str!("instant_completion.sql"),
    ),
    ("batch_function.sql", include_str!("batch_function.sql")),
    ("drain.sql", include_str!("drain.sql")),
    (
        "drop_older_overloads.sql",
        include_str!("drop_older_overloads.sql"),
    ),
];

fn templates() -> &'static Environment<'static> {
    static TEMPLATES_ENV: OnceLock<Environment<'static>> = OnceLock::new();
    TEMPLATES_ENV.get_or_init(|| {
        let mut env = Environment::new();
        // Block tags on their own line leave no blank line behind; files end with a newline.
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(true)
            .build()
            .expect("valid syntax config");
        env.set_syntax(syntax);
        env.set_undefined_behavior(UndefinedBehavior::Strict);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.add_filter("literal", |s: &str| quote_literal(s));
        for (name, source) in TEMPLATES {
            env.add_template(name, source)
                .unwrap_or_else(|e| panic!("template {name} does not parse: {e:#}"));
        }
        env
    })
}

/// Renders template `name` with `context`; see the module doc for why an error panics.
fn render(name: &str, context: Value) -> String {
    templates()
        .get_template(name)
        .and_then(|t| t.render(context))
        .unwrap_or_else(|e| panic!("template {name} does not render: {e:#}"))
}

/// A dollar-quote tag that occurs nowhere in `body`.
fn dollar_tag(body: &str) -> String {
    (0..)
        .map(|n| {
            if n == 0 {
                "$wh_apply$".to_string()
            } else {
                format!("$wh_apply{n}$")
            }
        })
        .find(|tag| !body.contains(tag.as_str()))
        .expect("some tag is free")
}

/// `s` as an SQL string literal.
fn quote_literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use minijinja::context;

    #[test]
    fn function_names_fit_postgres_identifiers() {
        assert_eq!(
            apply_function_name("order_summary"),
            "wh_apply_order_summary"
        );
        let long = "a".repeat(63);
        let name = apply_function_name(&long);
        assert!(name.len() <= 63, "{name}");
        assert_ne!(name, apply_function_name(&format!("{}b", "a".repeat(62))));
    }

    #[test]
    fn a_version_beside_the_live_one_resolves_its_home_first() {
        let config = crate::config::Config::from_yaml_str(
            "schema: s\nperspectives:\n  - name: p\n    sequencing: key\n    sequencingKey: :data->>'c'\n    handlers:\n      A: SELECT 1\n",
            "t.yaml",
        )
        .unwrap();
        let p = &config.perspectives[0];
        let live = create_perspective_functions("s", p, None);
        assert_eq!(
            live.matches("SET search_path TO s, public\n").count(),
            3,
            "{live}"
        );
        let home = create_perspective_functions("s", p, Some("s_p_v2"));
        assert_eq!(
            home.matches("SET search_path TO s_p_v2, s, public\n")
                .count(),
            3
        );
        assert!(!home.contains("SET search_path TO s, public"));
    }

    #[test]
    fn literals_are_quoted_and_nothing_is_escaped() {
        let env = templates();
        let out = env
            .render_str(
                "{{ x|literal }} {{ y }}",
                context! { x => "it's", y => "<&>" },
            )
            .unwrap();
        assert_eq!(out, "'it''s' <&>");
    }

    #[test]
    fn an_unfilled_slot_is_an_error() {
        // The drop block with `result` missing.
        let context = context! { schema => "s", name => "f", args => "uuid" };
        let err = templates()
            .get_template("drop_older_overloads.sql")
            .unwrap()
            .render(context)
            .unwrap_err();
        assert!(err.to_string().contains("undefined"), "{err}");
    }

    #[test]
    fn drop_older_overloads_compares_arguments_and_result() {
        let sql = render(
            "drop_older_overloads.sql",
            context! { schema => "s", name => "f", args => "uuid, integer", result => "o_x integer" },
        );
        assert!(sql.starts_with("DO $wh_drop$"), "{sql}");
        assert!(sql.contains("p.proname = 'f'"), "{sql}");
        assert!(sql.contains("to_regnamespace('s')"), "{sql}");
        assert!(sql.contains("<> 'uuid, integer'"), "{sql}");
        assert!(sql.contains("<> 'TABLE(o_x integer)'"), "{sql}");
    }
}
