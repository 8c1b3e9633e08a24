//! What a deployment's names may be: the schema, perspective names and event types.
//!
//! The generated SQL uses the schema and perspective names unquoted, and NOTIFY channel names
//! are built from the schema, so both are lower-case PostgreSQL identifiers with room to spare;
//! event types are the keys of the handler maps. The patterns here also go into the JSON schema
//! (the CRD), the checks into validation.

/// Longest allowed schema name. NOTIFY channels are named `<schema>_work`, `<schema>_applied`
/// and so on, and PostgreSQL truncates identifiers beyond 63 bytes, so the schema leaves room.
pub const MAX_SCHEMA_LEN: usize = 40;
/// Longest allowed perspective name (PostgreSQL's identifier limit).
pub const MAX_PERSPECTIVE_NAME_LEN: usize = 63;
/// Longest allowed event type.
pub const MAX_EVENT_TYPE_LEN: usize = 200;

/// A schema name in the JSON schema (the CRD's `spec.schema` and the operator's own field).
pub const SCHEMA_PATTERN: &str = "^[a-z_][a-z0-9_]{0,39}$";
/// A perspective name in the JSON schema.
pub(super) const PERSPECTIVE_NAME_PATTERN: &str = "^[a-z_][a-z0-9_]{0,62}$";
/// Schemas a deployment may not use: PostgreSQL's own and the shared default.
const RESERVED_SCHEMAS: [&str; 3] = ["public", "pg_catalog", "information_schema"];
/// PostgreSQL's reserved keywords (`pg_get_keywords()` categories R and T, PostgreSQL 15–18):
/// not usable as a schema name unless quoted, and the generated SQL does not quote it.
const RESERVED_KEYWORDS: &[&str] = &[
    "all",
    "analyse",
    "analyze",
    "and",
    "any",
    "array",
    "as",
    "asc",
    "asymmetric",
    "authorization",
    "binary",
    "both",
    "case",
    "cast",
    "check",
    "collate",
    "collation",
    "column",
    "concurrently",
    "constraint",
    "create",
    "cross",
    "current_catalog",
    "current_date",
    "current_role",
    "current_schema",
    "current_time",
    "current_timestamp",
    "current_user",
    "default",
    "deferrable",
    "desc",
    "distinct",
    "do",
    "else",
    "end",
    "except",
    "false",
    "fetch",
    "for",
    "foreign",
    "freeze",
    "from",
    "full",
    "grant",
    "group",
    "having",
    "ilike",
    "in",
    "initially",
    "inner",
    "intersect",
    "into",
    "is",
    "isnull",
    "join",
    "lateral",
    "leading",
    "left",
    "like",
    "limit",
    "localtime",
    "localtimestamp",
    "natural",
    "not",
    "notnull",
    "null",
    "offset",
    "on",
    "only",
    "or",
    "order",
    "outer",
    "overlaps",
    "placing",
    "primary",
    "references",
    "returning",
    "right",
    "select",
    "session_user",
    "similar",
    "some",
    "symmetric",
    "system_user",
    "table",
    "tablesample",
    "then",
    "to",
    "trailing",
    "true",
    "union",
    "unique",
    "user",
    "using",
    "variadic",
    "verbose",
    "when",
    "where",
    "window",
    "with",
];

/// Checks an unquoted lower-case PostgreSQL identifier: `[a-z_][a-z0-9_]*`, at most `max_len`.
pub(super) fn check_identifier(name: &str, max_len: usize) -> Result<(), String> {
    let mut chars = name.chars();
    match chars.next() {
        None => return Err("must not be empty".to_owned()),
        Some(c) if !(c.is_ascii_lowercase() || c == '_') => {
            return Err("must start with a lower-case letter or underscore".to_owned())
        }
        Some(_) => {}
    }
    if let Some(c) = chars.find(|&c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')) {
        return Err(format!(
            "contains {c:?}; use lower-case letters, digits and underscores"
        ));
    }
    let len = name.len();
    if len > max_len {
        return Err(format!(
            "is {len} characters long; at most {max_len} are allowed"
        ));
    }
    Ok(())
}

/// Checks a schema name: an identifier of at most [`MAX_SCHEMA_LEN`] that is neither a reserved
/// keyword nor a reserved schema.
pub(super) fn check_schema_name(schema: &str) -> Result<(), String> {
    check_identifier(schema, MAX_SCHEMA_LEN).map_err(|message| {
        let message = format!("invalid schema name `{schema}`: {message}");
        if schema.len() > MAX_SCHEMA_LEN {
            // Say why the limit is lower than PostgreSQL's own.
            format!("{message} so that NOTIFY channel names such as `{schema}_work` stay valid")
        } else {
            message
        }
    })?;
    if RESERVED_KEYWORDS.contains(&schema) {
        return Err(format!(
            "invalid schema name `{schema}`: it is a reserved SQL keyword in PostgreSQL; \
             choose another name (e.g. `{schema}_events`)"
        ));
    }
    if RESERVED_SCHEMAS.contains(&schema) {
        return Err(format!(
            "schema `{schema}` is reserved; give each deployment a schema of its own"
        ));
    }
    if schema.starts_with("pg_") {
        return Err(format!(
            "invalid schema name `{schema}`: names starting with pg_ are reserved by PostgreSQL"
        ));
    }
    Ok(())
}

/// Checks an event type key: `[A-Za-z_][A-Za-z0-9_.:+-]*`, at most 200 characters.
pub(super) fn check_event_type(event_type: &str) -> Result<(), String> {
    let mut chars = event_type.chars();
    match chars.next() {
        None => return Err("the event type is empty".to_owned()),
        Some(c) if !(c.is_ascii_alphabetic() || c == '_') => {
            return Err(format!(
                "event type {event_type:?} must start with a letter or underscore"
            ))
        }
        Some(_) => {}
    }
    if let Some(c) = chars.find(|&c| !(c.is_ascii_alphanumeric() || "_.:+-".contains(c))) {
        return Err(format!(
            "event type {event_type:?} contains {c:?}; use letters, digits and _ . : + -"
        ));
    }
    let len = event_type.chars().count();
    if len > MAX_EVENT_TYPE_LEN {
        return Err(format!(
            "event type is {len} characters long; at most {MAX_EVENT_TYPE_LEN} are allowed"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_realistic_event_type_names() {
        for event_type in [
            "OrderPlaced",
            "shop.orders.v2:OrderPlaced",
            "Outer+Inner",
            "order-placed",
            "_x",
        ] {
            assert_eq!(check_event_type(event_type), Ok(()), "{event_type}");
        }
        assert!(check_event_type(&"E".repeat(201)).is_err());
        assert_eq!(check_event_type(&"E".repeat(200)), Ok(()));
    }
}
