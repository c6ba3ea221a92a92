//! Ordered consumption: each sequenced event's position in its aggregate,
//! the `inbox_sequences` statements, and the classification of a batch's
//! sequenced events against the last applied sequence numbers.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};

use lapin::BasicProperties;
use lapin::types::AMQPValue;
use outbox::{Ident, wire};
use sqlx::{AssertSqlSafe, PgConnection, SqlSafeStr, SqlStr};

use crate::event::{MAX_DEDUP_KEY_BYTES, amqp_int, amqp_text};

/// One aggregate: `x-aggregate-type` and `x-aggregate-id`. Ordered by
/// type, then id: the order in which a batch locks its rows.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Aggregate {
    pub(crate) kind: String,
    pub(crate) id: String,
}

/// Where a sequenced event stands in its aggregate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Position {
    pub(crate) aggregate: Aggregate,
    pub(crate) seq: i64,
}

/// The position of a message: `Ok(None)` without `x-aggregate-seq` (an
/// unordered event); `Err` holds why the message is poison.
pub(crate) fn position(props: &BasicProperties) -> Result<Option<Position>, String> {
    let Some(headers) = props.headers().as_ref().map(|h| h.inner()) else {
        return Ok(None);
    };
    let Some(raw) = headers.get(wire::HEADER_AGGREGATE_SEQ) else {
        return Ok(None);
    };
    let seq = match raw {
        // A timestamp is an integer on the wire but not a sequence number.
        AMQPValue::Timestamp(_) => None,
        v => amqp_int(v),
    }
    .filter(|&n| n >= 1)
    .ok_or_else(|| {
        format!(
            "header {} must be an integer of at least 1, got {raw:?}",
            wire::HEADER_AGGREGATE_SEQ
        )
    })?;
    let text = |name: &str| -> Result<String, String> {
        let value = headers
            .get(name)
            .and_then(amqp_text)
            .map(Cow::into_owned)
            .filter(|s| !s.is_empty())
            .ok_or_else(|| {
                format!(
                    "a sequenced event (header {}) needs a non-empty header {name}",
                    wire::HEADER_AGGREGATE_SEQ
                )
            })?;
        // PostgreSQL refuses NUL in text and a B-tree entry must fit a
        // page: such a key could never be locked, the batch never commit.
        if value.contains('\0') || value.len() > MAX_DEDUP_KEY_BYTES {
            return Err(format!(
                "header {name} contains a NUL character or exceeds {MAX_DEDUP_KEY_BYTES} bytes"
            ));
        }
        Ok(value)
    };
    Ok(Some(Position {
        aggregate: Aggregate {
            kind: text(wire::HEADER_AGGREGATE_TYPE)?,
            id: text(wire::HEADER_AGGREGATE_ID)?,
        },
        seq,
    }))
}

/// The `inbox_sequences` statements of one schema and consumer name.
#[derive(Debug, Clone)]
pub(crate) struct Sequences {
    consumer: String,
    accept_first_seen: bool,
    /// Locks the rows of a batch's aggregates, creating missing ones at
    /// 0, and returns their last applied sequence numbers. Rows are
    /// inserted (and so locked) in the order of the arrays, which the
    /// caller sorts: two instances locking overlapping sets cannot
    /// deadlock. `xmax = 0` marks a row this statement created.
    lock: SqlStr,
    /// Raises `last_seq` of rows this transaction holds locked.
    advance: SqlStr,
}

