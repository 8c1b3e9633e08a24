//! Limits on a config's YAML, checked before serde_yaml reads it, so that a small hostile file
//! cannot take gigabytes or minutes:
//!
//! - at most [`MAX_CONFIG_BYTES`] (what a ConfigMap holds, where the operator puts the config);
//! - no anchors or aliases: serde_yaml expands an alias every time it is used (a 1 MB file of
//!   aliases of aliases reached 2.95 GB), and a config has nothing to repeat that is worth it;
//! - at most [`MAX_NESTING`] levels of nesting. Unclosed `[` and `{` are counted over the raw
//!   text first: libyaml's scanner looks ahead over every unclosed flow collection, quadratic in
//!   their number (100 000 of them ran past 60 s), before it yields a single event.
//!
//! Anchors, aliases and block nesting are found by libyaml itself — the parser serde_yaml
//! uses — so this check and the deserializer cannot disagree about what the text holds. Syntax
//! errors are left to serde_yaml, which reports them with the field path.

use std::mem::MaybeUninit;

/// The largest config read: 1 MiB, what a ConfigMap holds.
pub const MAX_CONFIG_BYTES: usize = 1024 * 1024;

/// The deepest nesting of mappings and sequences (a config needs 4).
pub const MAX_NESTING: usize = 64;

/// Why `text` is refused, with the line and column where it is; `None` when within the limits.
pub fn refusal(text: &str) -> Option<String> {
    if text.len() > MAX_CONFIG_BYTES {
        return Some(too_large(text.len() as u64));
    }
    unclosed_brackets(text).or_else(|| parsed_refusal(text))
}

/// The refusal of a config file of `bytes` bytes.
pub fn too_large(bytes: u64) -> String {
    format!("the config is {bytes} bytes; at most {MAX_CONFIG_BYTES} (1 MiB) are read")
}

/// More than [`MAX_NESTING`] unclosed `[` or `{` anywhere in the text (inside strings and
/// comments too, where brackets come in pairs in practice).
fn unclosed_brackets(text: &str) -> Option<String> {
    let mut depth = 0usize;
    for (i, line) in text.lines().enumerate() {
        for (j, c) in line.chars().enumerate() {
            match c {
                '[' | '{' => depth += 1,
                ']' | '}' => depth = depth.saturating_sub(1),
                _ => continue,
            }
            if depth > MAX_NESTING {
                return Some(format!(
                    "more than {MAX_NESTING} unclosed `[` or `{{` at line {}, column {}",
                    i + 1,
                    j + 1
                ));
            }
        }
    }
    None
}

/// The first anchor, alias or nesting level past [`MAX_NESTING`] that libyaml reports.
fn parsed_refusal(text: &str) -> Option<String> {
    let mut parser = Box::new(MaybeUninit::<unsafe_libyaml::yaml_parser_t>::uninit());
    let parser = parser.as_mut_ptr();
    // SAFETY: `parser` points at owned, writable memory for a `yaml_parser_t`, which
    // `yaml_parser_initialize` initialises; the input outlives the parser, deleted below.
    unsafe {
        if unsafe_libyaml::yaml_parser_initialize(parser).fail {
            // Out of memory: serde_yaml will fail the same way.
            return None;
        }
        unsafe_libyaml::yaml_parser_set_input_string(parser, text.as_ptr(), text.len() as _);
    }
    let found = first_refused_event(parser);
    // SAFETY: initialised above, not used after this.
    unsafe { unsafe_libyaml::yaml_parser_delete(parser) };
    found
}

