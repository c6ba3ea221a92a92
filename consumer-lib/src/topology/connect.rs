//! Connecting for a declaration of its own: the first node of the
//! consumer's URL list that answers, one attempt per URL.

use std::time::Duration;

use lapin::{Connection, ConnectionProperties};
use outbox::redact::SecretUrl;

use crate::error::{Error, Result};

/// Connects to the first node of `amqp_url` that answers
/// ([`outbox_core::amqp::connect_any`], as the consumer's sessions do),
/// runs `declare` on the connection and closes it. A transient failure
/// moves on to the next node: at most one attempt per URL.
pub(crate) async fn at_any_node<T>(
    amqp_url: &SecretUrl,
    timeout: Duration,
    declare: impl AsyncFn(&Connection) -> Result<T>,
) -> Result<T> {
    let urls = broker_urls(amqp_url)?;
    let (mut start, mut attempts_left) = (0, urls.len());
    loop {
        let props =
            ConnectionProperties::default().with_connection_name("outbox-consumer topology".into());
        let (conn, link, i) = outbox_core::amqp::connect_any(&urls, start, timeout, props).await?;
        let declared = declare(&conn).await;
        link.close(&conn, timeout).await;
        attempts_left -= 1;
        match declared {
            Err(e) if e.is_transient() && attempts_left > 0 => {
                let node = outbox::urls::host_port(urls[i]);
                tracing::debug!(broker = %node, error = %e, "declaring the topology failed; trying the next node");
                start = i + 1;
            }
            done => return done,
        }
    }
}

/// The URLs of `amqp_url`, each checked before anything connects with it:
/// lapin's own error for a malformed one would quote it, password and all.
fn broker_urls(amqp_url: &SecretUrl) -> Result<Vec<&str>> {
    let list = amqp_url.expose();
    outbox::urls::check_urls(list, "AMQP URL", &["amqp", "amqps"]).map_err(Error::Config)?;
    let urls = outbox::urls::split_urls(list);
    if urls
        .iter()
        .any(|u| u.parse::<lapin::uri::AMQPUri>().is_err())
    {
        return Err(Error::Config(
            "AMQP URL is malformed (its user, host, vhost or query parameters); the value is not shown: it may hold a password".to_owned(),
        ));
    }
    Ok(urls)
}
