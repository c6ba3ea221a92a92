//! Assertions a test ends on: the AMQP contract of a delivery, and the
//! oracle's exactly-once verdict.

use lapin::types::AMQPValue;

/// Asserts that delivery `d` is event `id` as the AMQP contract says
/// (docs/AMQP_MESSAGE.md): its id, type, JSON content type, persistence,
/// `timestamp` (Unix seconds), aggregate headers, the event's own
/// `headers` untouched, and `routing_key`.
pub fn assert_contract(
    d: &lapin::message::Delivery,
    id: &str,
    event_type: &str,
    (aggregate_type, aggregate_id): (&str, &str),
    timestamp: i64,
    headers: &[(&str, &str)],
    routing_key: &str,
) {
    let p = &d.properties;
    assert_eq!(p.message_id().as_ref().unwrap().as_str(), id);
    assert_eq!(p.kind().as_ref().unwrap().as_str(), event_type);
    assert_eq!(
        p.content_type().as_ref().unwrap().as_str(),
        "application/json"
    );
    assert_eq!(*p.delivery_mode(), Some(2), "persistent");
    assert_eq!(*p.timestamp(), Some(timestamp as u64));
    let h = p.headers().as_ref().unwrap().inner();
    assert_eq!(
        h["x-aggregate-type"],
        AMQPValue::LongString(aggregate_type.into())
    );
    assert_eq!(
        h["x-aggregate-id"],
        AMQPValue::LongString(aggregate_id.into())
    );
    for (k, v) in headers {
        assert_eq!(h[*k], AMQPValue::LongString((*v).into()), "header {k}");
    }
    assert_eq!(d.routing_key.as_str(), routing_key);
}

/// The oracle's verdict, once everything is quiet: the effects `applied`
/// (one row per application) are exactly the `committed` event ids, none
/// applied twice. Panics naming `scenario` with what is missing, extra or
/// doubled.
pub fn assert_applied_once(applied: &[String], committed: &[String], scenario: &str) {
    let distinct: std::collections::HashSet<&String> = applied.iter().collect();
    let expected: std::collections::HashSet<&String> = committed.iter().collect();
    let missing = expected.difference(&distinct).count();
    let unexpected = distinct.difference(&expected).count();
    assert!(
        missing == 0 && unexpected == 0,
        "{scenario}: applied effects differ from committed events: {missing} committed \
         events never applied, {unexpected} effects of events never committed"
    );
    assert_eq!(
        applied.len(),
        distinct.len(),
        "{scenario}: an effect was applied twice"
    );
}
