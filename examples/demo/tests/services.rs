//! The demo's consumer services take the URL list of every node of a
//! cluster, as their consumers do: each declares its queue on the first
//! node that answers.

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;

/// A node that is down (nothing listens on port 1), then the test broker.
fn dead_first() -> String {
    format!("amqp://guest:guest@127.0.0.1:1/%2f,{}", e2e::amqp_url())
}

#[tokio::test]
async fn inventory_and_notifications_declare_their_queue_past_a_dead_first_node() {
    let s = e2e::suffix();
    let exchange = format!("test.services.{s}");
    let queues = [
        format!("test.inventory.{s}"),
        format!("test.notifications.{s}"),
    ];
    let declared = [
        inventory::declare_queue(&dead_first(), &queues[0], &exchange, "order.#").await,
        notifications::declare_queue(&dead_first(), &queues[1], &exchange, "order.#").await,
    ];

    let conn = e2e::connect().await;
    let ch = conn.create_channel().await.unwrap();
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let mut found = Vec::new();
    for q in &queues {
        let declare = ch.queue_declare(q.as_str().into(), passive, FieldTable::default());
        found.push(declare.await.is_ok());
    }
    let _ = conn.close(200, "ok".into()).await;
    for q in &queues {
        for name in [q.clone(), format!("{q}.retry"), format!("{q}.dlq")] {
            let exchange = exchange.clone();
            e2e::TestBroker {
                exchange,
                queue: name,
            }
            .cleanup()
            .await;
        }
    }

    let [inventory, notifications] = declared;
    inventory.expect("inventory::declare_queue");
    notifications.expect("notifications::declare_queue");
    assert_eq!(found, [true, true], "both queues declared");
}
