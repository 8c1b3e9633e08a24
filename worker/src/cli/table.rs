//! The one table printer of the command line: `status`, `dead-letters list` and the demo's
//! read-model tables all render through it, so their columns line up the same way.

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

    /// Append a row; it must have one cell per column.
    pub fn row(&mut self, cells: Vec<String>) {
        debug_assert_eq!(cells.len(), self.columns.len(), "one cell per column");
        self.rows.push(cells);
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
