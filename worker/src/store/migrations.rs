//! The versioned SQL of `migrations/`, embedded into the binary and rendered for one schema.
//! Migrations hold tables, indexes, types and data. The functions that migrations 0001 to 0017
//! define are history: the current text of every engine function is in `store/functions/`,
//! installed by `migrate` after the migrations (see the `functions` module beside this one).

use sha2::{Digest, Sha256};

/// One embedded migration. `template` contains `{{schema}}` placeholders.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    pub version: i32,
    pub name: &'static str,
    pub template: &'static str,
}

/// Every migration this binary knows, in version order. Applied migrations are immutable:
/// change the schema by adding a file, never by editing one (their checksums are recorded).
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "0001_event_store.sql",
        template: include_str!("../../../migrations/0001_event_store.sql"),
    },
    Migration {
        version: 2,
        name: "0002_engine.sql",
        template: include_str!("../../../migrations/0002_engine.sql"),
    },
    Migration {
        version: 3,
        name: "0003_drop_unused.sql",
        template: include_str!("../../../migrations/0003_drop_unused.sql"),
    },
    Migration {
        version: 4,
        name: "0004_shared_definitions.sql",
        template: include_str!("../../../migrations/0004_shared_definitions.sql"),
    },
    Migration {
        version: 5,
        name: "0005_stream_ownership.sql",
        template: include_str!("../../../migrations/0005_stream_ownership.sql"),
    },
    Migration {
        version: 6,
        name: "0006_perspective_jobs.sql",
        template: include_str!("../../../migrations/0006_perspective_jobs.sql"),
    },
    Migration {
        version: 7,
        name: "0007_dead_letter_clears_failure.sql",
        template: include_str!("../../../migrations/0007_dead_letter_clears_failure.sql"),
    },
    Migration {
        version: 9,
        name: "0009_append_only_and_lifecycle_truth.sql",
        template: include_str!("../../../migrations/0009_append_only_and_lifecycle_truth.sql"),
    },
    Migration {
        version: 10,
        name: "0010_claim_at_breadth.sql",
        template: include_str!("../../../migrations/0010_claim_at_breadth.sql"),
    },
    Migration {
        version: 12,
        name: "0012_retire_without_reading_the_backlog.sql",
        template: include_str!("../../../migrations/0012_retire_without_reading_the_backlog.sql"),
    },
    Migration {
        version: 13,
        name: "0013_claim_past_offered.sql",
        template: include_str!("../../../migrations/0013_claim_past_offered.sql"),
    },
    Migration {
        version: 14,
        name: "0014_cursor_lookup_per_pair.sql",
        template: include_str!("../../../migrations/0014_cursor_lookup_per_pair.sql"),
    },
    Migration {
        version: 15,
        name: "0015_claim_skips_the_idle_look_while_taking_a_backlog.sql",
        template: include_str!(
            "../../../migrations/0015_claim_skips_the_idle_look_while_taking_a_backlog.sql"
        ),
    },
    Migration {
        version: 16,
        name: "0016_completion_skips_rows_another_transaction_holds.sql",
        template: include_str!(
            "../../../migrations/0016_completion_skips_rows_another_transaction_holds.sql"
        ),
    },
    Migration {
        version: 17,
        name: "0017_retire_without_jit.sql",
        template: include_str!("../../../migrations/0017_retire_without_jit.sql"),
    },
    Migration {
        version: 18,
        name: "0018_engine_functions_installed_by_migrate.sql",
        template: include_str!(
            "../../../migrations/0018_engine_functions_installed_by_migrate.sql"
        ),
    },
    Migration {
        version: 19,
        name: "0019_retention_guard_checks_each_row.sql",
        template: include_str!("../../../migrations/0019_retention_guard_checks_each_row.sql"),
    },
    Migration {
        version: 20,
        name: "0020_blue_green_versions.sql",
        template: include_str!("../../../migrations/0020_blue_green_versions.sql"),
    },
    Migration {
        version: 21,
        name: "0021_stopping_instances.sql",
        template: include_str!("../../../migrations/0021_stopping_instances.sql"),
    },
    Migration {
        version: 22,
        name: "0022_instances_awake.sql",
        template: include_str!("../../../migrations/0022_instances_awake.sql"),
    },
];

/// The last migration that defined functions; later ones must not (see the module docs).
pub const LAST_MIGRATION_WITH_FUNCTIONS: i32 = 17;

/// The placeholder replaced by the schema name (also in the function files).
pub(crate) const PLACEHOLDER: &str = "{{schema}}";

impl Migration {
    /// SHA-256 of the template, hex. Independent of the schema it is rendered for.
    pub fn checksum(&self) -> String {
        hex::encode(Sha256::digest(self.template.as_bytes()))
    }

    /// The SQL for `schema`. The schema name must already be a validated identifier
    /// (`[a-z_][a-z0-9_]*`), so it needs no quoting.
    pub fn render(&self, schema: &str) -> String {
        self.template.replace(PLACEHOLDER, schema)
    }
}

/// Highest version this binary knows.
pub fn latest_version() -> i32 {
    MIGRATIONS.last().map(|m| m.version).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_increasing_and_names_match() {
        let mut last = 0;
        for m in MIGRATIONS {
            assert!(m.version > last, "{} out of order", m.name);
            assert!(
                m.name.starts_with(&format!("{:04}_", m.version)),
                "{} does not start with its version",
                m.name
            );
            last = m.version;
        }
    }

    #[test]
    fn render_replaces_every_placeholder() {
        for m in MIGRATIONS {
            let sql = m.render("shop");
            assert!(!sql.contains("{{"), "{} keeps a placeholder", m.name);
            assert!(sql.contains("shop."), "{} names no schema object", m.name);
        }
    }

    /// A function defined by a migration would be overwritten by its file at the end of the same
    /// `migrate`, or, without a file, be a second home for engine code.
    #[test]
    fn no_migration_after_0017_defines_a_function() {
        let defines = |sql: &str| {
            let words: Vec<String> = sql
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter(|w| !w.is_empty())
                .map(str::to_ascii_uppercase)
                .collect();
            let routine = |w: Option<&String>| {
                matches!(w.map(String::as_str), Some("FUNCTION" | "PROCEDURE"))
            };
            (0..words.len()).any(|i| {
                words[i] == "CREATE"
                    && (routine(words.get(i + 1))
                        || (words.get(i + 1).is_some_and(|w| w == "OR")
                            && words.get(i + 2).is_some_and(|w| w == "REPLACE")
                            && routine(words.get(i + 3))))
            })
        };
        assert!(defines("create  or\nreplace FUNCTION x()"));
        assert!(defines("Create Procedure x()"));
        assert!(defines(MIGRATIONS[0].template));
        assert!(!defines("CREATE TABLE function (procedure text)"));
        for m in MIGRATIONS
            .iter()
            .filter(|m| m.version > LAST_MIGRATION_WITH_FUNCTIONS)
        {
            assert!(
                !defines(m.template),
                "{} defines a function: put it in worker/src/store/functions/ instead",
                m.name
            );
        }
    }

    #[test]
    fn checksum_is_stable_hex() {
        let m = &MIGRATIONS[0];
        assert_eq!(m.checksum(), m.checksum());
        assert_eq!(m.checksum().len(), 64);
    }
}
