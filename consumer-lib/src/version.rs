use outbox::Ident;
use outbox_core::sql::render;
use sqlx::PgConnection;

use crate::error::Result;

/// Records `version` as the current version of `entity` for `consumer` if
/// it is newer than the stored one. Returns true when it was (apply the
/// update), false for a stale or repeated version (skip it: a no-op).
///
/// For state-carrying events that may arrive out of order. Call it from a
/// handler with the handler's connection: the version record commits or
/// rolls back with the effect.
///
/// ```no_run
/// # async fn demo(conn: &mut sqlx::PgConnection) -> outbox_consumer::Result<()> {
/// if outbox_consumer::apply_if_newer(conn, "public", "billing", "customer:42", 7).await? {
///     // write the state carried by version 7
/// }
/// # Ok(()) }
/// ```
pub async fn apply_if_newer(
    conn: &mut PgConnection,
    schema: &str,
    consumer: &str,
    entity: &str,
    version: i64,
) -> Result<bool> {
    let schema = Ident::new("schema", schema)?;
    let applied: Option<i32> = sqlx::query_scalar(render(include_str!("version.sql"), &schema))
        .bind(consumer)
        .bind(entity)
        .bind(version)
        .fetch_optional(conn)
        .await?;
    Ok(applied.is_some())
}
