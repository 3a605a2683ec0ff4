//! The PostgreSQL store for shared schedules: the leaky bucket in a
//! table, one row per client key holding its D.
//!
//! Admission is one call of a function sluice installs (`sluice_admit`,
//! one round trip): it locks the client's row, then reads the database's
//! `clock_timestamp()` (after the lock, so a call that waited for the row
//! never decides with an earlier clock than the one before it), applies
//! DESIGN section 1 exactly as the Redis script does and returns the same
//! four numbers. With an upstream cap, the function first takes the cap's
//! lock (a transaction-scoped advisory lock on the calendar's name) and
//! reserves the first run of free slots in `sluice_slots`, so one client's
//! backlog never pushes other clients' departures back. The cancel is a
//! compare-and-set in `sluice_cancel`, taking the locks in the same order.
//!
//! Expired rows (a D more than a second in the past is the same as no
//! row) are deleted by a bounded sweep every few seconds that skips rows
//! an admission holds (`FOR UPDATE SKIP LOCKED`), so it never blocks one.
//!
//! Connections: a deadpool pool of tokio-postgres clients. Every call runs
//! on the runtime the store was made on (the daemon's main runtime), so a
//! connection's I/O never depends on a worker thread's runtime.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use deadpool_postgres::{Hook, HookError, Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio::runtime::Handle;
use tokio_postgres::config::Host;
use tokio_postgres_rustls::MakeRustlsConnect;
use tracing::{info, warn};

use super::{Ask, ClusterError, Reservation, Trouble};
use crate::config::PostgresConfig;
use crate::config::postgres::SslMode;

/// The schema: tables and functions, created if missing. `{persistence}`
/// is `UNLOGGED` unless `durable = true`.
/// Pool connections made at once when the pool is warmed.
const WARM_AT_ONCE: usize = 4;

const SCHEMA: &str = r#"
CREATE {persistence}TABLE IF NOT EXISTS sluice_schedules (
    k text PRIMARY KEY,
    d bigint NOT NULL,
    expires_us bigint NOT NULL
) WITH (fillfactor = 70);

CREATE {persistence}TABLE IF NOT EXISTS sluice_slots (
    cal text NOT NULL,
    slot bigint NOT NULL,
    expires_us bigint NOT NULL,
    PRIMARY KEY (cal, slot)
);

-- The database's clock in microseconds since the epoch, exact on every
-- version (extract returns float8 before PostgreSQL 14).
CREATE OR REPLACE FUNCTION sluice_now_us() RETURNS bigint
LANGUAGE sql VOLATILE AS $fn$
    SELECT extract(epoch FROM date_trunc('second', t))::bigint * 1000000
         + extract(microseconds FROM t)::bigint % 1000000
    FROM (SELECT clock_timestamp() AS t) c
$fn$;

-- Admission (DESIGN section 1). Arguments in microseconds; p_cal NULL
-- when the upstream is not capped. Returns {verdict, value, new D, first
-- slot}: 1 = go after value; 0 = queue full, retry after value; 2 =
-- departure past max_wait, retry after value.
CREATE OR REPLACE FUNCTION sluice_admit(
    p_key text, p_cal text, p_step bigint, p_cap bigint, p_cost bigint,
    p_tau bigint, p_gstep bigint, p_max_wait bigint
) RETURNS bigint[] LANGUAGE plpgsql AS $fn$
DECLARE
    v_d bigint;
    v_now bigint;
    v_own bigint;
    v_waiting bigint := 0;
    v_due bigint;
    v_slot bigint;
    v_first bigint := -1;
    v_at bigint;
    v_new bigint;
    v_taken bigint;
    v_scanned integer := 0;
    v_tries integer := 0;
