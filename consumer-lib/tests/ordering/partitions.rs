//! The routing scheme: each aggregate on one partition queue, one active
//! consumer per partition, applied in publish order.

use super::*;

/// A second connection for assertions that close their channel or
/// connection on failure.
async fn connect() -> Connection {
    Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .unwrap()
}

/// Redeclaring `queue` with the quorum arguments the topology gives it,
/// but without `x-single-active-consumer`, is refused: the queue has it.
async fn assert_single_active(queue: &str, quorum: bool) {
    let conn = connect().await;
    let ch = conn.create_channel().await.unwrap();
    let mut args = FieldTable::default();
    if quorum {
        let text = |s: &str| lapin::types::AMQPValue::LongString(s.into());
        args.insert("x-queue-type".into(), text("quorum"));
        args.insert(
            "x-delivery-limit".into(),
            lapin::types::AMQPValue::LongLongInt(outbox_consumer::DEFAULT_DELIVERY_LIMIT.into()),
        );
        args.insert("x-dead-letter-exchange".into(), text(""));
        args.insert(
            "x-dead-letter-routing-key".into(),
            text(&format!("{queue}.dlq")),
        );
        args.insert("x-dead-letter-strategy".into(), text("at-least-once"));
        args.insert("x-overflow".into(), text("reject-publish"));
    }
    let err = ch
        .queue_declare(queue.into(), QueueDeclareOptions::durable(), args)
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("x-single-active-consumer"),
        "{queue}: {err}"
    );
    let _ = conn.close(200, "bye".into()).await;
}

fn unique(prefix: &str) -> String {
    format!(
        "{prefix}_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_keep_each_aggregate_on_one_queue_in_publish_order() {
    let mut env = Env::new().await;
    let source = unique("t_c_ox");
    let name = unique("t_c_o");
    let mut topology = OrderedTopology::new(&name, &source, "order.#", 4);
    // Classic: the test reads the partitions with basic.get, which quorum
    // queues with single active consumer refuse.
    topology.queue_type = outbox_consumer::QueueType::Classic;
    let queues = declare_ordered_topology(&env.amqp, &topology)
        .await
        .unwrap();
    for q in &queues {
        env.delete_on_teardown(q);
    }
    env.delete_exchange_on_teardown(&name);
    env.delete_exchange_on_teardown(&source);
    assert_eq!(
        queues,
        (0..4).map(|i| format!("{name}.{i}")).collect::<Vec<_>>()
    );
    // Idempotent.
    assert_eq!(
        declare_ordered_topology(&env.amqp, &topology)
            .await
            .unwrap(),
        queues
    );

    // 400 events over 40 aggregates; the body carries the publish number.
    let mut confirms = Vec::new();
    for n in 0..400u32 {
        let m = unordered(&format!("agg-{}", n % 40));
        let body = format!(r#"{{"n":{n}}}"#);
        confirms.push(
            env.channel
                .basic_publish(
                    source.as_str().into(),
                    "order.OrderChanged".into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    },
                    body.as_bytes(),
                    properties(&m),
                )
                .await
                .unwrap(),
        );
    }
    for c in confirms {
        assert_eq!(c.await.unwrap(), Confirmation::Ack(None));
    }
    // Drain: per queue, (aggregate, publish number) in queue order.
    let mut drained: Vec<Vec<(String, u64)>> = vec![Vec::new(); queues.len()];
    let deadline = tokio::time::Instant::now() + e2e::consumer::DEADLINE;
    while drained.iter().map(Vec::len).sum::<usize>() < 400 {
        let mut got = false;
        for (q, into) in queues.iter().zip(&mut drained) {
            if let Some(m) = env
                .channel
                .basic_get(q.as_str().into(), BasicGetOptions { no_ack: true })
                .await
                .unwrap()
            {
                let aggregate = match m
                    .properties
                    .headers()
                    .as_ref()
                    .and_then(|h| h.inner().get(wire::HEADER_AGGREGATE_ID))
                {
                    Some(AMQPValue::LongString(s)) => s.to_string(),
                    other => panic!("{other:?}"),
                };
                let body: serde_json::Value = serde_json::from_slice(&m.data).unwrap();
                into.push((aggregate, body["n"].as_u64().unwrap()));
                got = true;
            }
        }
        if !got {
            assert!(tokio::time::Instant::now() < deadline, "messages missing");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let mut home: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, msgs) in drained.iter().enumerate() {
        let mut last: BTreeMap<&str, u64> = BTreeMap::new();
        for (aggregate, n) in msgs {
            let q = *home.entry(aggregate).or_insert(i);
            assert_eq!(q, i, "{aggregate} is on queues {q} and {i}");
            if let Some(prev) = last.insert(aggregate, *n) {
                assert!(prev < *n, "{aggregate}: {n} after {prev} on queue {i}");
            }
        }
    }
    assert_eq!(home.len(), 40);
    let used = drained.iter().filter(|m| !m.is_empty()).count();
    assert!(
        used >= 2,
        "the hash spreads aggregates: {used} queue(s) used"
    );

    // Single active consumer: every queue has it, and of two consumers
    // on a queue only the first receives.
    for q in &queues {
        assert_single_active(q, false).await;
    }
    let conn = connect().await;
    let (first, second) = (
        conn.create_channel().await.unwrap(),
        conn.create_channel().await.unwrap(),
    );
    let mut streams = Vec::new();
    for (ch, tag) in [(&first, "first"), (&second, "second")] {
        ch.basic_qos(100, BasicQosOptions::default()).await.unwrap();
        streams.push(
            ch.basic_consume(
                queues[1].as_str().into(),
                tag.into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap(),
        );
    }
    let to_second: Vec<Msg> = (0..20).map(|_| unordered("direct")).collect();
    publish_to(&env, "", &queues[1], &to_second).await;
    let mut received = 0;
    while received < 20 {
        // Without single active consumer, half would go to the second.
        tokio::time::timeout(e2e::consumer::DEADLINE, streams[0].next())
            .await
            .expect("the first consumer received everything")
            .unwrap()
            .unwrap();
        received += 1;
    }
    let _ = conn.close(200, "bye".into()).await;
    env.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_partition_is_one_single_active_queue_and_consumers_apply_in_order() {
    let mut env = Env::new().await;
    let source = unique("t_c_ox");
    let name = unique("t_c_o");
    let one = OrderedTopology::new(&name, &source, "order.#", 1);
    let queues = declare_ordered_topology(&env.amqp, &one).await.unwrap();
    assert_eq!(queues, std::slice::from_ref(&name));
    env.delete_on_teardown(&name);
    env.delete_exchange_on_teardown(&source);
    assert_single_active(&name, true).await;
    // Each aggregate's events out of order: 2 before 1.
    let msgs: Vec<Msg> = (0..5)
        .flat_map(|a| [seq(&format!("g{a}"), 2), seq(&format!("g{a}"), 1)])
        .collect();
    publish_to(&env, &source, "order.OrderChanged", &msgs).await;
    Recorder::new(&env).await;
    let mut cfg = ordered(&env, false);
    cfg.queue = name.clone();
    let c = Running::start(Consumer::new(cfg, env.pool.clone(), Recorder::on(&env)).unwrap());
    wait_until("every event applied", || async {
        env.count("{s}.applied").await >= 10
    })
    .await;
    for a in 0..5 {
        assert_eq!(applied(&env, &format!("g{a}")).await, [1, 2]);
    }
    c.stop().await;
    env.teardown().await;
}