fn first_refused_event(parser: *mut unsafe_libyaml::yaml_parser_t) -> Option<String> {
    let mut depth = 0usize;
    loop {
        let mut event = MaybeUninit::<unsafe_libyaml::yaml_event_t>::uninit();
        // SAFETY: `parser` is initialised with its input alive; `yaml_parser_parse` initialises
        // `event` when it succeeds, and only then is it read (the union field that matches its
        // type) and deleted, once.
        let (type_, anchored, mark) = unsafe {
            if unsafe_libyaml::yaml_parser_parse(parser, event.as_mut_ptr()).fail {
                // A syntax error: serde_yaml reports it, with the field path.
                return None;
            }
            let event = event.as_mut_ptr();
            let type_ = (*event).type_;
            let anchor = match type_ {
                unsafe_libyaml::YAML_SCALAR_EVENT => (*event).data.scalar.anchor,
                unsafe_libyaml::YAML_SEQUENCE_START_EVENT => (*event).data.sequence_start.anchor,
                unsafe_libyaml::YAML_MAPPING_START_EVENT => (*event).data.mapping_start.anchor,
                _ => std::ptr::null_mut(),
            };
            let mark = (*event).start_mark;
            unsafe_libyaml::yaml_event_delete(event);
            (type_, !anchor.is_null(), mark)
        };
        let at = format!("at line {}, column {}", mark.line + 1, mark.column + 1);
        if type_ == unsafe_libyaml::YAML_ALIAS_EVENT {
            return Some(format!(
                "YAML aliases (`*name`) are not accepted; write the value out {at}"
            ));
        }
        if anchored {
            return Some(format!(
                "YAML anchors (`&name`) are not accepted; write the value out {at}"
            ));
        }
        match type_ {
            unsafe_libyaml::YAML_SEQUENCE_START_EVENT
            | unsafe_libyaml::YAML_MAPPING_START_EVENT => {
                depth += 1;
                if depth > MAX_NESTING {
                    return Some(format!("nested more than {MAX_NESTING} levels deep {at}"));
                }
            }
            unsafe_libyaml::YAML_SEQUENCE_END_EVENT | unsafe_libyaml::YAML_MAPPING_END_EVENT => {
                depth -= 1
            }
            unsafe_libyaml::YAML_STREAM_END_EVENT => return None,
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    #[test]
    fn anchors_and_aliases_are_refused_where_they_are() {
        let aliased = "schema: shop\nbase: &b {x: 1}\nother: *b\n";
        assert_eq!(
            refusal(aliased).unwrap(),
            "YAML anchors (`&name`) are not accepted; write the value out at line 2, column 7"
        );
        assert_eq!(
            refusal("a: *b\n").unwrap(),
            "YAML aliases (`*name`) are not accepted; write the value out at line 1, column 4"
        );
        let scalar_anchor = "a: &x hello\n";
        assert!(refusal(scalar_anchor).unwrap().starts_with("YAML anchors"));
    }

    #[test]
    fn sql_with_ampersands_stars_and_brackets_is_not_an_anchor() {
        let text = "schema: shop\nperspectives:\n  - name: p\n    handlers:\n      A: |\n        \
                    SELECT * FROM t WHERE flags & 4 = 4 AND tags[1] = '{a}' AND x = ARRAY[[1]]\n      \
                    B: SELECT *, a & b FROM t\n      C: \"SELECT '&x' || '*y'\"\n";
        assert_eq!(refusal(text), None);
    }

    #[test]
    fn a_billion_laughs_is_refused_before_it_is_expanded() {
        let mut text = String::from("a0: &a0 [\"lol\"]\n");
        for i in 1..2000 {
            let prev = i - 1;
            text.push_str(&format!(
                "a{i}: &a{i} [*a{prev}, *a{prev}, *a{prev}, *a{prev}, *a{prev}]\n"
            ));
        }
        let started = Instant::now();
        assert!(refusal(&text).unwrap().starts_with("YAML anchors"));
        assert!(started.elapsed() < Duration::from_secs(1));
    }

    #[test]
    fn deep_nesting_is_refused_quickly() {
        let started = Instant::now();
        let flow = "[".repeat(100_000);
        assert_eq!(
            refusal(&flow).unwrap(),
            "more than 64 unclosed `[` or `{` at line 1, column 65"
        );
        let block = "- ".repeat(100_000) + "x\n";
        assert_eq!(
            refusal(&block).unwrap(),
            "nested more than 64 levels deep at line 1, column 129"
        );
        assert!(started.elapsed() < Duration::from_secs(5));
        // 64 levels are fine.
        let ok = format!("{}1{}", "[".repeat(64), "]".repeat(64));
        assert_eq!(refusal(&ok), None);
    }

    #[test]
    fn more_than_a_mebibyte_is_refused() {
        let text = format!("# {}\nschema: shop\n", "x".repeat(MAX_CONFIG_BYTES));
        assert_eq!(
            refusal(&text).unwrap(),
            format!(
                "the config is {} bytes; at most 1048576 (1 MiB) are read",
                text.len()
            )
        );
    }
}
