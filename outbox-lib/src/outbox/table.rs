//! [`Capture::Table`]: events as rows of the outbox table.

use outbox_core::Ident;
use sqlx::{PgConnection, SqlStr};
use uuid::Uuid;

use super::statements::{insert_many_sql, insert_one_sql};
use crate::error::Result;
use crate::event::NewEvent;

#[cfg(doc)]
use super::config::Capture;
#[cfg(doc)]
use crate::wakeup::Wakeup;

/// Writes events as rows of the outbox table.
#[derive(Debug)]
pub(super) struct TableWriter {
    insert_one: SqlStr,
    /// Array binds: any number of events, one statement.
    insert_many: SqlStr,
    /// With [`Wakeup::InTransaction`]: the channel the caller's
    /// transaction notifies.
    notify: Option<String>,
}

impl TableWriter {
    pub(super) fn new(schema: &Ident, notify: Option<String>) -> Self {
        Self {
            insert_one: insert_one_sql(schema),
            insert_many: insert_many_sql(schema),
            notify,
        }
    }

    /// Inserts one validated event and returns its id.
    pub(super) async fn insert_one(
        &self,
        conn: &mut PgConnection,
        event: NewEvent,
    ) -> Result<Uuid> {
        // A plain VALUES insert: cheaper for the database than the unnest
        // form for one row (measured: about 20% more producer
        // transactions per second with 8 writers). The database numbers an
        // event of an ordered type (trigger `outbox_number_ordered`); an id
        // already in the outbox takes no number.
        sqlx::query(self.insert_one.clone())
            .bind(event.id)
            .bind(&event.aggregate_type)
            .bind(&event.aggregate_id)
            .bind(&event.event_type)
            .bind(&event.payload)
            .bind(serde_json::Value::Object(event.headers).to_string())
            .bind(&event.exchange)
            .bind(&event.routing_key)
            .execute(&mut *conn)
            .await?;
        self.notify_in_transaction(conn).await?;
        Ok(event.id)
    }

    /// Inserts validated events (at least one) with one statement and
    /// returns their ids in input order.
    pub(super) async fn insert_many(
        &self,
        conn: &mut PgConnection,
        events: Vec<NewEvent>,
    ) -> Result<Vec<Uuid>> {
        let n = events.len();
        let mut ids = Vec::with_capacity(n);
        let mut agg_types = Vec::with_capacity(n);
        let mut agg_ids = Vec::with_capacity(n);
        let mut types = Vec::with_capacity(n);
        let mut payloads = Vec::with_capacity(n);
        let mut headers = Vec::with_capacity(n);
        let mut exchanges = Vec::with_capacity(n);
        let mut keys = Vec::with_capacity(n);
        for e in events {
            ids.push(e.id);
            agg_types.push(e.aggregate_type);
            agg_ids.push(e.aggregate_id);
            types.push(e.event_type);
            payloads.push(e.payload);
            headers.push(serde_json::Value::Object(e.headers).to_string());
            exchanges.push(e.exchange);
            keys.push(e.routing_key);
        }
        sqlx::query(self.insert_many.clone())
            .bind(&ids)
            .bind(&agg_types)
            .bind(&agg_ids)
            .bind(&types)
            .bind(&payloads)
            .bind(&headers)
            .bind(&exchanges)
            .bind(&keys)
            .execute(&mut *conn)
            .await?;
        self.notify_in_transaction(conn).await?;
        Ok(ids)
    }

    /// With [`Wakeup::InTransaction`]: NOTIFY in the caller's transaction.
    async fn notify_in_transaction(&self, conn: &mut PgConnection) -> Result<()> {
        if let Some(channel) = &self.notify {
            sqlx::query("SELECT pg_notify($1, '')")
                .bind(channel)
                .execute(&mut *conn)
                .await?;
        }
        Ok(())
    }
}
