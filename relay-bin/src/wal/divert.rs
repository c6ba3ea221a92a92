//! What the log's reader does with events it did not deliver: it puts them
//! in the outbox table, where the table workers retry, block or
//! dead-letter them as they do any row, so one bad event never holds the
//! stream. Ordered aggregates with events in the table keep the rest of
//! their events queued behind them there.

use std::collections::HashSet;

use sqlx::PgPool;

use crate::config::RelayConfig;
use crate::error::Result;
use crate::message::ClaimedEvent;
use crate::publish::Receipt;
use crate::queries::Queries;
use crate::settle::{Settled, settle};
use crate::wal::decode::Unreadable;

/// The ordered aggregates among `events` that have events in the outbox
/// table: theirs must go behind those, never past them.
pub(crate) async fn queued_aggregates(
    pool: &PgPool,
    queries: &Queries,
    events: &[ClaimedEvent],
) -> Result<HashSet<(String, String)>> {
    let ordered: HashSet<(&str, &str)> = events
        .iter()
        .filter(|e| e.aggregate_seq.is_some())
        .map(|e| (e.aggregate_type.as_str(), e.aggregate_id.as_str()))
        .collect();
    if ordered.is_empty() {
        return Ok(HashSet::new());
    }
    let (types, ids): (Vec<&str>, Vec<&str>) = ordered.into_iter().unzip();
    let rows: Vec<(String, String)> = sqlx::query_as(queries.wal_queued.clone())
        .bind(&types)
        .bind(&ids)
        .fetch_all(pool)
        .await?;
    Ok(rows.into_iter().collect())
}

/// Records, in one transaction that commits durably, the events not
/// delivered (with their receipts) and the messages that are no event.
/// Only after it commits may the reader confirm their position to the slot.
pub(crate) async fn record(
    pool: &PgPool,
    queries: &Queries,
    config: &RelayConfig,
    failed: &[ClaimedEvent],
    receipts: &[Receipt],
    unreadable: &[Unreadable],
) -> Result<Settled> {
    // A plain BEGIN, never cancelled: synchronous commit (the slot moves on
    // once this commits).
    let mut tx = pool.begin().await?;
    let mut settled = Settled::default();
    if !failed.is_empty() {
        let n = failed.len();
        let mut cols = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        let (mut exchanges, mut keys, mut created, mut seqs) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        for e in failed {
            cols.0.push(e.id);
            cols.1.push(e.aggregate_type.as_str());
            cols.2.push(e.aggregate_id.as_str());
            cols.3.push(e.event_type.as_str());
            cols.4.push(e.payload.as_str());
            cols.5.push(e.headers.as_str());
            exchanges.push(e.exchange.as_deref());
            keys.push(e.routing_key.as_deref());
            created.push(e.created_at);
            seqs.push(e.aggregate_seq);
        }
        sqlx::query(queries.wal_divert.clone())
            .bind(&cols.0)
            .bind(&cols.1)
            .bind(&cols.2)
            .bind(&cols.3)
            .bind(&cols.4)
            .bind(&cols.5)
            .bind(&exchanges)
            .bind(&keys)
            .bind(&created)
            .bind(&seqs)
            .execute(&mut *tx)
            .await?;
        settled = settle(&mut tx, queries, config, failed, receipts).await?;
    }
    if !unreadable.is_empty() {
        let ids: Vec<_> = unreadable.iter().map(|u| u.id).collect();
        let lsns: Vec<_> = unreadable.iter().map(|u| u.lsn.as_str()).collect();
        let contents: Vec<_> = unreadable.iter().map(|u| u.content.as_str()).collect();
        let errors: Vec<_> = unreadable.iter().map(|u| u.error.as_str()).collect();
        sqlx::query(queries.wal_unreadable.clone())
            .bind(&ids)
            .bind(&lsns)
            .bind(&contents)
            .bind(&errors)
            .execute(&mut *tx)
            .await?;
        settled.dead_lettered += unreadable.len();
    }
    tx.commit().await?;
    Ok(settled)
}
