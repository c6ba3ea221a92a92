//! A database of one test's own, for what looks at a whole database (every
//! schema in it, a fleet's tenants) where the shared test database holds
//! every other test's schemas too.

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool};

use crate::{database_url, suffix};

/// A database `t_<prefix>_<random>` on the test server, created empty,
/// with a pool on it. [`cleanup`](Self::cleanup) drops it, ending the
/// sessions still in it; so does dropping it (a panicking test), from a
/// thread of its own.
#[derive(Debug)]
pub struct TestDatabase {
    /// Its name.
    pub name: String,
    /// Its URL (the test server's, this database's name in its path).
    pub url: String,
    /// A pool on it, for the test's own statements.
    pub pool: PgPool,
    dropped: bool,
}

impl TestDatabase {
    /// A new empty database.
    pub async fn create(prefix: &str) -> Self {
        let name = format!("t_{prefix}_{}", suffix());
        run_on_server(&format!("CREATE DATABASE \"{name}\"")).await;
        let url = url_of(&name);
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .acquire_timeout(Duration::from_secs(30))
            .connect(&url)
            .await
            .expect("the new test database");
        Self {
            name,
            url,
            pool,
            dropped: false,
        }
    }

    /// Drops it, ending every session still in it.
    pub async fn cleanup(mut self) {
        self.pool.close().await;
        run_on_server(&drop_statement(&self.name)).await;
        self.dropped = true;
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        if self.dropped {
            return;
        }
        let statement = drop_statement(&self.name);
        // No runtime to await on here (and the test's may be the one
        // panicking): a thread with a runtime of its own.
        let dropped = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime for the cleanup")
                .block_on(run_on_server(&statement));
        })
        .join();
        if dropped.is_err() {
            eprintln!("TestDatabase: {} not dropped", self.name);
        }
    }
}

fn drop_statement(name: &str) -> String {
    format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)")
}

/// The test database's URL with `name` in its path.
fn url_of(name: &str) -> String {
    let url = database_url();
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base.to_owned(), format!("?{query}")),
        None => (url.clone(), String::new()),
    };
    let (server, _) = base.rsplit_once('/').expect("a database URL with a path");
    format!("{server}/{name}{query}")
}

/// `statement` on a connection of its own to the test database (CREATE and
/// DROP DATABASE run outside a transaction).
async fn run_on_server(statement: &str) {
    let options: PgConnectOptions = database_url().parse().expect("TEST_DATABASE_URL");
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(options.application_name("test-database"))
        .await
        .expect("test database reachable (run `make services`)");
    sqlx::raw_sql(AssertSqlSafe(statement.to_owned()))
        .execute(&pool)
        .await
        .unwrap_or_else(|e| panic!("{statement}: {e}"));
    pool.close().await;
}