BEGIN
    IF p_cal IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(hashtextextended(p_cal, 0));
    END IF;
    LOOP
        SELECT s.d INTO v_d FROM sluice_schedules s WHERE s.k = p_key FOR UPDATE;
        EXIT WHEN FOUND;
        INSERT INTO sluice_schedules AS s (k, d, expires_us) VALUES (p_key, 0, 0)
            ON CONFLICT (k) DO NOTHING RETURNING s.d INTO v_d;
        EXIT WHEN FOUND;
        v_tries := v_tries + 1;
        IF v_tries > 10 THEN
            RAISE EXCEPTION 'sluice_admit: cannot lock the row of %', p_key;
        END IF;
    END LOOP;
    v_now := sluice_now_us();
    v_own := v_d - p_tau;
    IF v_own > v_now THEN
        v_waiting := (v_own - v_now + p_step - 1) / p_step - 1;
    END IF;
    v_due := greatest(v_own, v_now);
    IF p_cal IS NOT NULL THEN
        -- the first run of p_cost free slots from the one v_due falls in:
        -- a free slot lets v_due stand; a later one moves it to its start
        v_slot := v_due / p_gstep;
        FOR v_taken IN
            SELECT z.slot FROM sluice_slots z
            WHERE z.cal = p_cal AND z.slot >= v_slot ORDER BY z.slot
        LOOP
            EXIT WHEN v_taken >= v_slot + p_cost;
            v_slot := v_taken + 1;
            v_scanned := v_scanned + 1;
            EXIT WHEN v_scanned > 100000;
        END LOOP;
        v_first := v_slot;
        v_due := greatest(v_due, v_slot * p_gstep);
    END IF;
    IF v_due > v_now AND v_waiting + p_cost > p_cap THEN
        v_at := v_own - (p_cap - p_cost + 1) * p_step;
        IF p_cost > p_cap THEN
            v_at := v_own;
        END IF;
        RETURN ARRAY[0, greatest(v_at - v_now, 1), 0, 0];
    END IF;
    IF p_max_wait > 0 AND v_due - v_now > p_max_wait THEN
        RETURN ARRAY[2, v_due - p_max_wait - v_now, 0, 0];
    END IF;
    v_new := greatest(v_d, v_due) + p_cost * p_step;
    UPDATE sluice_schedules SET d = v_new, expires_us = v_new + 1000000 WHERE k = p_key;
    IF p_cal IS NOT NULL THEN
        INSERT INTO sluice_slots (cal, slot, expires_us)
            SELECT p_cal, g, (g + 1) * p_gstep + 1000000
            FROM generate_series(v_first, v_first + p_cost - 1) g;
    END IF;
    RETURN ARRAY[1, v_due - v_now, v_new, v_first];
END
$fn$;

-- Cancel: the client's D goes back only while this reservation is still
-- its last (compare-and-set); the cap slots always go back. Locks in the
-- admission's order (cap, row, slots). (Schema 1; sluice_withdraw, of
-- schema 2, is what sluice calls when it is there.)
CREATE OR REPLACE FUNCTION sluice_cancel(
    p_key text, p_cal text, p_new_d bigint, p_undo bigint, p_first bigint, p_cost bigint
) RETURNS integer LANGUAGE plpgsql AS $fn$
DECLARE
    v_undone integer;
BEGIN
    IF p_cal IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(hashtextextended(p_cal, 0));
    END IF;
    UPDATE sluice_schedules SET d = d - p_undo WHERE k = p_key AND d = p_new_d;
    GET DIAGNOSTICS v_undone = ROW_COUNT;
    IF p_cal IS NOT NULL THEN
        DELETE FROM sluice_slots
        WHERE cal = p_cal AND slot >= p_first AND slot < p_first + p_cost;
    END IF;
    RETURN v_undone;
END
$fn$;

-- The sweep: at most p_limit expired rows of each table, skipping rows
-- an admission holds. Returns how many went.
CREATE OR REPLACE FUNCTION sluice_sweep(p_limit integer) RETURNS bigint
LANGUAGE plpgsql AS $fn$
DECLARE
    v_now bigint := sluice_now_us();
    v_rows bigint;
    v_slots bigint;
BEGIN
    DELETE FROM sluice_schedules WHERE k IN (
        SELECT k FROM sluice_schedules WHERE expires_us < v_now
        LIMIT p_limit FOR UPDATE SKIP LOCKED);
    GET DIAGNOSTICS v_rows = ROW_COUNT;
    DELETE FROM sluice_slots WHERE (cal, slot) IN (
        SELECT cal, slot FROM sluice_slots WHERE expires_us < v_now
        LIMIT p_limit FOR UPDATE SKIP LOCKED);
    GET DIAGNOSTICS v_slots = ROW_COUNT;
    RETURN v_rows + v_slots;
END
$fn$;

COMMENT ON FUNCTION sluice_admit(text, text, bigint, bigint, bigint, bigint, bigint, bigint)
    IS 'sluice schema 1';
"#;

/// What schema 2 adds, beside schema 1 (which it leaves as it is: an
/// instance of the version before, during a rolling upgrade, finds schema 1
/// as it wants it and changes nothing; were schema 1's functions replaced,
/// it would put its own back at each check, and the two versions would
/// replace each other's every few seconds).
const SCHEMA_V2: &str = r#"
-- Reservations given back while a later one of the client was still
-- ahead of them, by the D they left: the client's D goes back past them
-- when it comes to them (see sluice_withdraw).
CREATE {persistence}TABLE IF NOT EXISTS sluice_holes (
    k text NOT NULL,
    new_d bigint NOT NULL,
    undo bigint NOT NULL,
    expires_us bigint NOT NULL,
    PRIMARY KEY (k, new_d)
);

