//! The one table printer of the command line: `status`, `dead-letters list` and the demo's
//! read-model tables all render through it, so their columns line up the same way.

/// `text` with every control character escaped (`\n`, `\t`, `\r`, others as `\u{1b}`): cells
/// and messages can hold text that producers wrote (event types, handler errors quoting event
/// data), and a raw escape sequence would reach the terminal (move the cursor, rewrite lines,
/// set the window title) or break the table's lines.
pub fn escape_control(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            c if c.is_control() => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    out
}

/// Which side of its column a cell keeps to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Align {
    Left,
    Right,
}

/// A column: its header, alignment and the width it keeps even when every cell is shorter.
#[derive(Debug, Clone)]
pub struct Column {
    header: String,
    align: Align,
    min_width: usize,
}

impl Column {
    pub fn left(header: &str) -> Self {
        Column {
            header: header.to_string(),
            align: Align::Left,
            min_width: 0,
        }
    }

    pub fn right(header: &str) -> Self {
        Column {
            align: Align::Right,
            ..Column::left(header)
        }
    }

    pub fn min_width(mut self, width: usize) -> Self {
        self.min_width = width;
        self
    }
}

/// How columns are separated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    /// Two spaces between columns, no rule under the header (`status`, `dead-letters list`).
    Plain,
    /// ` | ` between columns and a `-+-` rule under the header (the demo's tables).
    Grid,
}

/// Rows of text cells under a header; every column is as wide as its widest cell.
#[derive(Debug, Clone)]
pub struct Table {
    style: Style,
    columns: Vec<Column>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(style: Style, columns: Vec<Column>) -> Self {
        Table {
            style,
            columns,
            rows: Vec::new(),
        }
    }

    /// Append a row; it must have one cell per column. Control characters in a cell are
    /// shown escaped (see [`escape_control`]).
    pub fn row(&mut self, cells: Vec<String>) {
        debug_assert_eq!(cells.len(), self.columns.len(), "one cell per column");
        self.rows
            .push(cells.iter().map(|c| escape_control(c)).collect());
    }

    /// The header, the rule (Grid only) and the rows, one line each, every line ending in `\n`
    /// and none in spaces (a left-aligned last column is not padded).
    pub fn render(&self) -> String {
        let widths = self.widths();
        let separator = match self.style {
            Style::Plain => "  ",
            Style::Grid => " | ",
        };
        let mut out = String::new();
        let headers: Vec<&str> = self.columns.iter().map(|c| c.header.as_str()).collect();
        self.push_line(&mut out, &headers, &widths, separator);
        if self.style == Style::Grid {
            let dashes: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
            out.push_str(&dashes.join("-+-"));
            out.push('\n');
        }
        for row in &self.rows {
            let cells: Vec<&str> = row.iter().map(String::as_str).collect();
            self.push_line(&mut out, &cells, &widths, separator);
        }
        out
    }

    fn widths(&self) -> Vec<usize> {
        self.columns
            .iter()
            .enumerate()
            .map(|(i, c)| {
                self.rows
                    .iter()
                    .map(|r| r[i].chars().count())
                    .chain([c.header.chars().count(), c.min_width])
                    .max()
                    .unwrap_or(0)
            })
            .collect()
    }

    fn push_line(&self, out: &mut String, cells: &[&str], widths: &[usize], separator: &str) {
        let padded: Vec<String> = cells
            .iter()
            .zip(widths)
            .zip(&self.columns)
            .map(|((cell, width), column)| match column.align {
                Align::Right => format!("{cell:>width$}"),
                Align::Left => format!("{cell:<width$}"),
            })
            .collect();
        out.push_str(padded.join(separator).trim_end());
        out.push('\n');
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 26, finding 7: text producers wrote reaches the terminal escaped.
    #[test]
    fn control_characters_in_cells_are_escaped() {
        let mut t = Table::new(Style::Plain, vec![Column::left("A"), Column::left("B")]);
        t.row(vec![
            "x\u{1b}[2J\u{1b}]0;owned\u{7}".into(),
            "line\nbreak\tand\r\u{9b}".into(),
        ]);
        let out = t.render();
        assert!(!out.chars().any(|c| c.is_control() && c != '\n'), "{out:?}");
        assert_eq!(out.lines().count(), 2, "{out:?}");
        assert!(out.contains("x\\u{1b}[2J\\u{1b}]0;owned\\u{7}"), "{out}");
        assert!(out.contains("line\\nbreak\\tand\\r\\u{9b}"), "{out}");
    }

    #[test]
    fn plain_columns_take_the_widest_cell_and_align_each_side() {
        let mut t = Table::new(
            Style::Plain,
            vec![
                Column::left("NAME"),
                Column::right("N"),
                Column::left("NOTE"),
            ],
        );
        t.row(vec!["alpha".into(), "7".into(), "x".into()]);
        t.row(vec!["b".into(), "1234".into(), "longer note".into()]);
        assert_eq!(
            t.render(),
            "NAME      N  NOTE\n\
             alpha     7  x\n\
             b      1234  longer note\n"
        );
    }

    #[test]
    fn min_width_holds_when_every_cell_is_shorter() {
        let mut t = Table::new(
            Style::Plain,
            vec![Column::right("ID").min_width(6), Column::left("S")],
        );
        t.row(vec!["1".into(), "pending".into()]);
        t.row(vec!["22".into(), "".into()]);
        assert_eq!(t.render(), "    ID  S\n     1  pending\n    22\n");
    }

    #[test]
    fn grid_separates_with_bars_and_rules_the_header() {
        let mut t = Table::new(Style::Grid, vec![Column::left("k"), Column::left("value")]);
        t.row(vec!["alice".into(), "1".into()]);
        assert_eq!(t.render(), "k     | value\n------+------\nalice | 1\n");
    }

    #[test]
    fn width_counts_characters_not_bytes() {
        let mut t = Table::new(Style::Grid, vec![Column::left("n"), Column::left("x")]);
        t.row(vec!["čaj".into(), "1".into()]);
        t.row(vec!["tea".into(), "2".into()]);
        assert_eq!(t.render(), "n   | x\n----+--\nčaj | 1\ntea | 2\n");
    }

    #[test]
    fn a_table_without_rows_is_its_header() {
        let t = Table::new(Style::Plain, vec![Column::left("A"), Column::right("B")]);
        assert_eq!(t.render(), "A  B\n");
    }
}
