//! The versioned SQL of `migrations/`, embedded into the binary and rendered for one schema.

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
];

/// The placeholder replaced by the schema name.
const PLACEHOLDER: &str = "{{schema}}";

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

    #[test]
    fn checksum_is_stable_hex() {
        let m = &MIGRATIONS[0];
        assert_eq!(m.checksum(), m.checksum());
        assert_eq!(m.checksum().len(), 64);
    }
}
