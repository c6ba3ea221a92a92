//! Supervision: the consumer waits out a missing queue (or a broker that
//! is away) with backoff and resumes by itself.

use e2e::consumer::{Env, Running, id, wait_until};
use outbox_consumer::{Consumer, Error, Event, Handler, Outcome};
use sqlx::PgConnection;

struct Ack;

impl Handler for Ack {
    async fn handle(&self, _: &mut PgConnection, _: &Event) -> Outcome {
        Outcome::Ack
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resumes_by_itself_once_the_queue_exists() {
    let mut env = Env::new().await;
    let late = format!("{}_late", env.queue);
    let mut cfg = env.config("svc");
    cfg.queue = late.clone();
    cfg.declare_retry_queues = false;
    let c = Running::start(Consumer::new(cfg, env.pool.clone(), Ack).unwrap());
    // basic.consume fails (404) until the queue is declared; the consumer
    // keeps retrying with backoff instead of returning.
    wait_until("three failed attempts", || async {
        c.consumer.stats().broker_errors >= 3
    })
    .await;
    assert!(!c.task.is_finished());
    assert_eq!(c.consumer.stats().connections, 0);
    env.add_queue(&late).await;
    env.publish(Some(&id()), "{}").await;
    wait_until("processed after the queue appeared", || async {
        c.consumer.stats().processed == 1
    })
    .await;
    assert_eq!(c.consumer.stats().connections, 1);
    c.stop().await;
    env.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuses_to_start_on_an_unmigrated_schema() {
    let env = Env::new().await;
    let mut cfg = env.config("svc");
    cfg.schema = "t_c_not_migrated".into();
    let err = Consumer::new(cfg, env.pool.clone(), Ack)
        .unwrap()
        .run(Default::default())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Outbox(_)), "{err:?}");
    assert!(
        err.to_string().contains("outbox_consumer::migrate"),
        "{err}"
    );
    env.teardown().await;
}

struct Effect {
    schema: String,
}

impl Handler for Effect {
    async fn handle(&self, conn: &mut PgConnection, event: &Event) -> Outcome {
        let sql = format!("INSERT INTO {}.effects (event_id) VALUES ($1)", self.schema);
        match sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(event.id())
            .execute(conn)
            .await
        {
            Ok(_) => Outcome::Ack,
            Err(e) => Outcome::Retry(e.to_string()),
        }
    }
}

/// Restarts the shared broker: `make test` runs `disruptive_` tests alone,
/// after the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disruptive_broker_restart_is_survived_without_help() {
    let env = Env::new().await;
    let c = Running::start(
        Consumer::new(
            env.config("svc"),
            env.pool.clone(),
            Effect {
                schema: env.schema.clone(),
            },
        )
        .unwrap(),
    );
    wait_until("the consumer to connect", || async {
        c.consumer.stats().connections >= 1
    })
    .await;
    let before: Vec<(Option<String>, Vec<u8>)> =
        (0..2000).map(|_| (Some(id()), b"{}".to_vec())).collect();
    env.publish_all(&before).await;
    wait_until("processing to start", || async {
        c.consumer.stats().processed > 0
    })
    .await;
    let restarted = std::process::Command::new("rabbitmqctl")
        .arg("stop_app")
        .status()
        .unwrap()
        .success()
        && std::process::Command::new("rabbitmqctl")
            .arg("start_app")
            .status()
            .unwrap()
            .success();
    assert!(restarted, "rabbitmqctl could not restart the broker");
    // Publish more after the restart, on a fresh connection.
    let after_env = {
        let conn = lapin::Connection::connect(&e2e::consumer::amqp_url(), Default::default())
            .await
            .unwrap();
        let ch = conn.create_channel().await.unwrap();
        ch.confirm_select(Default::default()).await.unwrap();
        for _ in 0..2000 {
            let props = lapin::BasicProperties::default()
                .with_message_id(id().into())
                .with_delivery_mode(2);
            ch.basic_publish(
                env.exchange.as_str().into(),
                "order.OrderPlaced".into(),
                Default::default(),
                b"{}",
                props,
            )
            .await
            .unwrap();
        }
        assert!(ch.wait_for_confirms().await.unwrap().is_empty());
        conn
    };
    wait_until("all 4,000 effects after the restart", || async {
        env.count("{s}.effects").await >= 4000
    })
    .await;
    assert_eq!(
        env.count("(SELECT DISTINCT event_id FROM {s}.effects) e")
            .await,
        4000
    );
    assert_eq!(
        env.count("{s}.effects").await,
        4000,
        "no effect applied twice"
    );
    assert!(
        c.consumer.stats().connections >= 2,
        "the consumer reconnected by itself"
    );
    let _ = after_env.close(200, "bye".into()).await;
    c.stop().await;
    env.teardown().await;
}

