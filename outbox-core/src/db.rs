//! Database helpers: which errors are worth retrying, and deleting in
//! chunks.

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use sqlx::Postgres;
use sqlx::postgres::PgArguments;
use sqlx::query::QueryAs;

/// Whether a sqlx error is worth retrying: connection loss, a closed or
/// exhausted pool, serialisation failures, deadlocks, a server shutting
/// down or starting, a lock not available.
pub fn is_transient(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed => true,
        sqlx::Error::Database(db) => matches!(
            db.code().as_deref(),
            // serialization_failure, deadlock_detected, admin_shutdown,
            // crash_shutdown, cannot_connect_now, lock_not_available
            Some("40001" | "40P01" | "57P01" | "57P02" | "57P03" | "55P03")
        ),
        _ => false,
    }
}

/// Whether a sqlx error says the database cannot be reached now, whatever
/// the statement: the connection lost or refused, the pool closed or out
/// of time for a connection, the server shutting down, starting or full
/// (SQLSTATE classes 08 and 57P, and 53300). A statement's own failure (a
/// missing table, a refused grant) is not.
pub fn is_unreachable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|c| {
            c.starts_with("08") || matches!(&*c, "57P01" | "57P02" | "57P03" | "53300")
        }),
        _ => false,
    }
}

/// A chunked `DELETE` that walks its table's time index forward: each
/// statement starts where the previous one stopped, so the index entries
/// of rows already deleted are not walked again. Without it every chunk
/// starts at the oldest entry, and while a long transaction holds the xmin
/// horizon (no vacuum may remove those entries) a pass of `n` chunks walks
/// `n²/2` chunks' worth of dead entries.
///
/// The statement deletes at most `$2` rows whose time is at or after the
/// cursor `$1` (`NULL` at first: from the oldest), in time order, and
/// returns how many and the latest time among them, leaving out
/// `-infinity` (set by hand; chrono cannot hold it, and the cursor starts
/// there anyway):
///
/// ```sql
/// WITH gone AS (
///     DELETE FROM t WHERE ctid = ANY(ARRAY(
///         SELECT ctid FROM t WHERE at >= coalesce($1::timestamptz, '-infinity') AND at < $3
///         ORDER BY at LIMIT $2))
///     RETURNING at)
/// SELECT count(*), max(at) FILTER (WHERE at > '-infinity') FROM gone
/// ```
///
/// Rows sharing the boundary's time stay at or after the next cursor, so
/// none is skipped; the dead entries of rows sharing one time are walked
/// again by each statement that starts at that time (a group of equal
/// times larger than a chunk, such as one transaction's rows, costs more
/// than its size).
#[derive(Debug, Clone, Copy)]
pub struct ChunkWalk {
    cursor: Option<DateTime<Utc>>,
    chunk: i64,
    deleted: u64,
    done: bool,
}

impl ChunkWalk {
    /// A walk from the oldest time, `chunk` rows a statement.
    pub fn new(chunk: i64) -> Self {
        Self {
            cursor: None,
            chunk: chunk.max(1),
            deleted: 0,
            done: false,
        }
    }

    /// The next statement's binds: the cursor and the chunk size; `None`
    /// once a statement deleted fewer rows than a chunk.
    pub fn next(&self) -> Option<(Option<DateTime<Utc>>, i64)> {
        (!self.done).then_some((self.cursor, self.chunk))
    }

    /// Takes a statement's result: how many rows it deleted and the latest
    /// time among them.
    pub fn advance(&mut self, (deleted, last): (i64, Option<DateTime<Utc>>)) {
        self.deleted += u64::try_from(deleted).unwrap_or(0);
        if let Some(last) = last {
            self.cursor = self.cursor.max(Some(last));
        }
        self.done = deleted < self.chunk;
    }

    /// Rows deleted so far.
    pub fn deleted(&self) -> u64 {
        self.deleted
    }
}

/// Runs a [`ChunkWalk`] to its end and returns how many rows it deleted.
/// `statement` builds one chunk's statement from the cursor and the chunk
/// size (the shape in [`ChunkWalk`]), so cleanup never holds long locks,
/// never builds one huge transaction and walks each dead entry once
/// (apart from those sharing a boundary's time).
pub async fn delete_in_chunks<'q, F>(
    pool: &PgPool,
    chunk: i64,
    mut statement: F,
) -> sqlx::Result<u64>
where
    F: FnMut(Option<DateTime<Utc>>, i64) -> QueryAs<'q, Postgres, Chunk, PgArguments>,
{
    let mut walk = ChunkWalk::new(chunk);
    while let Some((cursor, chunk)) = walk.next() {
        walk.advance(statement(cursor, chunk).fetch_one(pool).await?);
    }
    Ok(walk.deleted())
}

/// One chunk's result: rows deleted, the latest time among them.
pub type Chunk = (i64, Option<DateTime<Utc>>);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_walk_resumes_at_the_latest_time_deleted_and_ends_on_a_short_chunk() {
        let at = |s: i64| DateTime::<Utc>::from_timestamp(s, 0);
        let mut walk = ChunkWalk::new(2);
        assert_eq!(walk.next(), Some((None, 2)));
        walk.advance((2, at(10)));
        assert_eq!(walk.next(), Some((at(10), 2)));
        // Only '-infinity' rows (no time to report): the cursor stays.
        walk.advance((2, None));
        assert_eq!(walk.next(), Some((at(10), 2)));
        walk.advance((1, at(12)));
        assert_eq!(walk.next(), None);
        assert_eq!(walk.deleted(), 5);
        // A chunk size below one still deletes.
        assert_eq!(ChunkWalk::new(0).next(), Some((None, 1)));
    }
}