impl Sequences {
    pub(crate) fn new(schema: &Ident, consumer: &str, accept_first_seen: bool) -> Self {
        let s = schema.quoted();
        Self {
            consumer: consumer.to_owned(),
            accept_first_seen,
            lock: AssertSqlSafe(format!(
                "INSERT INTO {s}.inbox_sequences AS q (consumer, aggregate_type, aggregate_id, last_seq) \
                 SELECT $1, k.t, k.i, 0 \
                 FROM unnest($2::text[], $3::text[]) WITH ORDINALITY AS k(t, i, n) ORDER BY k.n \
                 ON CONFLICT (consumer, aggregate_type, aggregate_id) \
                 DO UPDATE SET last_seq = q.last_seq \
                 RETURNING q.aggregate_type, q.aggregate_id, q.last_seq, (q.xmax = 0) AS created"
            ))
            .into_sql_str(),
            advance: AssertSqlSafe(format!(
                "UPDATE {s}.inbox_sequences AS q SET last_seq = u.seq, updated_at = now() \
                 FROM unnest($2::text[], $3::text[], $4::bigint[]) AS u(t, i, seq) \
                 WHERE q.consumer = $1 AND q.aggregate_type = u.t AND q.aggregate_id = u.i"
            ))
            .into_sql_str(),
        }
    }

    /// Locks the aggregates of `positions` (the batch's fresh sequenced
    /// events, in delivery order) until the transaction ends and returns
    /// their state; `None` when there are none (no statement is sent).
    pub(crate) async fn lock<'p>(
        &self,
        conn: &mut PgConnection,
        positions: impl Iterator<Item = &'p Position> + Clone,
    ) -> sqlx::Result<Option<Sequencer>> {
        let mut aggregates: Vec<&Aggregate> = positions.clone().map(|p| &p.aggregate).collect();
        if aggregates.is_empty() {
            return Ok(None);
        }
        aggregates.sort_unstable();
        aggregates.dedup();
        let kinds: Vec<&str> = aggregates.iter().map(|a| a.kind.as_str()).collect();
        let ids: Vec<&str> = aggregates.iter().map(|a| a.id.as_str()).collect();
        let rows: Vec<(String, String, i64, bool)> = sqlx::query_as(self.lock.clone())
            .bind(&self.consumer)
            .bind(&kinds)
            .bind(&ids)
            .fetch_all(conn)
            .await?;
        let rows = rows.into_iter().map(|(kind, id, last, created)| Locked {
            aggregate: Aggregate { kind, id },
            last,
            created,
        });
        Ok(Some(Sequencer::new(
            rows,
            self.accept_first_seen,
            positions,
        )))
    }

    /// Records the sequence numbers `order` moved, in the caller's
    /// transaction (the one holding the locks, with the effects).
    pub(crate) async fn advance(
        &self,
        conn: &mut PgConnection,
        order: &Sequencer,
    ) -> sqlx::Result<()> {
        let moved = order.moved();
        if moved.is_empty() {
            return Ok(());
        }
        let kinds: Vec<&str> = moved.iter().map(|(a, _)| a.kind.as_str()).collect();
        let ids: Vec<&str> = moved.iter().map(|(a, _)| a.id.as_str()).collect();
        let seqs: Vec<i64> = moved.iter().map(|&(_, s)| s).collect();
        sqlx::query(self.advance.clone())
            .bind(&self.consumer)
            .bind(&kinds)
            .bind(&ids)
            .bind(&seqs)
            .execute(conn)
            .await?;
        Ok(())
    }
}

/// One row returned by the lock statement.
#[derive(Debug)]
pub(crate) struct Locked {
    pub(crate) aggregate: Aggregate,
    pub(crate) last: i64,
    /// The row did not exist: this consumer never saw the aggregate.
    pub(crate) created: bool,
}

/// Whether it is a sequenced event's turn: where its number stands against
/// its aggregate's last applied one (see the glossary in the crate docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Turn {
    /// Next in sequence: run the handler.
    Apply,
    /// At or below the last applied number: ack, do not run.
    Stale { last: i64 },
    /// Beyond the next expected number: not applied, retried later.
    Gap { expected: i64 },
    /// An earlier event of its aggregate in this batch was not applied.
    HeldBack { expected: i64 },
}

/// The sequence state of a batch's aggregates while its events are
/// classified in delivery order.
#[derive(Debug)]
pub(crate) struct Sequencer {
    tracks: HashMap<Aggregate, Track>,
}