-- Withdraw: the client's D goes back while this reservation is its last,
-- and then past every hole it comes to (reservations given back while a
-- later one was still ahead of them: several calls late together are
-- given back in the order they were made); one still behind a later
-- reservation is kept as a hole. The cap slots always go back. Locks in
-- the admission's order (cap, row, slots).
CREATE OR REPLACE FUNCTION sluice_withdraw(
    p_key text, p_cal text, p_new_d bigint, p_undo bigint, p_first bigint, p_cost bigint
) RETURNS integer LANGUAGE plpgsql AS $fn$
DECLARE
    v_undone integer := 0;
    v_d bigint;
    v_expires bigint;
    v_undo bigint;
BEGIN
    IF p_cal IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(hashtextextended(p_cal, 0));
    END IF;
    SELECT d, expires_us INTO v_d, v_expires FROM sluice_schedules
    WHERE k = p_key FOR UPDATE;
    IF v_d = p_new_d THEN
        v_d := v_d - p_undo;
        LOOP
            DELETE FROM sluice_holes WHERE k = p_key AND new_d = v_d
            RETURNING undo INTO v_undo;
            EXIT WHEN NOT FOUND;
            v_d := v_d - v_undo;
        END LOOP;
        UPDATE sluice_schedules SET d = v_d WHERE k = p_key;
        v_undone := 1;
    ELSIF v_d > p_new_d THEN
        INSERT INTO sluice_holes (k, new_d, undo, expires_us)
        VALUES (p_key, p_new_d, p_undo, v_expires)
        ON CONFLICT (k, new_d) DO NOTHING;
    END IF;
    IF p_cal IS NOT NULL THEN
        DELETE FROM sluice_slots
        WHERE cal = p_cal AND slot >= p_first AND slot < p_first + p_cost;
    END IF;
    RETURN v_undone;
END
$fn$;

-- Expired holes, at most p_limit, as sluice_sweep does the rest.
CREATE OR REPLACE FUNCTION sluice_sweep_holes(p_limit integer) RETURNS bigint
LANGUAGE plpgsql AS $fn$
DECLARE
    v_holes bigint;
BEGIN
    DELETE FROM sluice_holes WHERE (k, new_d) IN (
        SELECT k, new_d FROM sluice_holes WHERE expires_us < sluice_now_us()
        LIMIT p_limit FOR UPDATE SKIP LOCKED);
    GET DIAGNOSTICS v_holes = ROW_COUNT;
    RETURN v_holes;
END
$fn$;

COMMENT ON FUNCTION sluice_withdraw(text, text, bigint, bigint, bigint, bigint)
    IS 'sluice schema 2';
"#;

/// The objects `SCHEMA` makes, as `to_regclass` / `to_regprocedure` name
/// them, and its version (the admission function's comment): when all
/// exist and the version is this one, a start changes nothing.
const OBJECTS: &str = "SELECT to_regclass('sluice_schedules') IS NOT NULL
    AND to_regclass('sluice_slots') IS NOT NULL
    AND to_regprocedure('sluice_now_us()') IS NOT NULL
    AND to_regprocedure('sluice_admit(text,text,bigint,bigint,bigint,bigint,bigint,bigint)') IS NOT NULL
    AND to_regprocedure('sluice_cancel(text,text,bigint,bigint,bigint,bigint)') IS NOT NULL
    AND to_regprocedure('sluice_sweep(integer)') IS NOT NULL
    AND obj_description(to_regprocedure(
        'sluice_admit(text,text,bigint,bigint,bigint,bigint,bigint,bigint)'), 'pg_proc')
        IS NOT DISTINCT FROM 'sluice schema 1'";

/// [`OBJECTS`] for what [`SCHEMA_V2`] adds, and that the role may use it
/// (a DBA who applied it may not have granted the new table: a withdrawal
/// would then fail where `sluice_cancel` works). `has_table_privilege`
/// with several privileges answers whether any is held: one each.
const OBJECTS_V2: &str = "SELECT coalesce(to_regclass('sluice_holes') IS NOT NULL
    AND has_table_privilege(to_regclass('sluice_holes'), 'SELECT')
    AND has_table_privilege(to_regclass('sluice_holes'), 'INSERT')
    AND has_table_privilege(to_regclass('sluice_holes'), 'DELETE')
    AND to_regprocedure('sluice_withdraw(text,text,bigint,bigint,bigint,bigint)') IS NOT NULL
    AND to_regprocedure('sluice_sweep_holes(integer)') IS NOT NULL
    AND obj_description(to_regprocedure(
        'sluice_withdraw(text,text,bigint,bigint,bigint,bigint)'), 'pg_proc')
        IS NOT DISTINCT FROM 'sluice schema 2', false)";

/// Serialises schema changes between instances starting at once.
const MIGRATION_LOCK: i64 = 0x736c_7569_6365; // "sluice"

const ADMIT: &str = "SELECT sluice_admit($1, $2, $3, $4, $5, $6, $7, $8)";
const CANCEL: &str = "SELECT sluice_cancel($1, $2, $3, $4, $5, $6)";
const WITHDRAW: &str = "SELECT sluice_withdraw($1, $2, $3, $4, $5, $6)";

