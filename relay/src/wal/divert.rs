//! What the log's reader does with events it did not deliver: it puts them
//! in the outbox table, where the table workers retry, block or
//! dead-letter them as they do any row, so one bad event never holds the
//! stream. Ordered aggregates with events in the table keep the rest of
//! their events queued behind them there.

use std::collections::HashSet;

use outbox::Ident;
use sqlx::{PgConnection, PgPool, SqlStr};

use crate::error::{Error, Result};
use crate::message::OutboxEvent;
use crate::publish::Receipt;
use crate::settle::{Settle, Settled};
use crate::wal::decode::Unreadable;

/// The diversion to the table for one schema: its statements
/// (`divert/*.sql`) and the settle stage, which records the attempts.
#[derive(Debug, Clone)]
pub(crate) struct Divert {
    queued: SqlStr,
    insert: SqlStr,
    unreadable: SqlStr,
    dead_letter: SqlStr,
    settle: Settle,
}

impl Divert {
    pub(crate) fn new(schema: &Ident, settle: Settle) -> Self {
        use crate::sql::render;
        Self {
            queued: render(include_str!("divert/queued.sql"), schema),
            insert: render(include_str!("divert/divert.sql"), schema),
            unreadable: render(include_str!("divert/unreadable.sql"), schema),
            dead_letter: render(include_str!("divert/dead_letter.sql"), schema),
            settle,
        }
    }

    /// The ordered aggregates among `events` that have events in the outbox
    /// table: theirs must go behind those, never past them.
    pub(crate) async fn queued_aggregates(
        &self,
        pool: &PgPool,
        events: &[OutboxEvent],
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
        let rows: Vec<(String, String)> = sqlx::query_as(self.queued.clone())
            .bind(&types)
            .bind(&ids)
            .fetch_all(pool)
            .await?;
        Ok(rows.into_iter().collect())
    }

    /// Records, in one transaction that commits durably, the events not
    /// delivered (with their receipts) and the messages that are no event.
    /// Only after it commits may the reader confirm their position to the slot.
    ///
    /// Whatever a message holds, this accounts for it and commits: an event
    /// the outbox table refuses (its CHECKs, text PostgreSQL cannot store,
    /// written by a producer that checks less than `outbox_emit`) is
    /// dead-lettered with the reason instead, and one the dead letters cannot
    /// hold as columns goes there as text. Failing here would end the session
    /// and read the same events again, for ever.
    pub(crate) async fn record(
        &self,
        pool: &PgPool,
        failed: &[OutboxEvent],
        receipts: &[Receipt],
        unreadable: &[Unreadable],
    ) -> Result<Settled> {
        // A plain BEGIN, never cancelled: synchronous commit (the slot moves on
        // once this commits).
        let mut tx = pool.begin().await?;
        let mut settled = Settled::default();
        if !failed.is_empty() {
            let all: Vec<&OutboxEvent> = failed.iter().collect();
            savepoint(&mut tx).await?;
            let r = self.insert_events(&mut tx, &all).await;
            let taken = match end_savepoint(&mut tx, r).await {
                Ok(()) => None,
                Err(e) if refused_input(&e) => {
                    tracing::warn!(error = %e, "the outbox table refused events of the log: each one alone");
                    Some(self.one_by_one(&mut tx, failed, receipts).await?)
                }
                Err(e) => return Err(e),
            };
            settled = match taken {
                None => self.settle.settle(&mut tx, failed, receipts).await?,
                Some((events, receipts, dead)) => {
                    let mut s = self.settle.settle(&mut tx, &events, &receipts).await?;
                    s.dead_lettered += dead;
                    s
                }
            };
        }
        if !unreadable.is_empty() {
            self.insert_unreadable(&mut tx, unreadable).await?;
            settled.dead_lettered += unreadable.len();
        }
        tx.commit().await?;
        Ok(settled)
    }

