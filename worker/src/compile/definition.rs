//! The one hash of everything a compiled apply function depends on.

use sha2::{Digest, Sha256};

use crate::config::{Ordering, PerspectiveConfig};

/// Bumped whenever the generated code changes (templates or slot fillers), so `migrate`
/// recompiles and `run` refuses functions an older binary generated.
const FORMAT_VERSION: &str = "apply-v44";

/// Hash of everything `migrate` compiles and runs for `perspective` in `schema`: the format
/// version, schema, name, version, ordering, sequencing (and its key), setup, reset and handlers. Options that are passed to the
/// functions as arguments at run time (completion strategy, retry backoff, …) are not in it.
///
/// `migrate` records it per perspective, `run` refuses to start when a recorded hash differs
/// from the config's, and the operator names its migration Job by it.
pub fn definition_hash(schema: &str, perspective: &PerspectiveConfig) -> String {
    let mut h = Sha256::new();
    // Length-prefixed fields, so no two different inputs hash alike.
    let mut field = |bytes: &[u8]| {
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    };
    field(FORMAT_VERSION.as_bytes());
    field(schema.as_bytes());
    field(perspective.name.as_bytes());
    field(&perspective.version.to_le_bytes());
    field(match perspective.ordering {
        Ordering::Commit => b"commit",
        Ordering::EventId => b"eventId",
    });
    field(perspective.sequencing.as_str().as_bytes());
    for optional in [
        &perspective.sequencing_key,
        &perspective.setup,
        &perspective.reset,
    ] {
        match optional {
            None => field(b"none"),
            Some(sql) => {
                field(b"some");
                field(sql.as_bytes());
            }
        }
    }
    field(&(perspective.handlers.len() as u64).to_le_bytes());
    for (event_type, sql) in &perspective.handlers {
        field(event_type.as_bytes());
        field(sql.as_bytes());
    }
    hex::encode(h.finalize())
}

/// Hash of what decides the rows a perspective's handlers build: its ordering and handlers.
/// `migrate` records it, so a later change made without a new `version` can be reported (the
/// rows already built came from the old handlers).
pub fn handlers_hash(perspective: &PerspectiveConfig) -> String {
    let mut h = Sha256::new();
    let mut field = |bytes: &[u8]| {
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    };
    field(match perspective.ordering {
        Ordering::Commit => b"commit",
        Ordering::EventId => b"eventId",
    });
    for (event_type, sql) in &perspective.handlers {
        field(event_type.as_bytes());
        field(sql.as_bytes());
    }
    hex::encode(h.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compile::{create_apply_function, create_batch_function, create_drain_function};
    use crate::config::Config;

    fn shop() -> Config {
        Config::from_yaml_str(include_str!("../../../examples/shop.yaml"), "shop.yaml").unwrap()
    }

    /// What a test changes, and how.
    type Edit = (&'static str, fn(&mut PerspectiveConfig));

    #[test]
    fn definition_hash_tracks_every_input() {
        let config = shop();
        let base = &config.perspectives[0];
        assert!(base.setup.is_some() && base.reset.is_some());
        let hash = |p: &PerspectiveConfig| definition_hash("shop", p);
        assert_eq!(hash(base), hash(&base.clone()));
        assert_ne!(definition_hash("other", base), hash(base), "schema");
        let edits: [Edit; 10] = [
            ("handler", |p| {
                let first = p.handlers.keys().next().unwrap().clone();
                p.handlers.insert(first, "SELECT 1".into());
            }),
            ("name", |p| p.name.push('x')),
            ("version", |p| p.version += 1),
            ("ordering", |p| p.ordering = Ordering::EventId),
            ("setup", |p| p.setup = Some("SELECT 2".into())),
            ("no setup", |p| p.setup = None),
            ("reset", |p| p.reset = Some("SELECT 2".into())),
            ("empty reset", |p| p.reset = Some(String::new())),
            ("sequencing", |p| {
                p.sequencing = crate::config::Sequencing::Serial
            }),
            ("sequencing key", |p| {
                p.sequencing_key = Some(":data->>'c'".into())
            }),
        ];
        for (what, edit) in edits {
            let mut p = base.clone();
            edit(&mut p);
            assert_ne!(p, *base, "{what} is a change");
            assert_ne!(hash(&p), hash(base), "{what}");
        }
    }

    #[test]
    fn fields_do_not_run_into_each_other() {
        let config = shop();
        let mut a = config.perspectives[0].clone();
        let mut b = a.clone();
        a.setup = Some("ab".into());
        a.reset = Some("c".into());
        b.setup = Some("a".into());
        b.reset = Some("bc".into());
        assert_ne!(definition_hash("shop", &a), definition_hash("shop", &b));
        assert_ne!(
            definition_hash("ab", &a),
            definition_hash("a", &{
                let mut c = a.clone();
                c.name = format!("b{}", a.name);
                c
            })
        );
    }

    /// Pins the generated code of the shop example: when templates or slot fillers change what
    /// they generate, bump FORMAT_VERSION (so deployments recompile) and update the pin.
    #[test]
    fn generated_code_changes_bump_the_format_version() {
        let config = shop();
        let mut h = Sha256::new();
        for p in &config.perspectives {
            h.update(create_apply_function("shop", p));
            h.update(create_batch_function("shop", p));
        }
        h.update(create_drain_function("shop", &config.perspectives));
        assert_eq!(
            (FORMAT_VERSION, hex::encode(h.finalize()).as_str()),
            (
                "apply-v44",
                "9b4e24e5e50f1904c0f765fe6c734c2a50379038855d1552549cb5ecd63f5f6f"
            ),
            "the generated SQL changed: bump FORMAT_VERSION and update this pin"
        );
    }
}
