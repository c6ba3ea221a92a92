//! A schema per tenant, from the command line: `outbox-relay schemas`
//! finds them and says where each one's migrations stand, and `migrate
//! --all-schemas` / `--schemas-file` migrates many at once, each reported,
//! one failure stopping no other. Each test's tenants carry a prefix of
//! their own (`--like` keeps every other test's schemas out), in the test
//! database; the test of the database-wide lock has a database of its own.

use std::process::Command;
use std::time::Duration;

use e2e::{TestDatabase, database_url, output, suffix, wait_until};
use sqlx::{AssertSqlSafe, PgPool};

const BIN: &str = env!("CARGO_BIN_EXE_outbox-relay");

/// The producer migration an older release stopped at.
const OLD: i32 = 5;

/// The database-wide migration lock's key (outbox-core's
/// `MIGRATION_LOCK_KEY`), as releases before the per-schema locks took it.
const DATABASE_WIDE_LOCK: i64 = 0x6f75_7462_6f78_2d6d;

/// `outbox-relay` with `args` on `url`: its exit code and its output.
fn relay(url: &str, args: &[&str]) -> (Option<i32>, String) {
    output(
        Command::new(BIN)
            .env("DATABASE_URL", url)
            .env("RUST_LOG", "warn")
            .args(args),
    )
}

/// `outbox-relay schemas --like <like> --json`: each schema's name, state
/// and version.
fn census(url: &str, like: &str) -> Vec<(String, String, Option<i64>)> {
    let (code, text) = relay(url, &["schemas", "--like", like, "--json"]);
    assert_eq!(code, Some(0), "{text}");
    let json = text.lines().find(|l| l.starts_with('[')).expect(&text);
    let rows: serde_json::Value = serde_json::from_str(json).expect(&text);
    rows.as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["schema"].as_str().unwrap().to_owned(),
                r["state"].as_str().unwrap().to_owned(),
                r["version"].as_i64(),
            )
        })
        .collect()
}