#[derive(Debug)]
struct Track {
    /// As stored when locked.
    stored: i64,
    /// Last applied, including this batch.
    last: i64,
    /// An event of this aggregate failed in this batch.
    blocked: bool,
}

impl Sequencer {
    /// `positions`: the batch's fresh sequenced events; with
    /// `accept_first_seen`, the lowest sequence number among those of an
    /// aggregate without a row sets its start (not the first in delivery
    /// order: a lower one may come back from the retry queue behind a
    /// higher one, and must not become stale).
    pub(crate) fn new<'p>(
        rows: impl IntoIterator<Item = Locked>,
        accept_first_seen: bool,
        positions: impl Iterator<Item = &'p Position>,
    ) -> Self {
        let mut first_seen = HashSet::new();
        let mut tracks: HashMap<Aggregate, Track> = rows
            .into_iter()
            .map(|r| {
                if r.created && accept_first_seen {
                    first_seen.insert(r.aggregate.clone());
                }
                let track = Track {
                    stored: r.last,
                    last: r.last,
                    blocked: false,
                };
                (r.aggregate, track)
            })
            .collect();
        if !first_seen.is_empty() {
            let mut lowest: HashMap<Aggregate, i64> = HashMap::new();
            for p in positions {
                if let Some(l) = lowest.get_mut(&p.aggregate) {
                    *l = (*l).min(p.seq);
                } else if first_seen.contains(&p.aggregate) {
                    lowest.insert(p.aggregate.clone(), p.seq);
                }
            }
            for (aggregate, seq) in lowest {
                if let Some(t) = tracks.get_mut(&aggregate) {
                    // Recorded even if that event then fails: its retry
                    // must still be the expected one.
                    t.last = seq - 1;
                }
            }
        }
        Self { tracks }
    }

    /// Classifies the next event of the batch (in delivery order).
    pub(crate) fn turn(&self, p: &Position) -> Turn {
        let Some(t) = self.tracks.get(&p.aggregate) else {
            // Every aggregate of the batch was locked; never reached.
            return Turn::HeldBack { expected: p.seq };
        };
        if p.seq <= t.last {
            Turn::Stale { last: t.last }
        } else if t.blocked {
            Turn::HeldBack {
                expected: t.last + 1,
            }
        } else if p.seq > t.last + 1 {
            Turn::Gap {
                expected: t.last + 1,
            }
        } else {
            Turn::Apply
        }
    }

    /// Records the final outcome of an event decided [`Turn::Apply`].
    pub(crate) fn record(&mut self, p: &Position, applied: bool) {
        if let Some(t) = self.tracks.get_mut(&p.aggregate) {
            if applied {
                t.last = p.seq;
            } else {
                t.blocked = true;
            }
        }
    }

    /// The aggregates whose last sequence number changed, sorted.
    fn moved(&self) -> Vec<(&Aggregate, i64)> {
        let mut moved: Vec<(&Aggregate, i64)> = self
            .tracks
            .iter()
            .filter(|(_, t)| t.last != t.stored)
            .map(|(a, t)| (a, t.last))
            .collect();
        moved.sort_unstable();
        moved
    }
}

/// Why a sequenced event was deferred: sent back through the retry queue
/// (header `x-deferral-count`), not counted against the handler's retries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Deferral {
    /// The next sequence number its aggregate expects.
    pub(crate) expected: i64,
    /// The event's own sequence number.
    pub(crate) got: i64,
    /// Held back behind a failed earlier event of its aggregate in the
    /// batch, rather than a gap.
    pub(crate) held_back: bool,
}

impl Deferral {
    /// Why this event is deferred (logged).
    pub(crate) fn reason(&self) -> String {
        let Self { expected, got, .. } = self;
        if self.held_back {
            format!(
                "held back: an earlier event of this aggregate was not applied (expected {expected}, got {got})"
            )
        } else {
            format!("sequence gap: expected {expected}, got {got}")
        }
    }

