//! Blue/green versions (DESIGN §12.6): the names a version of a perspective goes by while it is
//! not the live one, and the perspectives a deployment really runs while a version is built.
//!
//! The live version of perspective `p` is the perspective `p` (its tables in the deployment
//! schema). Another version N — being built, or kept for a rollback — is the perspective
//! `p__vN` in cursors, work rows, subscriptions, jobs and dead letters, with its tables in its
//! own schema `<schema>_p_vN` (its *home*). The switch swaps the names and moves the tables.

use sha2::{Digest, Sha256};

use super::{Config, PerspectiveConfig};

/// The internal perspective name of version `version` of `perspective` while it is not live.
pub fn internal_name(perspective: &str, version: u32) -> String {
    format!("{perspective}__v{version}")
}

/// Whether `name` has the shape of an internal name (`<name>__v<digits>`): refused as a
/// perspective's own name, so that no perspective can collide with a version of another.
pub fn looks_internal(name: &str) -> bool {
    match name.rfind("__v") {
        Some(at) => {
            let digits = &name[at + 3..];
            !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())
        }
        None => false,
    }
}

/// The schema that holds the tables of version `version` of `perspective` while it is not live:
/// `<schema>_<perspective>_v<version>`, or, past PostgreSQL's 63 bytes, the perspective name
/// shortened and followed by a hash of it.
pub fn home_schema(schema: &str, perspective: &str, version: u32) -> String {
    let name = format!("{schema}_{perspective}_v{version}");
    if name.len() <= 63 {
        return name;
    }
    let hash = hex::encode(&Sha256::digest(perspective.as_bytes())[..4]);
    let suffix = format!("_{hash}_v{version}");
    let room = 63usize.saturating_sub(schema.len() + 1 + suffix.len());
    format!(
        "{schema}_{}{suffix}",
        &perspective[..room.min(perspective.len())]
    )
}

/// A version being built (or caught up for a rollback) beside the live one.
#[derive(Debug, Clone, PartialEq)]
pub struct Building {
    /// The perspective's (user's) name.
    pub perspective: String,
    pub version: u32,
    /// The live version's definition, as `migrate` recorded it.
    pub live: PerspectiveConfig,
}

/// One perspective the deployment runs: a configured one, the live version of one whose next
/// version is being built, or that next version under its internal name.
#[derive(Debug, Clone, PartialEq)]
pub struct Running {
    pub perspective: PerspectiveConfig,
    /// Where its tables are, when not in the deployment schema (a version being built).
    pub home: Option<String>,
    /// The configured perspective this one belongs to.
    pub configured: String,
}

/// The perspectives the deployment runs: the configured ones, except that a perspective whose
/// configured version is being built runs as two, its live version (the recorded definition,
/// under its own name) and the configured one (under its internal name, in its home schema).
pub fn running(config: &Config, building: &[Building]) -> Vec<Running> {
    let mut out = Vec::new();
    for p in &config.perspectives {
        let Some(b) = building
            .iter()
            .find(|b| b.perspective == p.name && b.version == p.version)
        else {
            out.push(Running {
                perspective: p.clone(),
                home: None,
                configured: p.name.clone(),
            });
            continue;
        };
        let mut live = b.live.clone();
        live.name = p.name.clone();
        out.push(Running {
            perspective: live,
            home: None,
            configured: p.name.clone(),
        });
        let mut next = p.clone();
        next.name = internal_name(&p.name, p.version);
        out.push(Running {
            perspective: next,
            home: Some(home_schema(&config.schema, &p.name, p.version)),
            configured: p.name.clone(),
        });
    }
    out
}

/// `config` with its perspectives replaced by those it runs (see [`running`]).
pub fn running_config(config: &Config, running: &[Running]) -> Config {
    Config {
        perspectives: running.iter().map(|r| r.perspective.clone()).collect(),
        ..config.clone()
    }
}

/// A recorded definition (the JSON `migrate` stores for each compiled perspective).
pub fn parse_definition(json: &str) -> Result<PerspectiveConfig, serde_json::Error> {
    serde_json::from_str(json)
}

/// `perspective`'s definition as `migrate` records it (handlers in file order).
pub fn definition_json(perspective: &PerspectiveConfig) -> String {
    serde_json::to_string(perspective).expect("a perspective serializes")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn internal_names_are_recognised_and_homes_fit_identifiers() {
        assert_eq!(internal_name("order_summary", 3), "order_summary__v3");
        assert!(looks_internal("order_summary__v3"));
        assert!(!looks_internal("order_summary__v"));
        assert!(!looks_internal("order_summary_v3"));
        assert!(!looks_internal("a__vx1"));
        assert_eq!(home_schema("shop", "orders", 2), "shop_orders_v2");
        let long = home_schema(&"s".repeat(40), &"p".repeat(63), 12345);
        assert!(long.len() <= 63, "{long}");
        assert!(long.ends_with("_v12345"), "{long}");
        assert_ne!(
            home_schema(&"s".repeat(40), &format!("{}a", "p".repeat(62)), 1),
            home_schema(&"s".repeat(40), &format!("{}b", "p".repeat(62)), 1)
        );
    }

    #[test]
    fn a_recorded_definition_keeps_its_handler_order_and_a_build_runs_two_perspectives() {
        let config = Config::from_yaml_str(
            "schema: s\nperspectives:\n  - name: p\n    version: 2\n    rebuild: blueGreen\n    handlers:\n      Z: SELECT 1\n      A: SELECT 2\n",
            "t.yaml",
        )
        .unwrap();
        let p = &config.perspectives[0];
        let back = parse_definition(&definition_json(p)).unwrap();
        assert_eq!(&back, p);
        assert_eq!(back.event_types().collect::<Vec<_>>(), ["Z", "A"]);
        let mut live = p.clone();
        live.version = 1;
        let building = [Building {
            perspective: "p".into(),
            version: 2,
            live: live.clone(),
        }];
        let running = running(&config, &building);
        let names: Vec<_> = running
            .iter()
            .map(|r| r.perspective.name.as_str())
            .collect();
        assert_eq!(names, ["p", "p__v2"]);
        assert_eq!(running[0].perspective.version, 1);
        assert_eq!(running[1].home.as_deref(), Some("s_p_v2"));
        assert!(running_config(&config, &running)
            .perspective("p__v2")
            .is_some());
        // Not building that version: the config as it is.
        assert_eq!(super::running(&config, &[]).len(), 1);
    }
}
