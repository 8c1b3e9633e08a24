//! Reading a perspective's model table as text, for the demo's printout.

use sqlx::postgres::PgConnection;
use sqlx::Row;

const COLUMNS: &str = "SELECT column_name::text FROM information_schema.columns
     WHERE table_schema = $1 AND table_name = $2 ORDER BY ordinal_position";

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
        tables.extend(read_model_table(conn, schema, name).await?);
    }
    Ok(tables)
}

/// Table `schema.name`, or None when there is no such table.
async fn read_model_table(
    conn: &mut PgConnection,
    schema: &str,
    name: &str,
) -> Result<Option<ModelTable>, sqlx::Error> {
    let columns: Vec<String> = sqlx::query_scalar(COLUMNS)
        .bind(schema)
        .bind(name)
        .fetch_all(&mut *conn)
        .await?;
    if columns.is_empty() {
        return Ok(None);
    }
    let select = columns
        .iter()
        .map(|c| format!("coalesce({}::text, '')", quote_ident(c)))
        .collect::<Vec<_>>()
        .join(", ");
    let rows = sqlx::query(&format!(
        "SELECT {select} FROM {}.{} ORDER BY 1",
        quote_ident(schema),
        quote_ident(name)
    ))
    .fetch_all(&mut *conn)
    .await?;
    let rows = rows
        .iter()
        .map(|r| (0..columns.len()).map(|i| r.get::<String, _>(i)).collect())
        .collect();
    Ok(Some(ModelTable {
        name: name.to_string(),
        columns,
        rows,
    }))
}

fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}