/// Rows the sweep deletes per call (of each table), and how long a sweep
/// goes on making calls while they find full batches. (It was 20 calls of
/// 1,000 rows: 4,000 rows a second, which one instance's churn of new keys
/// can outgrow; the table then grew for as long as the load lasted.) A
/// batch stays small: an admission of a client whose expired row it holds
/// waits for it.
const SWEEP_BATCH: i32 = 1_000;
const SWEEP_FOR: Duration = Duration::from_secs(3);
/// The most a sweep's last batch may take past [`SWEEP_FOR`].
const SWEEP_LAST: Duration = Duration::from_secs(2);
/// How often the schema is checked and expired rows are swept.
const SWEEP_EVERY: Duration = Duration::from_secs(5);
/// The longest a check (at start, then every [`SWEEP_EVERY`]) may take.
const UPKEEP_LIMIT: Duration = Duration::from_secs(10);

/// The SQL that `sluice migrate` applies (and `--print-sql` prints).
pub fn schema_sql(durable: bool) -> String {
    persistence(&format!("{SCHEMA}{SCHEMA_V2}"), durable)
}

fn persistence(sql: &str, durable: bool) -> String {
    sql.replace("{persistence}", if durable { "" } else { "UNLOGGED " })
}

/// The PostgreSQL store.
pub struct Postgres {
    pool: Pool,
    /// For the schema check and the sweep (their own connections, with
    /// their own statement timeout).
    pg: tokio_postgres::Config,
    tls: MakeRustlsConnect,
    durable: bool,
    shown: String,
    /// Where a new connection's password is read again.
    secret: Secret,
    /// The runtime every call runs on.
    runtime: Handle,
    timeout: Duration,
    /// Why the store cannot be used as configured, while it cannot.
    problem: super::Problem,
    /// What the checks write ([`super::health_key`]).
    health: String,
    /// Schema 2 is in place: withdrawals keep holes ([`SCHEMA_V2`]).
    holes: AtomicBool,
    /// Said once that schema 2 cannot be added.
    told: AtomicBool,
}