    /// The dead-letter reason once `max_deferrals` are spent.
    pub(crate) fn give_up_reason(&self, max_deferrals: u32) -> String {
        let Self { expected, got, .. } = self;
        let why = if self.held_back {
            " (held back behind a failed earlier event of this aggregate)"
        } else {
            ""
        };
        format!(
            "sequence gap never closed after {max_deferrals} deferrals: expected {expected}, got {got}{why}"
        )
    }
}

#[cfg(test)]
mod tests {
    use lapin::types::FieldTable;

    use super::*;

    fn agg(id: &str) -> Aggregate {
        Aggregate {
            kind: "order".into(),
            id: id.into(),
        }
    }

    fn pos(id: &str, seq: i64) -> Position {
        Position {
            aggregate: agg(id),
            seq,
        }
    }

    fn locked(id: &str, last: i64, created: bool) -> Locked {
        Locked {
            aggregate: agg(id),
            last,
            created,
        }
    }

    /// Classifies `batch` in order, applying `fails` as handler failures.
    fn run(seq: &mut Sequencer, batch: &[Position], fails: &[i64]) -> Vec<Turn> {
        batch
            .iter()
            .map(|p| {
                let d = seq.turn(p);
                if d == Turn::Apply {
                    seq.record(p, !fails.contains(&p.seq));
                }
                d
            })
            .collect()
    }

    #[test]
    fn next_in_sequence_applies_stale_acks_gap_waits() {
        let batch = [
            pos("a", 1),
            pos("a", 3),
            pos("a", 2),
            pos("a", 2),
            pos("a", 1),
        ];
        let mut s = Sequencer::new([locked("a", 0, true)], false, batch.iter());
        assert_eq!(
            run(&mut s, &batch, &[]),
            [
                Turn::Apply,
                Turn::Gap { expected: 2 },
                Turn::Apply,
                Turn::Stale { last: 2 },
                Turn::Stale { last: 2 },
            ]
        );
        assert_eq!(s.moved(), [(&agg("a"), 2)]);
    }

    #[test]
    fn a_failure_holds_back_its_aggregate_only() {
        let batch = [
            pos("a", 2),
            pos("b", 1),
            pos("a", 3),
            pos("b", 2),
            pos("a", 1),
        ];
        let mut s = Sequencer::new(
            [locked("a", 1, false), locked("b", 0, true)],
            false,
            batch.iter(),
        );
        let d = run(&mut s, &batch[..1], &[2]);
        assert_eq!(d, [Turn::Apply]);
        assert_eq!(
            run(&mut s, &batch[1..], &[]),
            [
                Turn::Apply,
                Turn::HeldBack { expected: 2 },
                Turn::Apply,
                Turn::Stale { last: 1 },
            ]
        );
        assert_eq!(s.moved(), [(&agg("b"), 2)], "a did not move");
    }

    #[test]
    fn first_seen_sets_the_start_only_for_new_aggregates() {
        let batch = [pos("new", 7), pos("new", 8), pos("old", 7)];
        let rows = [locked("new", 0, true), locked("old", 3, false)];
        let mut s = Sequencer::new(rows, true, batch.iter());
        assert_eq!(
            run(&mut s, &batch, &[]),
            [Turn::Apply, Turn::Apply, Turn::Gap { expected: 4 }]
        );
        // Without the option, a new aggregate starts at 1.
        let rows = [locked("new", 0, true), locked("old", 3, false)];
        let s = Sequencer::new(rows, false, batch.iter());
        assert_eq!(s.turn(&batch[0]), Turn::Gap { expected: 1 });
        // The start is recorded even when its first event fails, so the
        // retry of that event is the one expected.
        let mut s = Sequencer::new([locked("new", 0, true)], true, batch[..1].iter());
        assert_eq!(run(&mut s, &batch[..1], &[7]), [Turn::Apply]);
        assert_eq!(s.moved(), [(&agg("new"), 6)]);
    }

