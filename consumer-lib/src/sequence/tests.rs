use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable};
use outbox::wire;

use super::deferral::Deferral;
use super::position::{Aggregate, Position, position};
use super::sequencer::{Locked, Sequencer, Turn};

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
