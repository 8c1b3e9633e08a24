//! Named parameters in handler SQL.
//!
//! Perspective handlers are written as plain SQL with named parameters such as `:stream_id`
//! or `:data`. This module lexes that SQL just far enough to split it into statements and find
//! the parameters: it understands PostgreSQL string literals, quoted identifiers, dollar
//! quotes, comments and `::` casts, so a `:name` or `;` inside any of those is left alone.
//! Parameters are always bound as real parameters (or PL/pgSQL variables), never spliced in
//! as text.
//!
//! It lives under `config` because validation lexes every handler, `reset` and `setup` with it
//! (so a config that loads has SQL that lexes); the apply functions' compiler and the code that
//! runs `reset` use the lexed statements.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

/// A value of the event being applied that handler SQL can refer to as `:name`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Param {
    StreamId,
    EventId,
    StreamVersion,
    EventType,
    Data,
    Metadata,
    Scope,
    CreatedAt,
    UserId,
    TenantId,
    /// The events of a batch handler's run, as a relation (see [`EVENTS_COLUMNS`]).
    Events,
}

/// The columns of `:events`, the relation a batch handler reads: one row per event of the run,
/// in the order they are applied (`ordinal` counts from 1; each stream's events in version
/// order). The names are those of the per-event parameters.
pub const EVENTS_COLUMNS: &str = "stream_id, event_id, stream_version, event_type, data, metadata, scope, created_at, user_id, tenant_id, ordinal";

/// What `:events` becomes where a statement is only checked, not run (`migrate` prepares
/// each handler): the relation's function over no events (`search_path` holds the schema).
pub const EVENTS_FOR_CHECKING: &str =
    "wh_run_events(NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)";

impl Param {
    /// Every parameter, in the order they are listed to users.
    pub const ALL: [Param; 11] = [
        Param::StreamId,
        Param::EventId,
        Param::StreamVersion,
        Param::EventType,
        Param::Data,
        Param::Metadata,
        Param::Scope,
        Param::CreatedAt,
        Param::UserId,
        Param::TenantId,
        Param::Events,
    ];

    /// The parameters that hold one event's values: every one but `:events`, the last.
    pub const PER_EVENT: &[Param] = Param::ALL.split_last().unwrap().1;

    /// The name written after the colon in handler SQL.
    pub fn name(&self) -> &'static str {
        match self {
            Param::StreamId => "stream_id",
            Param::EventId => "event_id",
            Param::StreamVersion => "stream_version",
            Param::EventType => "event_type",
            Param::Data => "data",
            Param::Metadata => "metadata",
            Param::Scope => "scope",
            Param::CreatedAt => "created_at",
            Param::UserId => "user_id",
            Param::TenantId => "tenant_id",
            Param::Events => "events",
        }
    }

    /// The PostgreSQL type the parameter is bound as. `:events` is a relation, never bound:
    /// it is spelled into the statement (see [`ParsedStatement::to_positional`]).
    pub fn pg_type(&self) -> &'static str {
        match self {
            Param::StreamId | Param::EventId => "uuid",
            Param::StreamVersion => "int8",
            Param::EventType | Param::UserId | Param::TenantId => "text",
            Param::Data | Param::Metadata | Param::Scope => "jsonb",
            Param::CreatedAt => "timestamptz",
            Param::Events => "record",
        }
    }

    /// Looks a parameter up by its name (without the colon); names are case-sensitive.
    pub fn from_name(name: &str) -> Option<Param> {
        Param::ALL.into_iter().find(|p| p.name() == name)
    }
}

impl fmt::Display for Param {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, ":{}", self.name())
    }
}

/// One piece of a statement: verbatim SQL text or a parameter reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Sql(String),
    Param(Param),
}

/// One SQL statement, split into text and parameter pieces. Comments are dropped and
/// surrounding whitespace trimmed, so the statement can be embedded anywhere safely.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedStatement {
    pub pieces: Vec<Piece>,
}