impl Postgres {
    pub fn new(
        cfg: &PostgresConfig,
        timeout: Duration,
        prefix: &str,
    ) -> Result<Postgres, ClusterError> {
        let runtime = Handle::try_current()
            .map_err(|_| ClusterError::Setup("the postgres store needs a tokio runtime".into()))?;
        let mut pg = cfg.target.pg.clone();
        if pg.get_password().is_none()
            && let Some(password) = password(cfg)?
        {
            pg.password(password);
        }
        if pg.get_connect_timeout().is_none() {
            pg.connect_timeout(super::connect_limit(timeout));
        }
        let check = match (cfg.target.sslmode, cfg.roots.is_some()) {
            (SslMode::VerifyFull, _) => crate::tls::Check::Full,
            (SslMode::VerifyCa, _) | (SslMode::Require, true) => crate::tls::Check::Chain,
            _ => crate::tls::Check::Nothing,
        };
        let tls = MakeRustlsConnect::new(
            crate::tls::postgres_config(cfg.roots.as_deref(), check)
                .map_err(|e| ClusterError::Setup(format!("postgres TLS: {e}")))?,
        );
        // Admissions give up after `timeout`; so does the server's work
        // for them (a late admission would hold a slot nobody uses).
        let statement_ms = timeout.as_millis().max(1);
        let secret = Secret::new(cfg);
        let manager = Manager::from_connect(
            pg.clone(),
            FreshConnect {
                tls: tls.clone(),
                secret: secret.clone(),
            },
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(cfg.pool_size)
            .wait_timeout(Some(timeout))
            .create_timeout(Some(super::connect_limit(timeout)))
            .recycle_timeout(Some(timeout))
            .runtime(Runtime::Tokio1)
            .post_create(Hook::async_fn(move |client, _| {
                Box::pin(async move {
                    client
                        // Read committed whatever the role's or the
                        // database's default: the admission's row lock
                        // serializes it, and a stricter level would fail
                        // contended admissions (40001) instead of waiting.
                        .batch_execute(&format!(
                            "SET statement_timeout = {statement_ms}; \
                             SET default_transaction_isolation = 'read committed'"
                        ))
                        .await
                        .map_err(HookError::Backend)
                })
            }))
            .build()
            .map_err(|e| ClusterError::Setup(format!("postgres pool: {e}")))?;
        Ok(Postgres {
            pool,
            health: super::health_key(prefix),
            holes: AtomicBool::new(false),
            told: AtomicBool::new(false),
            shown: cfg.target.to_string(),
            pg,
            secret,
            tls,
            durable: cfg.durable,
            runtime,
            timeout,
            problem: super::Problem::default(),
        })
    }

    /// A connection of its own (schema check, sweep, `sluice migrate`),
    /// driven on the store's runtime.
    async fn connect(&self) -> Result<tokio_postgres::Client, ClusterError> {
        let pg = self.secret.fresh(&self.pg);
        let connecting = pg.connect(self.tls.clone());
        let (client, connection) =
            tokio::time::timeout(self.timeout.max(Duration::from_secs(2)), connecting)
                .await
                .map_err(|_| ClusterError::Timeout(self.timeout.max(Duration::from_secs(2))))??;
        self.runtime.spawn(async move {
            let _ = connection.await;
        });
        Ok(client)
    }

    /// A connection for upkeep (schema, sweep), with a longer statement
    /// timeout than admissions have: 5 s, no longer than a sweep may run
    /// (one cut short on our side stops on the server too, and holds no
    /// expired rows an admission waits for).
    async fn maintenance(&self) -> Result<tokio_postgres::Client, ClusterError> {
        let client = self.connect().await?;
        client.batch_execute("SET statement_timeout = 5000").await?;
        Ok(client)
    }

    /// Create the tables and functions if any is missing (one instance
    /// at a time). Returns whether anything had to be created.
    ///
    /// Schema 2 is added when it can be; when it cannot, `strict` (`sluice
    /// migrate`) makes that the error, and otherwise sluice runs on schema
    /// 1 and says so once (a role that may only use a schema a DBA applied
    /// tries again only when a check starts over: at the next start).
    async fn ensure_schema(
        &self,
        client: &mut tokio_postgres::Client,
        strict: bool,
    ) -> Result<bool, ClusterError> {
        let mut created = false;
        if !client
            .query_one(OBJECTS, &[])
            .await?
            .try_get::<_, bool>(0)?
        {
            self.apply(client, SCHEMA).await?;
            created = true;
        }
        let mut holes = client
            .query_one(OBJECTS_V2, &[])
            .await?
            .try_get::<_, bool>(0)?;
        if !holes && (strict || !self.told.load(Ordering::Relaxed)) {
            // Schema 1 is enough to admit: a role that may not create what
            // schema 2 adds (a DBA applied the SQL of a version before)
            // runs without holes, and is told how to get them.
            match self.apply(client, SCHEMA_V2).await {
                Ok(()) => (created, holes) = (true, true),
                Err(e) if strict => {
                    return Err(ClusterError::Setup(format!(
                        "cannot add schema 2 (sluice_holes, sluice_withdraw, sluice_sweep_holes): {e}; apply `sluice migrate --print-sql` as the schema's owner"
                    )));
                }
                Err(e) => {
                    self.told.store(true, Ordering::Relaxed);
                    warn!(postgres = %self.shown, error = %e, "cannot add schema 2 (sluice_holes, sluice_withdraw, sluice_sweep_holes): of several withdrawals of one client's reservations (calls answered after the timeout), only the last gives its place back; apply `sluice migrate --print-sql` as the schema's owner, and grant the role SELECT, INSERT, DELETE on sluice_holes");
                }
            }
        }
        self.holes.store(holes, Ordering::Relaxed);
        Ok(created)
    }

    /// Apply `sql` (with the configured persistence) in one transaction,
    /// one instance at a time.
    async fn apply(
        &self,
        client: &mut tokio_postgres::Client,
        sql: &str,
    ) -> Result<(), ClusterError> {
        let tx = client.transaction().await?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
            .await?;
        tx.batch_execute(&persistence(sql, self.durable)).await?;
        tx.commit().await?;
        info!(postgres = %self.shown, durable = self.durable, "created the shared-schedule tables and functions");
        Ok(())
    }

    /// `sluice migrate`, and the start: the schema in place, and a word
    /// when the table's kind is not the configured one.
    pub async fn migrate(&self) -> Result<bool, ClusterError> {
        let mut client = self.maintenance().await?;
        let created = self.ensure_schema(&mut client, true).await?;
        if !created {
            self.check_persistence(&client).await;
        }
        Ok(created)
    }

    /// Write the health row, as an admission writes (a standby, or a role
    /// without INSERT or UPDATE on the table, still answers the schema's
    /// reads). The sweep takes it a minute after the last check.
    async fn write_probe(&self, client: &tokio_postgres::Client) -> Result<(), ClusterError> {
        client
            .execute(
                "INSERT INTO sluice_schedules (k, d, expires_us) \
                 VALUES ($1, 0, sluice_now_us() + 60000000) \
                 ON CONFLICT (k) DO UPDATE SET expires_us = EXCLUDED.expires_us",
                &[&self.health],
            )
            .await?;
        Ok(())
    }

    /// Say so when the table's kind is not the configured one (changing it
    /// rewrites the table, which is the DBA's call).
    /// Within [`UPKEEP_LIMIT`]: a database that goes silent after the
    /// upkeep would hold the start (or `migrate`) until TCP gave up.
    async fn check_persistence(&self, client: &tokio_postgres::Client) {
        let row = tokio::time::timeout(
            UPKEEP_LIMIT,
            client.query_opt(
                "SELECT relpersistence::text FROM pg_class WHERE oid = to_regclass('sluice_schedules')",
                &[],
            ),
        )
        .await;
        if let Ok(Ok(Some(row))) = row
            && let Ok(p) = row.try_get::<_, String>(0)
        {
            let logged = p == "p";
            if logged != self.durable {
                warn!(
                    postgres = %self.shown,
                    "sluice_schedules is {} but cluster.durable = {}: ALTER TABLE sluice_schedules SET {} (and sluice_slots) to match",
                    if logged { "logged" } else { "unlogged" },
                    self.durable,
                    if self.durable { "LOGGED" } else { "UNLOGGED" },
                );
            }
        }
    }

    /// Reach the database and make sure the schema is there, within
    /// [`UPKEEP_LIMIT`] (only the connection had a bound: a database that
    /// went silent after the login held the start until TCP gave up).
    pub async fn check(&self) -> Result<(), String> {
        let mut conn = None;
        self.problem.begin();
        let result = self.bounded_upkeep(&mut conn).await;
        if let (Ok(()), Some(client)) = (&result, &conn) {
            self.check_persistence(client).await;
        }
        self.set_problem(self.trouble(result))
    }

    /// [`Postgres::upkeep`] within [`UPKEEP_LIMIT`].
    async fn bounded_upkeep(
        &self,
        conn: &mut Option<tokio_postgres::Client>,
    ) -> Result<(), ClusterError> {
        match tokio::time::timeout(UPKEEP_LIMIT, self.upkeep(conn)).await {
            Ok(r) => r,
            Err(_) => Err(ClusterError::Timeout(UPKEEP_LIMIT)),
        }
    }

    fn trouble(&self, result: Result<(), ClusterError>) -> Option<Trouble> {
        result
            .err()
            .map(|e| Trouble::Unavailable(format!("postgres {}: {e}", self.shown)))
    }

    /// Open the pool's connections ahead of traffic (a connection's
    /// start-up and SCRAM exchange cost more than many admissions). The
    /// pool hands out its idle connections before it makes new ones, so
    /// those are held until the new ones are made: a few at a time
    /// ([`WARM_AT_ONCE`]), so that admissions wait for a few connections'
    /// making at most, not for each in turn; none more once one fails (a
    /// database at its `max_connections` is not asked again and again).
    async fn warm(&self) {
        let status = self.pool.status();
        let limit = self.timeout.max(Duration::from_secs(2));
        let mut missing = status.max_size.saturating_sub(status.size);
        let mut held = Vec::new();
        let mut making = tokio::task::JoinSet::new();
        let mut failed = false;
        loop {
            while !failed && missing > 0 && making.len() < WARM_AT_ONCE {
                missing -= 1;
                let pool = self.pool.clone();
                making.spawn(async move { tokio::time::timeout(limit, pool.get()).await });
            }
            match making.join_next().await {
                None => break,
                Some(Ok(Ok(Ok(conn)))) => held.push(conn),
                Some(_) => failed = true,
            }
        }
        drop(held);
    }

    fn set_problem(&self, problem: Option<Trouble>) -> Result<(), String> {
        self.problem.set(problem)
    }

    pub(super) fn problem(&self) -> &super::Problem {
        &self.problem
    }

    /// Every few seconds, on one upkeep connection (made again when it
    /// breaks): re-check the schema (a dropped table comes back), keep the
    /// pool warm, and sweep expired rows in bounded batches.
    pub async fn watch(&self) {
        let mut tick = tokio::time::interval(SWEEP_EVERY);
        // A slow check and sweep (15 s at most) are not made up for by
        // checks back to back.
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        let mut conn = None;
        loop {
            tick.tick().await;
            self.problem.begin();
            let result = self.bounded_upkeep(&mut conn).await;
            if result.is_err() {
                conn = None;
            } else {
                self.sweep(&mut conn).await;
            }
            let _ = self.set_problem(self.trouble(result));
        }
    }

    async fn upkeep(&self, conn: &mut Option<tokio_postgres::Client>) -> Result<(), ClusterError> {
        let client = match conn {
            Some(c) if !c.is_closed() => c,
            _ => conn.insert(self.maintenance().await?),
        };
        self.ensure_schema(client, false).await?;
        self.write_probe(client).await?;
        self.warm().await;
        Ok(())
    }

    /// Delete expired rows, batch by batch, for [`SWEEP_FOR`] at most (and
    /// a last batch); a sweep that fails or overruns is logged, and its
    /// connection made again at the next check: it is no sign that
    /// admissions fail.
    async fn sweep(&self, conn: &mut Option<tokio_postgres::Client>) {
        let Some(client) = conn.as_ref().filter(|c| !c.is_closed()) else {
            return;
        };
        let holes = self.holes.load(Ordering::Relaxed);
        match tokio::time::timeout(SWEEP_FOR + SWEEP_LAST, sweep(client, holes)).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => warn!(error = %e, "sweeping expired schedules failed"),
            Err(_) => {
                warn!("sweeping expired schedules took too long: stopped");
                *conn = None;
            }
        }
    }

