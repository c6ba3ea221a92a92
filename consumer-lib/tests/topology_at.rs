//! Declaring the topology from the consumer's URL list
//! (`declare_topology_at`, `declare_ordered_topology_at`): the first node
//! that answers declares, as the consumer connects; a malformed URL is
//! refused before anything connects, and never quoted.

use e2e::consumer::{Env, amqp_url};
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use outbox_consumer::{
    Error, OrderedTopology, QueueType, TopologyConfig, declare_ordered_topology_at,
    declare_topology, declare_topology_at,
};

/// A node that is down: nothing listens on port 1.
const DEAD: &str = "amqp://guest:guest@127.0.0.1:1/%2f";

/// The test broker behind a node that is down.
fn dead_first() -> String {
    format!("{DEAD},{}", amqp_url())
}

/// Whether `queue` exists (a passive declare, on a channel of its own: a
/// missing queue closes it).
async fn exists(env: &Env, queue: &str) -> bool {
    let ch = env.amqp.create_channel().await.unwrap();
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let found = ch
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await
        .is_ok();
    let _ = ch.close(200, "ok".into()).await;
    found
}

#[tokio::test]
async fn declare_topology_at_skips_a_dead_first_node() {
    let mut env = Env::new().await;
    let queue = format!("{}.at", env.queue);
    env.delete_on_teardown(&queue);
    let topology = TopologyConfig::new(&queue, &env.exchange, "order.*");
    declare_topology_at(dead_first(), &topology).await.unwrap();
    // Idempotent, like declare_topology.
    declare_topology_at(dead_first(), &topology).await.unwrap();
    for q in [
        queue.clone(),
        format!("{queue}.retry"),
        format!("{queue}.dlq"),
    ] {
        assert!(exists(&env, &q).await, "{q} declared");
    }
    // Bound to the exchange with the key.
    env.publish(Some("e-1"), "{}").await;
    assert_eq!(env.take(&queue, 1).await.len(), 1);
    // Declared as declare_topology declares it (a quorum queue): a classic
    // declaration of it is refused.
    let mut classic = topology.clone();
    classic.queue_type = QueueType::Classic;
    let refused = declare_topology(&env.amqp, &classic).await.unwrap_err();
    assert!(
        matches!(refused, Error::QueueMismatch { .. }),
        "{refused:?}"
    );
    env.teardown().await;
}

#[tokio::test]
async fn declare_ordered_topology_at_skips_a_dead_first_node() {
    let mut env = Env::new().await;
    let name = format!("{}.ordered", env.queue);
    let topology = OrderedTopology::new(&name, &env.exchange, "order.*", 2);
    let queues = declare_ordered_topology_at(dead_first(), &topology)
        .await
        .unwrap();
    for q in &queues {
        env.delete_on_teardown(q);
    }
    env.delete_exchange_on_teardown(&name);
    assert_eq!(queues, [format!("{name}.0"), format!("{name}.1")]);
    for q in &queues {
        assert!(exists(&env, q).await, "{q} declared");
    }
    env.teardown().await;
}

#[tokio::test]
async fn a_malformed_url_in_the_list_is_refused_unquoted_before_connecting() {
    let topology = TopologyConfig::new("never.declared", "never.declared.x", "#");
    let good = amqp_url();
    for list in [
        format!("{good},amqp://guest:S3cret@127.0.0.1:notaport/%2f"),
        format!("{good},amqp:guest:S3cret@127.0.0.1/%2f"),
        format!("{good},amqp://guest:S3cret@127.0.0.1/%2f?heartbeat=often"),
        format!("{good},http://guest:S3cret@127.0.0.1/"),
        " , ".to_owned(),
    ] {
        let e = declare_topology_at(list.as_str(), &topology)
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Config(_)), "{list}: {e:?}");
        assert!(!e.is_transient());
        assert!(!format!("{e} {e:?}").contains("S3cret"), "{e}");
        let ordered = OrderedTopology::new("never.declared", "never.declared.x", "#", 1);
        let e = declare_ordered_topology_at(list.as_str(), &ordered)
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Config(_)), "{list}: {e:?}");
    }
}

#[tokio::test]
async fn no_node_answering_is_worth_retrying() {
    let topology = TopologyConfig::new("never.declared", "never.declared.x", "#");
    let e = declare_topology_at(
        format!("{DEAD},amqp://guest:guest@127.0.0.1:2/%2f"),
        &topology,
    )
    .await
    .unwrap_err();
    assert!(e.is_transient(), "{e:?}");
    assert!(!e.to_string().contains("guest:guest"), "{e}");
}
