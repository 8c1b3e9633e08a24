//! What the `demo` command shows: the contents of the perspectives' read-model tables, as text.

use sqlx::postgres::PgConnection;
use sqlx::Row;

/// One read-model table: its columns in table order and every row, each value as text (NULL as
/// the empty string), ordered by the first column.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelTable {
    pub name: String,
    pub columns: Vec<String>,
    pub rows: Vec<Vec<String>>,
}

/// The tables of `schema` named like the perspectives `names`, in that order; a perspective
/// without a table of its name is left out.
pub async fn read_model_tables(
    conn: &mut PgConnection,
    schema: &str,
    names: &[String],
) -> Result<Vec<ModelTable>, sqlx::Error> {
    let mut tables = Vec::new();
    for name in names {
        let columns: Vec<String> = sqlx::query_scalar(
            "SELECT column_name::text FROM information_schema.columns
             WHERE table_schema = $1 AND table_name = $2 ORDER BY ordinal_position",
        )
        .bind(schema)
        .bind(name)
        .fetch_all(&mut *conn)
        .await?;
        if columns.is_empty() {
            continue;
        }
        let select = columns
            .iter()
            .map(|c| format!("coalesce(\"{c}\"::text, '')"))
            .collect::<Vec<_>>()
            .join(", ");
        let rows = sqlx::query(&format!(
            "SELECT {select} FROM {schema}.\"{name}\" ORDER BY 1"
        ))
        .fetch_all(&mut *conn)
        .await?;
        let rows = rows
            .iter()
            .map(|r| (0..columns.len()).map(|i| r.get::<String, _>(i)).collect())
            .collect();
        tables.push(ModelTable {
            name: name.clone(),
            columns,
            rows,
        });
    }
    Ok(tables)
}