    /// Run one statement on a pooled connection, on the store's runtime.
    /// A connection is waited for up to the timeout; the statement runs
    /// for the timeout at most (`statement_timeout`: past it, the server
    /// rolls it back), and its answer is waited for up to
    /// [`super::orphan_limit`], so that a statement that committed is
    /// known even when the caller stopped waiting (its reservation is then
    /// given back).
    async fn call(
        &self,
        sql: &'static str,
        params: Params,
    ) -> Result<tokio_postgres::Row, ClusterError> {
        let pool = self.pool.clone();
        let timeout = self.timeout;
        let work = async move {
            let deadline = tokio::time::Instant::now() + timeout;
            let client = tokio::time::timeout_at(deadline, pool.get())
                .await
                .map_err(|_| ClusterError::Timeout(timeout))?
                .map_err(|e| match e {
                    deadpool_postgres::PoolError::Backend(e) => ClusterError::Postgres(e),
                    deadpool_postgres::PoolError::Timeout(_) => ClusterError::Timeout(timeout),
                    other => ClusterError::Setup(format!("postgres pool: {other}")),
                })?;
            let done = {
                let run = async {
                    let statement = client.prepare_cached(sql).await?;
                    let refs = params.refs();
                    Ok::<_, ClusterError>(client.query_one(&statement, &refs).await?)
                };
                tokio::time::timeout(super::orphan_limit(timeout), run).await
            };
            match done {
                Ok(result) => result,
                Err(_) => {
                    // The statement may still be on its way or running: a
                    // connection given back now would queue the next
                    // admissions behind it (a silent network holds them
                    // all). It is closed instead.
                    drop(deadpool_postgres::Object::take(client));
                    Err(ClusterError::Timeout(timeout))
                }
            }
        };
        self.runtime
            .spawn(work)
            .await
            .map_err(|e| ClusterError::Setup(format!("postgres call: {e}")))?
    }

