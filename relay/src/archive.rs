//! The archive's upkeep (`--archive`): `outbox_archive` is partitioned by
//! the day of publication (migration 16). At the relay's start and every
//! hour: the days ahead prepared, the days past `--archive-retention`
//! dropped whole, and the rows of version 1's `outbox_published` (and of
//! the default partition) past it deleted, at most 1,000 a statement.
//! Several relays may run it at once: a day goes once, a busy drop waits
//! for the next pass.

use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox::Ident;
use outbox_core::db::ChunkWalk;
use sqlx::PgPool;

use crate::db::bounded;
use crate::error::Error;
use crate::sql::render;

/// Between two passes.
pub(crate) const EVERY: Duration = Duration::from_secs(3600);

/// Days prepared ahead of today (UTC).
const DAYS_AHEAD: i32 = 7;

/// Rows deleted per statement where a whole day cannot be dropped.
const CHUNK: i64 = 1_000;

/// What one pass did.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Pass {
    pub(crate) prepared: i32,
    pub(crate) dropped: Vec<String>,
    pub(crate) deleted: u64,
}

/// One pass over `schema`'s archive, each statement bounded by `bound`.
pub(crate) async fn upkeep(
    pool: &PgPool,
    schema: &Ident,
    retention: Duration,
    bound: Duration,
) -> Result<Pass, Error> {
    let prepared: i32 = bounded("preparing the archive's days", bound, async {
        let sql = render("SELECT {schema}.outbox_archive_prepare_days($1)", schema);
        Ok::<_, Error>(
            sqlx::query_scalar(sql)
                .bind(DAYS_AHEAD)
                .fetch_one(pool)
                .await?,
        )
    })
    .await?;
    let now: DateTime<Utc> = bounded("the database's clock", bound, async {
        Ok::<_, Error>(sqlx::query_scalar("SELECT now()").fetch_one(pool).await?)
    })
    .await?;
    let window = chrono::Duration::from_std(retention).unwrap_or(chrono::TimeDelta::MAX);
    let cutoff = now
        .checked_sub_signed(window)
        .unwrap_or(DateTime::<Utc>::MIN_UTC);
    let dropped: Vec<String> = bounded("dropping the archive's past days", bound, async {
        let sql = render("SELECT {schema}.outbox_archive_drop_days($1)", schema);
        Ok::<_, Error>(sqlx::query_scalar(sql).bind(cutoff).fetch_all(pool).await?)
    })
    .await?;
    let mut deleted = 0;
    for table in ["outbox_published", "outbox_archive_other"] {
        let sql = render(
            &format!(
                "WITH gone AS (
                     DELETE FROM {{schema}}.{table} WHERE ctid = ANY(ARRAY(
                         SELECT ctid FROM {{schema}}.{table}
                         WHERE published_at >= coalesce($1::timestamptz, '-infinity') AND published_at < $2
                         ORDER BY published_at LIMIT $3))
                     RETURNING published_at)
                 SELECT count(*), max(published_at) FILTER (WHERE published_at > '-infinity') FROM gone"
            ),
            schema,
        );
        let mut walk = ChunkWalk::new(CHUNK);
        while let Some((cursor, chunk)) = walk.next() {
            let done = bounded("trimming the archive", bound, async {
                Ok::<_, Error>(
                    sqlx::query_as(sql.clone())
                        .bind(cursor)
                        .bind(cutoff)
                        .bind(chunk)
                        .fetch_one(pool)
                        .await?,
                )
            })
            .await?;
            walk.advance(done);
        }
        deleted += walk.deleted();
    }
    Ok(Pass {
        prepared,
        dropped,
        deleted,
    })
}