async fn exec(pool: &PgPool, sql: &str) {
    sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
        .execute(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// A prefix of this test's own (`t_<random>`), and its schemas dropped at
/// the end (`make clean-test-schemas` drops a failed run's).
struct Tenants {
    prefix: String,
    pool: PgPool,
}

impl Tenants {
    async fn new() -> Self {
        Self {
            prefix: format!("t_{}", suffix()),
            pool: e2e::pool("tenants", 4).await,
        }
    }

    fn name(&self, tenant: &str) -> String {
        format!("{}_{tenant}", self.prefix)
    }

    /// The pattern of this test's schemas.
    fn like(&self) -> String {
        format!("{}\\_%", self.prefix)
    }

    async fn cleanup(self) {
        let names: Vec<String> =
            sqlx::query_scalar("SELECT nspname::text FROM pg_namespace WHERE nspname LIKE $1")
                .bind(format!("{}%", self.prefix))
                .fetch_all(&self.pool)
                .await
                .unwrap();
        for name in names {
            exec(&self.pool, &format!("DROP SCHEMA \"{name}\" CASCADE")).await;
        }
    }
}

#[tokio::test]
async fn schemas_are_found_and_every_tenant_is_upgraded_by_two_runs_at_once() {
    let t = Tenants::new().await;
    let url = database_url();
    assert!(census(&url, &t.like()).is_empty(), "no tenant yet");
    // Eight tenants an older release migrated, two current, one a newer
    // release migrated, and a schema the pattern leaves out.
    for i in 0..8 {
        outbox::testing::migrate_to(&t.pool, &t.name(&format!("{i:02}")), OLD)
            .await
            .unwrap();
    }
    for i in 8..11 {
        outbox::migrate(&t.pool, &t.name(&format!("{i:02}")))
            .await
            .unwrap();
    }
    exec(&t.pool, &format!("INSERT INTO {}.outbox_toolkit_migrations (migration_set, version, name) VALUES ('producer', 999, 'from the future')", t.name("10"))).await;
    let other = format!("{}x", t.prefix);
    outbox::testing::migrate_to(&t.pool, &other, OLD)
        .await
        .unwrap();
    // A consumer's schema alone (its inbox) holds no outbox.
    outbox_consumer::migrate(&t.pool, &t.name("inbox"))
        .await
        .unwrap();

    let found = census(&url, &t.like());
    let names: Vec<&str> = found.iter().map(|(s, _, _)| s.as_str()).collect();
    let all: Vec<String> = (0..11).map(|i| t.name(&format!("{i:02}"))).collect();
    assert_eq!(names, all);
    for (schema, state, version) in &found {
        let want = match &schema[schema.len() - 2..] {
            "08" | "09" => "current",
            "10" => "too_new",
            _ => "behind",
        };
        assert_eq!(state, want, "{schema}: {found:?}");
        if want == "behind" {
            assert_eq!(*version, Some(i64::from(OLD)), "{schema}");
        }
    }
    let (code, text) = relay(&url, &["schemas", "--like", &t.like()]);
    assert_eq!(code, Some(0), "{text}");
    assert!(
        text.lines()
            .any(|l| l.starts_with(&all[0]) && l.contains("behind (version 5 of")),
        "{text}"
    );

    // Two runs at once over the same schemas: each migration is applied
    // once (a second apply would break the ledger's key or find its
    // tables there), every tenant is reported, and the one too new fails
    // both runs and stops no other.
    let like = t.like();
    let args = ["migrate", "--all-schemas", "--like", &like, "--jobs", "4"];
    let (first, second) = std::thread::scope(|s| {
        let second = s.spawn(|| relay(&url, &args));
        (relay(&url, &args), second.join().unwrap())
    });
    for (code, text) in [&first, &second] {
        assert_eq!(*code, Some(1), "{text}");
        for name in &all {
            assert!(
                text.contains(&format!("{name}: ")),
                "{name} unreported:\n{text}"
            );
        }
        assert!(text.contains(&format!("{}: failed:", all[10])), "{text}");
        assert!(
            text.contains("11 schemas:") && text.contains(", 1 failed"),
            "{text}"
        );
        let last = text.lines().last().unwrap();
        assert!(
            last.contains(&format!("1 of 11 schemas failed to migrate ({})", all[10])),
            "{text}"
        );
    }
    let migrated = [&first.1, &second.1]
        .iter()
        .flat_map(|t| t.lines())
        .filter(|l| l.contains(": applied migrations ["))
        .count();
    assert_eq!(
        migrated, 8,
        "each tenant behind migrated by one run:\n{}\n{}",
        first.1, second.1
    );
    let latest = outbox::census(&t.pool, Some(&t.like())).await.unwrap();
    assert_eq!(latest.len(), 11);
    for s in &latest[..10] {
        assert!(
            matches!(s.state, outbox::SchemaState::Current(_)),
            "{s:?} not current"
        );
        let applied: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM \"{}\".outbox_toolkit_migrations WHERE migration_set = 'producer'",
            s.schema
        )))
        .fetch_one(&t.pool)
        .await
        .unwrap();
        let outbox::SchemaState::Current(v) = s.state else {
            unreachable!()
        };
        assert_eq!(applied, i64::from(v), "{}: each migration once", s.schema);
    }
    assert!(
        matches!(
            latest[10].state,
            outbox::SchemaState::TooNew { found: 999, .. }
        ),
        "{:?}",
        latest[10]
    );
    // The pattern left the other schema alone.
    assert_eq!(census(&url, &other)[0].1, "behind");
    t.cleanup().await;
}