    pub async fn admit(&self, ask: &Ask) -> Result<Vec<i64>, ClusterError> {
        let us = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        let gstep = if ask.slots.is_some() {
            us(ask.slot_us.max(1))
        } else {
            0
        };
        let params = Params {
            key: ask.key.clone(),
            cal: ask.slots.clone(),
            numbers: vec![
                us(ask.step_us.max(1)),
                i64::from(ask.capacity),
                i64::from(ask.cost),
                us(ask.tau_us),
                gstep,
                us(ask.max_wait_us),
            ],
        };
        let row = self.call(ADMIT, params).await?;
        Ok(row.try_get::<_, Vec<i64>>(0)?)
    }

    pub async fn cancel(&self, r: &Reservation) -> Result<(), ClusterError> {
        let params = Params {
            key: r.key.clone(),
            cal: r.slots.clone(),
            numbers: vec![r.new_d, r.undo, r.first_slot, i64::from(r.cost)],
        };
        let sql = if self.holes.load(Ordering::Relaxed) {
            WITHDRAW
        } else {
            CANCEL
        };
        self.call(sql, params).await.map(|_| ())
    }
}

/// Delete expired rows (and holes, with schema 2), batch by batch, while
/// batches come back full, for [`SWEEP_FOR`] at most.
async fn sweep(client: &tokio_postgres::Client, holes: bool) -> Result<u64, ClusterError> {
    let start = tokio::time::Instant::now();
    let mut total = 0u64;
    let mut calls = vec!["SELECT sluice_sweep($1)"];
    if holes {
        calls.push("SELECT sluice_sweep_holes($1)");
    }
    for sql in calls {
        loop {
            let gone: i64 = client.query_one(sql, &[&SWEEP_BATCH]).await?.try_get(0)?;
            total = total.saturating_add(u64::try_from(gone).unwrap_or(0));
            if gone < i64::from(SWEEP_BATCH) || start.elapsed() >= SWEEP_FOR {
                break;
            }
        }
    }
    Ok(total)
}

/// A call's parameters, owned (the call runs on another task).
struct Params {
    key: String,
    cal: Option<String>,
    numbers: Vec<i64>,
}

impl Params {
    fn refs(&self) -> Vec<&(dyn tokio_postgres::types::ToSql + Sync)> {
        let mut out: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = vec![&self.key, &self.cal];
        out.extend(
            self.numbers
                .iter()
                .map(|n| n as &(dyn tokio_postgres::types::ToSql + Sync)),
        );
        out
    }
}