    #[test]
    fn first_seen_starts_at_the_lowest_fresh_seq_of_the_batch() {
        // 7 came back from the retry queue behind 8: the start is 6, so 8
        // waits for 7 instead of 7 being dropped as stale.
        let batch = [pos("new", 8), pos("new", 7), pos("other", 3)];
        let rows = [locked("new", 0, true), locked("other", 0, true)];
        let mut s = Sequencer::new(rows, true, batch.iter());
        assert_eq!(
            run(&mut s, &batch, &[]),
            [Turn::Gap { expected: 7 }, Turn::Apply, Turn::Apply,]
        );
        assert_eq!(s.moved(), [(&agg("new"), 7), (&agg("other"), 3)]);
        // The start is recorded even when the lowest event's handler fails,
        // and the rest of the aggregate is held back behind it.
        let batch = [pos("new", 9), pos("new", 7), pos("new", 8)];
        let mut s = Sequencer::new([locked("new", 0, true)], true, batch.iter());
        assert_eq!(
            run(&mut s, &batch, &[7]),
            [
                Turn::Gap { expected: 7 },
                Turn::Apply,
                Turn::HeldBack { expected: 7 },
            ]
        );
        assert_eq!(s.moved(), [(&agg("new"), 6)]);
        // An aggregate with a row keeps its stored start.
        let batch = [pos("old", 8), pos("old", 7)];
        let s = Sequencer::new([locked("old", 0, false)], true, batch.iter());
        assert_eq!(s.turn(&batch[1]), Turn::Gap { expected: 1 });
        assert!(s.moved().is_empty());
    }

    #[test]
    fn deferral_reasons_name_the_expected_and_the_got() {
        let gap = Deferral {
            expected: 6,
            got: 8,
            held_back: false,
        };
        assert_eq!(gap.reason(), "sequence gap: expected 6, got 8");
        assert_eq!(
            gap.give_up_reason(100),
            "sequence gap never closed after 100 deferrals: expected 6, got 8"
        );
        let held = Deferral {
            held_back: true,
            ..gap
        };
        assert!(held.reason().starts_with("held back: "));
        assert_eq!(
            held.give_up_reason(3),
            "sequence gap never closed after 3 deferrals: expected 6, got 8 \
             (held back behind a failed earlier event of this aggregate)"
        );
    }

    fn props(headers: &[(&str, AMQPValue)]) -> BasicProperties {
        let mut h = FieldTable::default();
        for (k, v) in headers {
            h.insert((*k).into(), v.clone());
        }
        BasicProperties::default().with_headers(h)
    }

    #[test]
    fn positions_come_from_the_headers() {
        let t = (
            wire::HEADER_AGGREGATE_TYPE,
            AMQPValue::LongString("order".into()),
        );
        let i = (
            wire::HEADER_AGGREGATE_ID,
            AMQPValue::LongString("o-1".into()),
        );
        let seq = |v: AMQPValue| (wire::HEADER_AGGREGATE_SEQ, v);
        assert_eq!(position(&BasicProperties::default()), Ok(None));
        assert_eq!(position(&props(&[t.clone(), i.clone()])), Ok(None));
        assert_eq!(
            position(&props(&[
                t.clone(),
                i.clone(),
                seq(AMQPValue::LongLongInt(3))
            ])),
            Ok(Some(pos("o-1", 3)))
        );
        for bad in [
            AMQPValue::LongLongInt(0),
            AMQPValue::LongLongInt(-1),
            AMQPValue::LongString("3".into()),
            AMQPValue::Timestamp(3),
        ] {
            let err = position(&props(&[t.clone(), i.clone(), seq(bad)])).unwrap_err();
            assert!(err.contains("at least 1"), "{err}");
        }
        let err = position(&props(&[t.clone(), seq(AMQPValue::LongInt(1))])).unwrap_err();
        assert!(err.contains(wire::HEADER_AGGREGATE_ID), "{err}");
        let nul = (
            wire::HEADER_AGGREGATE_ID,
            AMQPValue::LongString("a\0b".into()),
        );
        let err = position(&props(&[t, nul, seq(AMQPValue::LongInt(1))])).unwrap_err();
        assert!(err.contains("NUL"), "{err}");
    }
}