impl ParsedStatement {
    /// Renders the statement with `$1, $2, …` placeholders, numbered by first appearance.
    /// A parameter used twice keeps its number; the returned list gives the parameter
    /// bound to each placeholder, in placeholder order. `:events`, a relation, becomes
    /// [`EVENTS_FOR_CHECKING`] (no events), not a placeholder.
    pub fn to_positional(&self) -> (String, Vec<Param>) {
        let mut order: Vec<Param> = Vec::new();
        let mut numbers: BTreeMap<Param, usize> = BTreeMap::new();
        let mut sql = String::new();
        for piece in &self.pieces {
            match piece {
                Piece::Sql(text) => sql.push_str(text),
                Piece::Param(Param::Events) => sql.push_str(EVENTS_FOR_CHECKING),
                Piece::Param(param) => {
                    let n = *numbers.entry(*param).or_insert_with(|| {
                        order.push(*param);
                        order.len()
                    });
                    sql.push('$');
                    sql.push_str(&n.to_string());
                }
            }
        }
        (sql, order)
    }

    /// Renders the statement, replacing each parameter with whatever `f` returns for it
    /// (for example a PL/pgSQL variable name).
    pub fn render_with(&self, f: impl Fn(Param) -> String) -> String {
        let mut sql = String::new();
        for piece in &self.pieces {
            match piece {
                Piece::Sql(text) => sql.push_str(text),
                Piece::Param(param) => sql.push_str(&f(*param)),
            }
        }
        sql
    }

    /// The distinct parameters the statement uses.
    pub fn params(&self) -> BTreeSet<Param> {
        self.pieces
            .iter()
            .filter_map(|piece| match piece {
                Piece::Param(param) => Some(*param),
                Piece::Sql(_) => None,
            })
            .collect()
    }

    /// The statement's first keyword in lower case (`insert`, `update`, `commit`, …), if it
    /// starts with one.
    pub fn leading_keyword(&self) -> Option<String> {
        let Some(Piece::Sql(text)) = self.pieces.first() else {
            return None;
        };
        let word: String = text
            .chars()
            .take_while(|c| c.is_ascii_alphabetic())
            .collect();
        (!word.is_empty()).then_some(word.to_ascii_lowercase())
    }

    /// The statement's first `n` words in lower case (`["set", "role"]`), as far as its text
    /// before the first parameter goes.
    pub fn leading_words(&self, n: usize) -> Vec<String> {
        let Some(Piece::Sql(text)) = self.pieces.first() else {
            return Vec::new();
        };
        text.split(|c: char| !c.is_ascii_alphabetic() && c != '_')
            .filter(|w| !w.is_empty())
            .take(n)
            .map(str::to_ascii_lowercase)
            .collect()
    }

    fn push_sql(&mut self, text: &str) {
        match self.pieces.last_mut() {
            Some(Piece::Sql(last)) => last.push_str(text),
            _ => self.pieces.push(Piece::Sql(text.to_owned())),
        }
    }

    /// Trims surrounding whitespace; returns `None` when nothing is left.
    fn finish(mut self) -> Option<ParsedStatement> {
        if let Some(Piece::Sql(first)) = self.pieces.first_mut() {
            *first = first.trim_start().to_owned();
        }
        if let Some(Piece::Sql(last)) = self.pieces.last_mut() {
            *last = last.trim_end().to_owned();
        }
        self.pieces
            .retain(|piece| !matches!(piece, Piece::Sql(text) if text.is_empty()));
        (!self.pieces.is_empty()).then_some(self)
    }
}

/// Where a parameter occurs in the SQL text (1-based line and column, in characters).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamUse {
    pub param: Param,
    pub line: usize,
    pub column: usize,
}

/// A lexical construct that can be left open by mistake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unterminated {
    QuotedString,
    EscapeString,
    QuotedIdentifier,
    DollarQuotedString,
    BlockComment,
}

impl fmt::Display for Unterminated {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Unterminated::QuotedString => "quoted string",
            Unterminated::EscapeString => "escape string (E'...')",
            Unterminated::QuotedIdentifier => "quoted identifier",
            Unterminated::DollarQuotedString => "dollar-quoted string",
            Unterminated::BlockComment => "block comment",
        })
    }
}