    /// The events into the outbox table as never attempted (the settle that
    /// follows records the attempt).
    async fn insert_events(&self, conn: &mut PgConnection, events: &[&OutboxEvent]) -> Result<()> {
        let n = events.len();
        let (mut ids, mut types, mut aggregates, mut event_types) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        let (mut payloads, mut headers, mut exchanges, mut keys, mut created, mut seqs) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        for e in events {
            ids.push(e.id);
            types.push(e.aggregate_type.as_str());
            aggregates.push(e.aggregate_id.as_str());
            event_types.push(e.event_type.as_str());
            payloads.push(e.payload.as_str());
            headers.push(e.headers.as_str());
            exchanges.push(e.exchange.as_deref());
            keys.push(e.routing_key.as_deref());
            created.push(e.created_at);
            seqs.push(e.aggregate_seq);
        }
        sqlx::query(self.insert.clone())
            .bind(&ids)
            .bind(&types)
            .bind(&aggregates)
            .bind(&event_types)
            .bind(&payloads)
            .bind(&headers)
            .bind(&exchanges)
            .bind(&keys)
            .bind(&created)
            .bind(&seqs)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    /// The failed events one at a time: those the table takes go there (and
    /// are returned with their receipts, to be settled); each one it refuses
    /// is dead-lettered with the reason. Returns also how many were.
    async fn one_by_one(
        &self,
        conn: &mut PgConnection,
        failed: &[OutboxEvent],
        receipts: &[Receipt],
    ) -> Result<(Vec<OutboxEvent>, Vec<Receipt>, usize)> {
        let (mut taken, mut taken_receipts, mut dead) = (Vec::new(), Vec::new(), 0);
        for (e, receipt) in failed.iter().zip(receipts) {
            savepoint(conn).await?;
            let r = self.insert_events(conn, &[e]).await;
            let refusal = match end_savepoint(conn, r).await {
                Ok(()) => {
                    taken.push(e.clone());
                    taken_receipts.push(receipt.clone());
                    continue;
                }
                Err(refusal) if refused_input(&refusal) => refusal,
                Err(other) => return Err(other),
            };
            let error = match receipt.error().filter(|_| receipt.is_permanent()) {
                Some(why) => why,
                None => format!(
                    "the outbox table refused this event of the log ({}), so it cannot be retried there{}",
                    database_message(&refusal),
                    receipt
                        .error()
                        .map(|e| format!("; it was not delivered: {e}"))
                        .unwrap_or_default()
                ),
            };
            tracing::warn!(event_id = %e.id, event_type = %e.event_type, error = %error, "event of the log dead-lettered");
            let attempts = i32::from(!matches!(
                receipt,
                Receipt::NotSent | Receipt::HeldBack | Receipt::Queued
            ));
            savepoint(conn).await?;
            let r = self.dead_letter(conn, e, attempts, &error).await;
            match end_savepoint(conn, r).await {
                Ok(()) => {}
                Err(again) if refused_input(&again) => {
                    // Not even as columns: the event as text, with both reasons.
                    let u = Unreadable {
                        id: e.id,
                        lsn: "?".to_owned(),
                        content: as_text(e),
                        error: format!(
                            "{error}; the dead letters refused its fields too ({})",
                            database_message(&again)
                        ),
                    };
                    self.insert_unreadable(conn, &[u]).await?;
                }
                Err(other) => return Err(other),
            }
            dead += 1;
        }
        Ok((taken, taken_receipts, dead))
    }

    async fn dead_letter(
        &self,
        conn: &mut PgConnection,
        e: &OutboxEvent,
        attempts: i32,
        error: &str,
    ) -> Result<()> {
        sqlx::query(self.dead_letter.clone())
            .bind(e.id)
            .bind(&e.aggregate_type)
            .bind(&e.aggregate_id)
            .bind(&e.event_type)
            .bind(&e.payload)
            .bind(&e.headers)
            .bind(&e.exchange)
            .bind(&e.routing_key)
            .bind(e.created_at)
            .bind(e.aggregate_seq)
            .bind(attempts)
            .bind(error)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    async fn insert_unreadable(
        &self,
        conn: &mut PgConnection,
        unreadable: &[Unreadable],
    ) -> Result<()> {
        let ids: Vec<_> = unreadable.iter().map(|u| u.id).collect();
        let lsns: Vec<_> = unreadable.iter().map(|u| u.lsn.as_str()).collect();
        let contents: Vec<_> = unreadable.iter().map(|u| u.content.as_str()).collect();
        let errors: Vec<_> = unreadable.iter().map(|u| u.error.as_str()).collect();
        sqlx::query(self.unreadable.clone())
            .bind(&ids)
            .bind(&lsns)
            .bind(&contents)
            .bind(&errors)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }
}

/// Errors of what a statement was given, not of the database: a data
/// exception (class 22: text with NUL, a JSON number out of range), an
/// integrity violation (class 23: a CHECK), a program limit (class 54).
fn refused_input(e: &Error) -> bool {
    let Error::Database(sqlx::Error::Database(d)) = e else {
        return false;
    };
    d.code()
        .is_some_and(|c| c.starts_with("22") || c.starts_with("23") || c.starts_with("54"))
}

/// Opens a savepoint: what follows until [`end_savepoint`] can fail
/// without failing the transaction.
async fn savepoint(conn: &mut PgConnection) -> Result<()> {
    sqlx::query("SAVEPOINT divert").execute(&mut *conn).await?;
    Ok(())
}

/// Keeps what was done since [`savepoint`] when `r` is `Ok`, rolls it back
/// otherwise; returns `r`.
async fn end_savepoint<T>(conn: &mut PgConnection, r: Result<T>) -> Result<T> {
    let end = if r.is_ok() {
        "RELEASE SAVEPOINT divert"
    } else {
        "ROLLBACK TO SAVEPOINT divert"
    };
    sqlx::query(end).execute(&mut *conn).await?;
    r
}

/// What the database said, without the driver's wording around it.
fn database_message(e: &Error) -> String {
    match e {
        Error::Database(sqlx::Error::Database(d)) => d.message().to_owned(),
        other => other.to_string(),
    }
}

/// The event as JSON text (the message contract's fields): strings
/// escaped, so it holds no NUL whatever the event does.
fn as_text(e: &OutboxEvent) -> String {
    let text = |s: &str| serde_json::Value::from(s).to_string();
    let optional = |s: &Option<String>| s.as_deref().map_or("null".to_owned(), text);
    format!(
        r#"{{"id":"{}","aggregate_type":{},"aggregate_id":{},"event_type":{},"payload":{},"headers":{},"exchange":{},"routing_key":{},"aggregate_seq":{}}}"#,
        e.id,
        text(&e.aggregate_type),
        text(&e.aggregate_id),
        text(&e.event_type),
        e.payload,
        e.headers,
        optional(&e.exchange),
        optional(&e.routing_key),
        e.aggregate_seq.map_or("null".to_owned(), |s| s.to_string()),
    )
}