/// What no retry can fix ends `run` with a typed error at once: a refused
/// login, a missing virtual host, a retry queue declared earlier with
/// other arguments (PRECONDITION_FAILED). The password is in no message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_end_run_with_an_error_instead_of_retrying() {
    let env = Env::new().await;
    let wrong_password = e2e::consumer::amqp_url().replace("guest:guest", "guest:S3cret-wrong");
    let no_vhost = e2e::consumer::amqp_url().replace("%2f", "no-such-vhost");
    // <queue>.retry exists already as a plain queue without the retry
    // arguments the consumer declares.
    let clash = format!("{}_clash", env.queue);
    env.channel
        .queue_declare(
            format!("{clash}.retry").as_str().into(),
            lapin::options::QueueDeclareOptions {
                auto_delete: true,
                ..Default::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await
        .unwrap();
    let clash_name = clash.clone();
    for (what, url, queue) in [
        ("a refused login", wrong_password, env.queue.clone()),
        ("a missing vhost", no_vhost, env.queue.clone()),
        (
            "a conflicting declaration",
            e2e::consumer::amqp_url(),
            clash,
        ),
    ] {
        let mut cfg = env.config("svc");
        cfg.amqp_url = url.into();
        cfg.queue = queue;
        let consumer = Consumer::new(cfg, env.pool.clone(), Ack).unwrap();
        let ended = tokio::time::timeout(
            std::time::Duration::from_secs(30),
            consumer.run(tokio_util::sync::CancellationToken::new()),
        )
        .await
        .unwrap_or_else(|_| panic!("{what}: still retrying after 30 s"));
        let e = ended.expect_err(what);
        if what == "a conflicting declaration" {
            assert!(
                matches!(&e, Error::QueueMismatch { queue, .. } if *queue == format!("{clash_name}.retry")),
                "{what}: {e:?}"
            );
            assert!(e.to_string().contains("inequivalent arg"), "{what}: {e}");
        } else {
            assert!(matches!(e, Error::Broker(_)), "{what}: {e:?}");
        }
        assert!(!e.is_transient(), "{what}: {e}");
        assert!(!format!("{e} {e:?}").contains("S3cret"), "{what}: {e}");
    }
    env.teardown().await;
}

/// Two nodes (proxies to the test broker): a consumer whose session fails
/// starts the next one with the node after it, even when the node it left
/// still answers; a working session stays where it is (the relay's rule
/// too, through the same seam: relay-ops/tests/broker_nodes.rs). The
/// `outbox_consumer_broker_connected` gauge follows the node in use.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_failed_session_the_consumer_moves_to_the_next_node() {
    // This process's metrics, as a service exporting them would see them
    // (nextest runs each test in a process of its own).
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .unwrap();
    let connected = |node: &str| connected_gauge(&metrics.render(), node);
    let mut env = Env::new().await;
    let upstream = "127.0.0.1:5672".parse().unwrap();
    let (first, second) = (
        e2e::Proxy::start(upstream).await,
        e2e::Proxy::start(upstream).await,
    );
    let late = format!("{}_late", env.queue);
    let mut cfg = env.config("svc");
    cfg.queue = late.clone();
    cfg.declare_retry_queues = false;
    let direct = cfg.amqp_url.expose().to_owned();
    let (first_url, second_url) = (first.url(&direct), second.url(&direct));
    cfg.amqp_url = format!("{first_url},{second_url}").into();
    let c = Running::start(Consumer::new(cfg, env.pool.clone(), Ack).unwrap());
    // Both nodes answer, but every session fails (404: no queue yet): the
    // attempts take turns.
    wait_until("three failed sessions", || async {
        c.consumer.stats().broker_errors >= 3
    })
    .await;
    assert!(first.connections() >= 2, "started on the first node");
    assert!(second.connections() >= 1, "moved on after a failed session");

    env.add_queue(&late).await;
    env.publish(Some(&id()), "{}").await;
    wait_until("processed once the queue exists", || async {
        c.consumer.stats().processed == 1
    })
    .await;
    let node = |url: &str| outbox::urls::host_port(url);
    let (used, other, used_url, other_url) = if c.consumer.broker_node() == Some(node(&first_url)) {
        (&first, &second, &first_url, &second_url)
    } else {
        (&second, &first, &second_url, &first_url)
    };
    assert_eq!(connected(&node(used_url)), Some(1.0), "the node in use");
    assert_ne!(
        connected(&node(other_url)),
        Some(1.0),
        "the node not in use"
    );
    // The node in use drops the connection: the consumer moves to the
    // other one and stays there once the first answers again.
    let sessions = c.consumer.stats().connections;
    used.set(e2e::Mode::Reset);
    wait_until("reconnected", || async {
        c.consumer.stats().connections > sessions
    })
    .await;
    used.set(e2e::Mode::Pass);
    assert_eq!(c.consumer.broker_node(), Some(node(other_url)));
    assert_eq!(connected(&node(other_url)), Some(1.0), "the gauge moved");
    assert_eq!(connected(&node(used_url)), Some(0.0), "the node left");
    let on_other = other.connections();
    env.publish(Some(&id()), "{}").await;
    wait_until("processed on the other node", || async {
        c.consumer.stats().processed == 2
    })
    .await;
    assert_eq!(other.connections(), on_other, "no reconnect while it works");
    c.stop().await;
    first.stop();
    second.stop();
    env.teardown().await;
}

/// The value of `outbox_consumer_broker_connected` for `node` on a
/// Prometheus page, if the page has it.
fn connected_gauge(page: &str, node: &str) -> Option<f64> {
    let label = format!("node=\"{node}\"");
    page.lines()
        .filter(|l| l.starts_with("outbox_consumer_broker_connected{") && l.contains(&label))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
}