#[tokio::test]
async fn a_schema_this_role_may_not_read_is_listed_and_hides_no_other() {
    let t = Tenants::new().await;
    let (a, b) = (t.name("a"), t.name("b"));
    for name in [&a, &b] {
        outbox::migrate(&t.pool, name).await.unwrap();
    }
    let role = format!("t_reader_{}", suffix());
    exec(
        &t.pool,
        &format!("CREATE ROLE \"{role}\" LOGIN PASSWORD 'reader-pw'"),
    )
    .await;
    let grant = |schema: &str| {
        format!(
            "GRANT USAGE ON SCHEMA \"{schema}\" TO \"{role}\"; GRANT SELECT ON \"{schema}\".outbox_toolkit_migrations TO \"{role}\""
        )
    };
    exec(&t.pool, &grant(&a)).await;
    let mut url = url::Url::parse(&database_url()).unwrap();
    url.set_username(&role).unwrap();
    url.set_password(Some("reader-pw")).unwrap();
    let url = url.to_string();
    let found = census(&url, &t.like());
    assert_eq!(found.len(), 2, "{found:?}");
    assert_eq!(
        (found[0].0.as_str(), found[0].1.as_str()),
        (a.as_str(), "current"),
        "{found:?}"
    );
    assert_eq!(
        (found[1].0.as_str(), found[1].1.as_str(), found[1].2),
        (b.as_str(), "unreadable", None),
        "{found:?}"
    );
    // Its grant back: read again.
    exec(&t.pool, &grant(&b)).await;
    assert_eq!(census(&url, &t.like())[1].1, "current");
    let pool = t.pool.clone();
    t.cleanup().await;
    exec(&pool, &format!("DROP ROLE \"{role}\"")).await;
}