/// Where the password comes from when the URL has none, read again for
/// each new connection (as libpq does): a password rotated in its file
/// is used from the next connection on, without a restart. The URL's own
/// password stands as it is.
#[derive(Clone)]
struct Secret(Option<Arc<PostgresConfig>>);

impl Secret {
    fn new(cfg: &PostgresConfig) -> Secret {
        let from_file = cfg.target.pg.get_password().is_none();
        Secret(from_file.then(|| Arc::new(cfg.clone())))
    }

    /// `pg` with the password its file holds now (the one read before,
    /// if it cannot be read now).
    fn fresh(&self, pg: &tokio_postgres::Config) -> tokio_postgres::Config {
        let mut pg = pg.clone();
        if let Some(cfg) = &self.0 {
            match password(cfg) {
                Ok(Some(password)) => {
                    pg.password(password);
                }
                Ok(None) => {}
                Err(e) => warn!(error = %e, "the password read before is used"),
            }
        }
        pg
    }
}

/// The pool's connections, each with [`Secret::fresh`]'s password.
struct FreshConnect {
    tls: MakeRustlsConnect,
    secret: Secret,
}

impl deadpool_postgres::Connect for FreshConnect {
    fn connect(
        &self,
        pg: &tokio_postgres::Config,
    ) -> Pin<
        Box<
            dyn Future<
                    Output = Result<
                        (tokio_postgres::Client, tokio::task::JoinHandle<()>),
                        tokio_postgres::Error,
                    >,
                > + Send
                + '_,
        >,
    > {
        let (pg, tls) = (self.secret.fresh(pg), self.tls.clone());
        Box::pin(async move {
            let (client, connection) = pg.connect(tls).await?;
            let driven = tokio::spawn(async move {
                let _ = connection.await;
            });
            Ok((client, driven))
        })
    }
}

/// The password when the URL has none: `password_file`, else the
/// libpq password file (`passfile`, `PGPASSFILE`, `~/.pgpass`).
fn password(cfg: &PostgresConfig) -> Result<Option<String>, ClusterError> {
    if let Some(file) = &cfg.password_file {
        return super::read_password(file).map(Some);
    }
    let file = cfg
        .target
        .passfile
        .clone()
        .or_else(|| std::env::var_os("PGPASSFILE").map(PathBuf::from))
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".pgpass")));
    Ok(file.and_then(|f| pgpass(&f, &cfg.target.pg)))
}

/// The first matching line of a libpq password file
/// (`host:port:database:user:password`, `*` matches anything, `\` escapes);
/// ignored, as by libpq, when others may read it.
fn pgpass(file: &Path, pg: &tokio_postgres::Config) -> Option<String> {
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(file).ok()?;
    if meta.permissions().mode() & 0o077 != 0 {
        warn!(file = %file.display(), "password file ignored: group or others may read it (chmod 0600)");
        return None;
    }
    let text = std::fs::read_to_string(file).ok()?;
    let host = match pg.get_hosts().first() {
        Some(Host::Tcp(h)) => h.clone(),
        Some(Host::Unix(_)) | None => "localhost".to_owned(),
    };
    let port = pg.get_ports().first().copied().unwrap_or(5432).to_string();
    let user = pg.get_user().unwrap_or("");
    let db = pg.get_dbname().unwrap_or(user);
    let want = [host.as_str(), port.as_str(), db, user];
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|line| {
            let fields = pgpass_fields(line);
            let [h, p, d, u, password] = <[String; 5]>::try_from(fields).ok()?;
            [h, p, d, u]
                .iter()
                .zip(want)
                .all(|(f, w)| f == "*" || f == w)
                .then_some(password)
        })
}

/// Split a password-file line at unescaped `:`.
fn pgpass_fields(line: &str) -> Vec<String> {
    let mut fields = vec![String::new()];
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                if let (Some(next), Some(f)) = (chars.next(), fields.last_mut()) {
                    f.push(next);
                }
            }
            ':' if fields.len() < 5 => fields.push(String::new()),
            c => {
                if let Some(f) = fields.last_mut() {
                    f.push(c);
                }
            }
        }
    }
    fields
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn password_file_lines_match_like_libpq() {
        let dir = std::env::temp_dir().join(format!("sluice-pgpass-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("pgpass");
        std::fs::write(
            &file,
            "# comment\nother:5432:*:app:no\ndb.example:*:shape:app:pa\\:ss\\\\word\n*:*:*:*:fallback\n",
        )
        .expect("write");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        let pg = |url: &str| crate::config::postgres::parse(url).expect("url").pg;
        assert_eq!(
            pgpass(&file, &pg("postgres://app@db.example:6000/shape")).as_deref(),
            Some("pa:ss\\word")
        );
        assert_eq!(
            pgpass(&file, &pg("postgres://app@db.example/other")).as_deref(),
            Some("fallback")
        );
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        assert_eq!(pgpass(&file, &pg("postgres://app@db.example/shape")), None);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
