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
use outbox_core::sql::Template;
use sqlx::{PgPool, SqlStr};

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

/// The archive's statements for one schema, rendered once.
#[derive(Debug)]
pub(crate) struct Archive {
    prepare_days: SqlStr,
    drop_days: SqlStr,
    /// Deletes a chunk of version 1's `outbox_published`, then of the
    /// default partition (`outbox_archive_other`).
    trim: [SqlStr; 2],
}

impl Archive {
    pub(crate) fn new(schema: &Ident) -> Self {
        let trim = |table: &str| {
            Template::new(include_str!("archive/trim.sql"), schema)
                .with("table", table)
                .render()
        };
        Self {
            prepare_days: render("SELECT {schema}.outbox_archive_prepare_days($1)", schema),
            drop_days: render("SELECT {schema}.outbox_archive_drop_days($1)", schema),
            trim: [trim("outbox_published"), trim("outbox_archive_other")],
        }
    }

    /// One pass, each statement bounded by `bound`.
    pub(crate) async fn upkeep(
        &self,
        pool: &PgPool,
        retention: Duration,
        bound: Duration,
    ) -> Result<Pass, Error> {
        let prepared: i32 = bounded("preparing the archive's days", bound, async {
            Ok::<_, Error>(
                sqlx::query_scalar(self.prepare_days.clone())
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
            Ok::<_, Error>(
                sqlx::query_scalar(self.drop_days.clone())
                    .bind(cutoff)
                    .fetch_all(pool)
                    .await?,
            )
        })
        .await?;
        let mut deleted = 0;
        for sql in &self.trim {
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
}