#[tokio::test]
async fn a_schemas_file_sets_up_new_tenants_and_a_bad_name_stops_the_run_before_it_starts() {
    let t = Tenants::new().await;
    let url = database_url();
    let dir = std::env::temp_dir().join(format!("outbox-tenants-{}", suffix()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("tenants.txt");
    let (acme, globex) = (t.name("acme"), t.name("globex"));
    let names = format!("# tenants\n{acme}\n\n  {globex}  \n{acme}\n");
    std::fs::write(&file, format!("{names}bad-name!\n")).unwrap();
    let path = file.to_str().unwrap();
    let (code, text) = relay(&url, &["migrate", "--schemas-file", path]);
    assert_eq!(code, Some(1), "{text}");
    assert_eq!(text.trim().lines().count(), 1, "one line: {text}");
    assert!(text.contains("tenants.txt, line 6"), "{text}");
    assert!(census(&url, &t.like()).is_empty(), "nothing migrated");

    std::fs::write(&file, &names).unwrap();
    let (code, text) = relay(&url, &["migrate", "--schemas-file", path]);
    assert_eq!(code, Some(0), "{text}");
    assert!(
        text.contains("2 schemas: 2 migrated, 0 up to date, 0 failed"),
        "{text}"
    );
    let found = census(&url, &t.like());
    assert_eq!(
        found
            .iter()
            .map(|(s, st, _)| (s.as_str(), st.as_str()))
            .collect::<Vec<_>>(),
        [(acme.as_str(), "current"), (globex.as_str(), "current")]
    );
    let (code, text) = relay(&url, &["migrate", "--schemas-file", path]);
    assert_eq!(code, Some(0), "{text}");
    assert!(
        text.contains("2 schemas: 0 migrated, 2 up to date, 0 failed"),
        "{text}"
    );
    let (code, text) = relay(
        &url,
        &["migrate", "--schemas-file", path, "--capture", "wal"],
    );
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains("one schema's replication slot at a time"),
        "{text}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
    t.cleanup().await;
}

/// A release from before the per-schema locks takes the database-wide
/// migration lock exclusively: a run of this one waits for it (and it for
/// this one), so the two never migrate one schema at once. In a database
/// of its own: the lock held here would stall every other test's
/// migrations.
#[tokio::test]
async fn a_run_waits_for_an_older_release_holding_the_database_wide_lock() {
    let db = TestDatabase::create("tenants_lock").await;
    let mut old = db.pool.acquire().await.unwrap();
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(DATABASE_WIDE_LOCK)
        .execute(&mut *old)
        .await
        .unwrap();
    let dir = std::env::temp_dir().join(format!("outbox-lock-{}", suffix()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("tenants.txt");
    std::fs::write(&file, "acme\n").unwrap();
    let run = {
        let (url, file) = (db.url.clone(), file.clone());
        std::thread::spawn(move || {
            relay(&url, &["migrate", "--schemas-file", file.to_str().unwrap()])
        })
    };
    wait_until(
        Duration::from_secs(30),
        "the run waiting for the lock",
        || async {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
                 WHERE l.locktype = 'advisory' AND NOT l.granted AND a.application_name = 'outbox-relay'
                   AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            )
            .fetch_one(&db.pool)
            .await
            .unwrap();
            waiting == 1
        },
    )
    .await;
    assert!(
        outbox::census(&db.pool, None).await.unwrap().is_empty(),
        "nothing migrated while the older release holds the lock"
    );
    sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(DATABASE_WIDE_LOCK)
        .execute(&mut *old)
        .await
        .unwrap();
    let (code, text) = tokio::task::spawn_blocking(move || run.join().unwrap())
        .await
        .unwrap();
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("acme: applied migrations"), "{text}");
    drop(old);
    std::fs::remove_dir_all(&dir).unwrap();
    db.cleanup().await;
}

#[tokio::test]
async fn status_of_every_tenant_sums_them_shows_the_worst_first_and_lists_what_it_cannot_read() {
    let t = Tenants::new().await;
    let url = database_url();
    let (old, busy, idle, broken) = (
        t.name("old"),
        t.name("busy"),
        t.name("idle"),
        t.name("broken"),
    );
    for name in [&old, &busy, &idle, &broken] {
        outbox::migrate(&t.pool, name).await.unwrap();
    }
    let behind = t.name("behind");
    outbox::testing::migrate_to(&t.pool, &behind, OLD)
        .await
        .unwrap();
    // `old`: 2 events, the oldest written an hour ago; `busy`: 5 events
    // a minute old; `idle`: none; `broken`: its dead letters' table gone.
    let insert = |schema: &str, n: usize, age: &str| {
        format!(
            "INSERT INTO \"{schema}\".outbox (aggregate_type, aggregate_id, event_type, payload, created_at, available_at)
             SELECT 'order', 'o-' || i, 'OrderPlaced', '{{}}', now() - interval '{age}', now() - interval '{age}'
             FROM generate_series(1, {n}) i"
        )
    };
    exec(&t.pool, &insert(&old, 2, "1 hour")).await;
    exec(&t.pool, &insert(&busy, 5, "1 minute")).await;
    exec(
        &t.pool,
        &format!("DROP TABLE \"{broken}\".outbox_dead_letters CASCADE"),
    )
    .await;

    let (code, text) = relay(
        &url,
        &["status", "--all-schemas", "--like", &t.like(), "--json"],
    );
    assert_eq!(code, Some(0), "{text}");
    let json = &text[text.find('{').expect(&text)..];
    let s: serde_json::Value = serde_json::from_str(json).expect(&text);
    assert_eq!(s["schemas"], 5, "{s}");
    assert_eq!(s["totals"]["backlog"], 7, "{s}");
    assert!(
        s["totals"]["oldest_pending_age_s"].as_f64().unwrap() >= 3600.0,
        "{s}"
    );
    let worst: Vec<&str> = s["worst"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["schema"].as_str().unwrap())
        .collect();
    assert_eq!(
        worst,
        [old.as_str(), busy.as_str(), idle.as_str()],
        "oldest first: {s}"
    );
    assert_eq!(s["not_current"][0]["schema"], behind.as_str(), "{s}");
    assert!(
        s["not_current"][0]["why"]
            .as_str()
            .unwrap()
            .starts_with("behind"),
        "{s}"
    );
    assert_eq!(s["not_read"][0]["schema"], broken.as_str(), "{s}");
    assert!(
        s["not_read"][0]["why"]
            .as_str()
            .unwrap()
            .contains("outbox_dead_letters"),
        "{s}"
    );

    let (code, text) = relay(
        &url,
        &[
            "status",
            "--all-schemas",
            "--like",
            &t.like(),
            "--worst",
            "1",
        ],
    );
    assert_eq!(code, Some(0), "{text}");
    assert!(text.starts_with("5 schemas: backlog 7 (7 due)"), "{text}");
    assert!(text.lines().any(|l| l.starts_with(old.as_str())), "{text}");
    assert!(
        !text.lines().any(|l| l.starts_with(busy.as_str())),
        "{text}"
    );
    assert!(text.contains("(and 2 more, in the totals"), "{text}");
    assert!(
        text.contains("not current:") && text.contains("not read:"),
        "{text}"
    );
    t.cleanup().await;
}