/// Why handler SQL could not be lexed. Lines and columns are 1-based, counted in
/// characters within the SQL text itself.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SqlParamError {
    #[error("unknown parameter :{name} at line {line}, column {column} (known: {known})", known = known_params())]
    UnknownParameter {
        name: String,
        line: usize,
        column: usize,
    },
    #[error("positional parameter {text} at line {line}, column {column}: use named parameters such as :stream_id")]
    PositionalParameter {
        text: String,
        line: usize,
        column: usize,
    },
    #[error("unterminated {what} starting at line {line}, column {column}")]
    Unterminated {
        what: Unterminated,
        line: usize,
        column: usize,
    },
}

fn known_params() -> String {
    Param::ALL
        .iter()
        .map(Param::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Splits `sql` into statements on top-level `;` and finds the `:name` parameters in each.
/// Statements that hold only whitespace or comments are dropped.
pub fn parse_statements(sql: &str) -> Result<Vec<ParsedStatement>, SqlParamError> {
    let mut statements = Vec::new();
    let mut current = ParsedStatement { pieces: Vec::new() };
    scan(sql, |token| match token {
        Token::Text(text) => current.push_sql(text),
        Token::Param(param, _) => current.pieces.push(Piece::Param(param)),
        Token::EndOfStatement => {
            let done = std::mem::replace(&mut current, ParsedStatement { pieces: Vec::new() });
            statements.extend(done.finish());
        }
    })?;
    statements.extend(current.finish());
    Ok(statements)
}

/// Every parameter occurrence in `sql`, with its position; used to point at parameters in
/// SQL that must not have any.
pub fn parameter_uses(sql: &str) -> Result<Vec<ParamUse>, SqlParamError> {
    let mut uses = Vec::new();
    scan(sql, |token| {
        if let Token::Param(param, offset) = token {
            let (line, column) = position(sql, offset);
            uses.push(ParamUse {
                param,
                line,
                column,
            });
        }
    })?;
    Ok(uses)
}

enum Token<'a> {
    /// SQL text to keep verbatim (literals included).
    Text(&'a str),
    /// A parameter and the byte offset of its colon.
    Param(Param, usize),
    /// A top-level `;`.
    EndOfStatement,
}

/// 1-based line and column (in characters) of a byte offset.
fn position(sql: &str, offset: usize) -> (usize, usize) {
    let before = &sql[..offset];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    (line, before[line_start..].chars().count() + 1)
}

// PostgreSQL identifiers may contain non-ASCII letters; treating every byte >= 0x80 as an
// identifier byte keeps multi-byte characters in one piece.
fn is_ident_start(b: u8) -> bool {
    b.is_ascii_alphabetic() || b == b'_' || b >= 0x80
}

fn is_ident_continue(b: u8) -> bool {
    is_ident_start(b) || b.is_ascii_digit()
}

fn is_param_continue(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// Walks `sql` once and reports text, parameters and statement ends to `emit`.
///
/// Every syntax character is ASCII, so scanning bytes is safe: a byte of a multi-byte
/// UTF-8 character never equals one of them, and every slice boundary falls on ASCII.
fn scan<'a>(sql: &'a str, mut emit: impl FnMut(Token<'a>)) -> Result<(), SqlParamError> {
    let b = sql.as_bytes();
    // Start of the plain text not yet emitted.
    let mut text_start = 0;
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'\'' => {
                i = skip_quoted(b, i, b'\'', false)
                    .ok_or_else(|| unterminated(sql, Unterminated::QuotedString, i))?;
            }
            b'"' => {
                i = skip_quoted(b, i, b'"', false)
                    .ok_or_else(|| unterminated(sql, Unterminated::QuotedIdentifier, i))?;
            }
            b'-' if b.get(i + 1) == Some(&b'-') => {
                emit(Token::Text(&sql[text_start..i]));
                // The newline stays in the text so the tokens around the comment stay apart.
                i = b[i..]
                    .iter()
                    .position(|&c| c == b'\n')
                    .map_or(b.len(), |n| i + n);
                text_start = i;
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                emit(Token::Text(&sql[text_start..i]));
                i = skip_block_comment(b, i)
                    .ok_or_else(|| unterminated(sql, Unterminated::BlockComment, i))?;
                emit(Token::Text(" "));
                text_start = i;
            }
            b'$' => i = skip_dollar(sql, i)?,
            b':' => match b.get(i + 1) {
                // `::type` casts and PL/pgSQL-style `:=` are not parameters.
                Some(b':' | b'=') => i += 2,
                Some(&c) if c.is_ascii_alphabetic() || c == b'_' => {
                    let (param, end) = named_param(sql, i)?;
                    emit(Token::Text(&sql[text_start..i]));
                    emit(Token::Param(param, i));
                    i = end;
                    text_start = i;
                }
                _ => i += 1,
            },
            b';' => {
                emit(Token::Text(&sql[text_start..i]));
                emit(Token::EndOfStatement);
                i += 1;
                text_start = i;
            }
            c if is_ident_start(c) => i = skip_word(sql, i)?,
            _ => i += 1,
        }
    }
    emit(Token::Text(&sql[text_start..]));
    Ok(())
}

/// The error for a construct opened at `start` that never closes.
fn unterminated(sql: &str, what: Unterminated, start: usize) -> SqlParamError {
    let (line, column) = position(sql, start);
    SqlParamError::Unterminated { what, line, column }
}

/// Skips what a `$` at `start` opens (a dollar-quoted string, or nothing); returns the offset
/// after it. A `$1` placeholder is an error: handler SQL names its parameters.
fn skip_dollar(sql: &str, start: usize) -> Result<usize, SqlParamError> {
    match scan_dollar(sql, start) {
        Dollar::Skip(end) => Ok(end),
        Dollar::Unterminated => Err(unterminated(sql, Unterminated::DollarQuotedString, start)),
        Dollar::Positional(end) => {
            let (line, column) = position(sql, start);
            Err(SqlParamError::PositionalParameter {
                text: sql[start..end].to_owned(),
                line,
                column,
            })
        }
    }
}

/// The parameter named by the `:name` at `start` and the offset after its name.
fn named_param(sql: &str, start: usize) -> Result<(Param, usize), SqlParamError> {
    let len = sql.as_bytes()[start + 1..]
        .iter()
        .take_while(|&&c| is_param_continue(c))
        .count();
    let name = &sql[start + 1..start + 1 + len];
    let param = Param::from_name(name).ok_or_else(|| {
        let (line, column) = position(sql, start);
        SqlParamError::UnknownParameter {
            name: name.to_owned(),
            line,
            column,
        }
    })?;
    Ok((param, start + 1 + len))
}

/// Skips the word (identifier or keyword) at `start`, and the escape string it opens when it
/// is a lone `E` before a quote; returns the offset after it.
///
/// Whole words are consumed so that a `$` inside an identifier (legal in PostgreSQL) never
/// opens a dollar quote, and `E'` is only a prefix when the E stands alone.
fn skip_word(sql: &str, start: usize) -> Result<usize, SqlParamError> {
    let b = sql.as_bytes();
    let len = b[start..]
        .iter()
        .take_while(|&&c| is_ident_continue(c) || c == b'$')
        .count();
    let word_end = start + len;
    if len == 1 && matches!(b[start], b'E' | b'e') && b.get(word_end) == Some(&b'\'') {
        skip_quoted(b, word_end, b'\'', true)
            .ok_or_else(|| unterminated(sql, Unterminated::EscapeString, start))
    } else {
        Ok(word_end)
    }
}

/// Skips a literal opened by `quote` at `start`; a doubled quote is an escaped quote, and in
/// escape strings a backslash escapes the next byte. Returns the offset after the closing
/// quote, or `None` when the literal never closes.
fn skip_quoted(b: &[u8], start: usize, quote: u8, backslash_escapes: bool) -> Option<usize> {
    let mut i = start + 1;
    while i < b.len() {
        match b[i] {
            b'\\' if backslash_escapes => i += 2,
            c if c == quote => {
                if b.get(i + 1) == Some(&quote) {
                    i += 2;
                } else {
                    return Some(i + 1);
                }
            }
            _ => i += 1,
        }
    }
    None
}

/// Skips a `/* … */` comment starting at `start`; PostgreSQL block comments nest.
fn skip_block_comment(b: &[u8], start: usize) -> Option<usize> {
    let mut depth = 0usize;
    let mut i = start;
    while i + 1 < b.len() {
        match (b[i], b[i + 1]) {
            (b'/', b'*') => {
                depth += 1;
                i += 2;
            }
            (b'*', b'/') => {
                depth -= 1;
                i += 2;
                if depth == 0 {
                    return Some(i);
                }
            }
            _ => i += 1,
        }
    }
    None
}

/// What a `$` starts.
enum Dollar {
    /// A dollar-quoted string or a lone `$`; scanning resumes at the offset.
    Skip(usize),
    /// A positional placeholder such as `$1`, ending at the offset.
    Positional(usize),
    /// A dollar quote that never closes.
    Unterminated,
}

/// Classifies the `$` at `start`: a dollar-quoted string (`$$…$$`, `$tag$…$tag$`), a
/// positional `$n`, or plain text.
fn scan_dollar(sql: &str, start: usize) -> Dollar {
    let b = sql.as_bytes();
    match b.get(start + 1) {
        Some(c) if c.is_ascii_digit() => {
            let digits = b[start + 1..]
                .iter()
                .take_while(|c| c.is_ascii_digit())
                .count();
            Dollar::Positional(start + 1 + digits)
        }
        Some(&c) if c == b'$' || is_ident_start(c) => {
            // A tag follows identifier rules but cannot itself contain `$`.
            let tag_len = b[start + 1..]
                .iter()
                .take_while(|&&c| is_ident_continue(c))
                .count();
            let open_end = start + 1 + tag_len;
            if b.get(open_end) != Some(&b'$') {
                // Something like `$abc` without a closing `$`: not a quote, just text.
                return Dollar::Skip(start + 1);
            }
            let delimiter = &sql[start..=open_end];
            match sql[open_end + 1..].find(delimiter) {
                Some(n) => Dollar::Skip(open_end + 1 + n + delimiter.len()),
                None => Dollar::Unterminated,
            }
        }
        _ => Dollar::Skip(start + 1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(sql: &str) -> ParsedStatement {
        let mut statements = parse_statements(sql).expect("parses");
        assert_eq!(
            statements.len(),
            1,
            "expected one statement in {sql:?}: {statements:?}"
        );
        statements.remove(0)
    }

    fn positional(sql: &str) -> (String, Vec<Param>) {
        one(sql).to_positional()
    }

    fn err(sql: &str) -> String {
        parse_statements(sql).expect_err("should fail").to_string()
    }

    #[test]
    fn param_names_types_and_lookup_round_trip() {
        for param in Param::ALL {
            assert_eq!(Param::from_name(param.name()), Some(param));
        }
        assert_eq!(Param::from_name("Data"), None);
        assert_eq!(Param::StreamVersion.pg_type(), "int8");
        assert_eq!(Param::Scope.pg_type(), "jsonb");
        assert_eq!(Param::CreatedAt.pg_type(), "timestamptz");
        assert_eq!(Param::TenantId.to_string(), ":tenant_id");
    }

    #[test]
    fn numbers_params_by_first_appearance_and_reuses_numbers() {
        let (sql, params) = positional(
            "UPDATE t SET a = :data, b = :stream_id, c = :data WHERE id = :stream_id AND v = :event_id",
        );
        assert_eq!(
            sql,
            "UPDATE t SET a = $1, b = $2, c = $1 WHERE id = $2 AND v = $3"
        );
        assert_eq!(params, vec![Param::Data, Param::StreamId, Param::EventId]);
    }

    #[test]
    fn param_followed_by_cast_is_a_param() {
        let (sql, params) = positional("SELECT :data::jsonb, (:data->>'total')::numeric");
        assert_eq!(sql, "SELECT $1::jsonb, ($1->>'total')::numeric");
        assert_eq!(params, vec![Param::Data]);
    }

    #[test]
    fn casts_and_assignments_are_not_params() {
        let statement = one("SELECT x::text, y :: int, z := 1");
        assert!(statement.params().is_empty());
        assert_eq!(
            statement.to_positional().0,
            "SELECT x::text, y :: int, z := 1"
        );
    }

    #[test]
    fn params_inside_string_literals_are_ignored() {
        let statement = one("SELECT ':stream_id', 'it''s :data', :user_id");
        assert_eq!(statement.params(), BTreeSet::from([Param::UserId]));
        assert_eq!(
            statement.to_positional().0,
            "SELECT ':stream_id', 'it''s :data', $1"
        );
    }

    #[test]
    fn escape_strings_honour_backslashes() {
        let (sql, params) = positional(r"SELECT E'a\'; :data', e'\\', :scope");
        assert_eq!(sql, r"SELECT E'a\'; :data', e'\\', $1");
        assert_eq!(params, vec![Param::Scope]);
    }

    #[test]
    fn backslash_is_literal_in_standard_strings() {
        // With standard_conforming_strings the string ends at the second quote.
        let (sql, params) = positional(r"SELECT 'a\', :data");
        assert_eq!(sql, r"SELECT 'a\', $1");
        assert_eq!(params, vec![Param::Data]);
    }

    #[test]
    fn a_trailing_e_on_an_identifier_is_not_an_escape_prefix() {
        // `name` ends in e, but `name'` is not an escape string opener.
        let statement = one(r"SELECT name'\', :data");
        assert_eq!(statement.params(), BTreeSet::from([Param::Data]));
    }

    #[test]
    fn quoted_identifiers_hide_colons_and_semicolons() {
        let (sql, params) = positional(r#"SELECT "odd "":data; col" FROM t WHERE id = :stream_id"#);
        assert_eq!(sql, r#"SELECT "odd "":data; col" FROM t WHERE id = $1"#);
        assert_eq!(params, vec![Param::StreamId]);
    }

    #[test]
    fn dollar_quotes_hide_params_and_semicolons() {
        let sql =
            "DO $$ BEGIN PERFORM :data; END $$; SELECT $fn$ :scope; $$ nested $fn$, :event_id";
        let statements = parse_statements(sql).unwrap();
        assert_eq!(statements.len(), 2);
        assert!(statements[0].params().is_empty());
        assert_eq!(
            statements[0].to_positional().0,
            "DO $$ BEGIN PERFORM :data; END $$"
        );
        assert_eq!(
            statements[1].to_positional().0,
            "SELECT $fn$ :scope; $$ nested $fn$, $1"
        );
    }

    #[test]
    fn dollar_inside_identifier_does_not_open_a_quote() {
        let statement = one("SELECT col$1, a$b$ FROM t WHERE id = :stream_id");
        assert_eq!(statement.params(), BTreeSet::from([Param::StreamId]));
    }

    #[test]
    fn comments_hide_params_and_are_dropped() {
        let statement = one(
            "-- uses :nothing; really\nUPDATE t /* :data; /* nested :x */ still */ SET a = :data -- end :y",
        );
        assert_eq!(
            statement.to_positional(),
            ("UPDATE t   SET a = $1".to_owned(), vec![Param::Data])
        );
    }

    #[test]
    fn block_comment_keeps_tokens_apart() {
        assert_eq!(one("SELECT/**/1").to_positional().0, "SELECT 1");
    }

    #[test]
    fn splits_on_top_level_semicolons_only() {
        let statements = parse_statements(
            "INSERT INTO a VALUES (':x;y'); UPDATE b SET c = 1 WHERE id = :stream_id;\n",
        )
        .unwrap();
        assert_eq!(statements.len(), 2);
        assert_eq!(
            statements[0].to_positional().0,
            "INSERT INTO a VALUES (':x;y')"
        );
        assert_eq!(
            statements[1].to_positional().0,
            "UPDATE b SET c = 1 WHERE id = $1"
        );
    }

    #[test]
    fn empty_and_comment_only_statements_are_dropped() {
        let statements =
            parse_statements(";; \n -- only a comment\n; /* another */ ;SELECT 1;  ").unwrap();
        assert_eq!(statements.len(), 1);
        assert_eq!(statements[0].to_positional().0, "SELECT 1");
        assert!(parse_statements("  -- nothing\n/* here */")
            .unwrap()
            .is_empty());
        assert!(parse_statements("").unwrap().is_empty());
    }

    #[test]
    fn each_statement_numbers_its_own_params() {
        let statements = parse_statements("SELECT :data, :scope; SELECT :scope").unwrap();
        assert_eq!(
            statements[0].to_positional().1,
            vec![Param::Data, Param::Scope]
        );
        assert_eq!(
            statements[1].to_positional(),
            ("SELECT $1".to_owned(), vec![Param::Scope])
        );
    }

    #[test]
    fn render_with_substitutes_every_occurrence() {
        let statement = one("INSERT INTO t VALUES (:stream_id, :data->>'a', :stream_id)");
        let rendered = statement.render_with(|p| format!("v_{}", p.name()));
        assert_eq!(
            rendered,
            "INSERT INTO t VALUES (v_stream_id, v_data->>'a', v_stream_id)"
        );
    }

    #[test]
    fn params_lists_distinct_params() {
        let statement =
            one(":tenant_id :user_id :tenant_id :created_at :stream_version :event_type :metadata");
        assert_eq!(
            statement.params(),
            BTreeSet::from([
                Param::TenantId,
                Param::UserId,
                Param::CreatedAt,
                Param::StreamVersion,
                Param::EventType,
                Param::Metadata,
            ])
        );
    }

    #[test]
    fn param_name_stops_at_non_identifier_characters() {
        let (sql, params) = positional("SELECT :data->'x', :stream_id)");
        assert_eq!(sql, "SELECT $1->'x', $2)");
        assert_eq!(params, vec![Param::Data, Param::StreamId]);
    }

    #[test]
    fn colon_before_non_identifier_is_plain_text() {
        assert!(one("SELECT arr[1:2], ':', a : b").params().is_empty());
    }

    #[test]
    fn unknown_parameter_reports_line_column_and_known_names() {
        let message = err("UPDATE t\nSET total = :totl");
        assert!(
            message.starts_with(
                "unknown parameter :totl at line 2, column 13 (known: :stream_id, :event_id,"
            ),
            "{message}"
        );
        assert!(message.contains(":tenant_id, :events)"), "{message}");
    }

    #[test]
    fn columns_count_characters_not_bytes() {
        let error = parse_statements("SELECT 'é', :nope").unwrap_err();
        assert_eq!(
            error,
            SqlParamError::UnknownParameter {
                name: "nope".into(),
                line: 1,
                column: 13
            }
        );
    }

    #[test]
    fn positional_placeholders_are_rejected() {
        let message = err("UPDATE t SET a = 1 WHERE id = $1");
        assert_eq!(
            message,
            "positional parameter $1 at line 1, column 31: use named parameters such as :stream_id"
        );
        assert!(err("SELECT $12").contains("positional parameter $12 at line 1, column 8"));
    }

    #[test]
    fn unterminated_constructs_are_errors() {
        assert_eq!(
            err("SELECT 'abc"),
            "unterminated quoted string starting at line 1, column 8"
        );
        assert_eq!(
            err("SELECT 'it''s"),
            "unterminated quoted string starting at line 1, column 8"
        );
        assert_eq!(
            err(r"SELECT E'abc\'"),
            "unterminated escape string (E'...') starting at line 1, column 8"
        );
        assert_eq!(
            err("SELECT \"col"),
            "unterminated quoted identifier starting at line 1, column 8"
        );
        assert_eq!(
            err("SELECT $$abc"),
            "unterminated dollar-quoted string starting at line 1, column 8"
        );
        assert_eq!(
            err("SELECT $a$ x $b$"),
            "unterminated dollar-quoted string starting at line 1, column 8"
        );
        assert_eq!(
            err("SELECT 1;\n/* outer /* inner */"),
            "unterminated block comment starting at line 2, column 1"
        );
    }

    #[test]
    fn leading_keyword_is_lower_cased() {
        assert_eq!(one("  Commit").leading_keyword().as_deref(), Some("commit"));
        assert_eq!(
            one("/* c */ INSERT INTO t VALUES (1)")
                .leading_keyword()
                .as_deref(),
            Some("insert")
        );
        assert_eq!(one(":data").leading_keyword(), None);
    }

    #[test]
    fn parameter_uses_reports_positions() {
        let uses = parameter_uses("SELECT 1;\n  SELECT ':data', :stream_id").unwrap();
        assert_eq!(
            uses,
            vec![ParamUse {
                param: Param::StreamId,
                line: 2,
                column: 19
            }]
        );
    }
}
