//! Keeps one node registered in etcd: a lease with the configured TTL, the node key attached to
//! it, keep-alives every `ttl / 3`, coalesced load updates, and recovery when etcd goes away.
//!
//! One task per registration does everything (keep-alive, load puts, re-registration), so puts
//! never race a re-registration and there is a single owner of the lease id.
//!
//! Recovery: a keep-alive or put error, a keep-alive stream that ends, a keep-alive answer with
//! TTL 0 (lease gone), or no keep-alive answer for a whole TTL all end the current session. The
//! task then backs off, builds a fresh client, and re-establishes: if it still knows a lease it
//! first tries to resume it (etcd restarted with its data: the lease survived, with a refreshed
//! TTL); if etcd says the lease is gone (expired, or etcd lost its data) it grants a new one.
//! Either way it then puts the key again with the newest load.
//!
//! Invariants:
//! - The key is only ever written with the lease the task currently holds, so it can never
//!   outlive the registration by more than one TTL.
//! - Dropping the [`RegistrationTask`] (the `Registration` handle) stops the task at its next
//!   await point: keep-alives stop and the key expires with the lease. Deregistering stops it
//!   and revokes the lease, which deletes the key at once.
//! - Registering an id that another live registration holds takes the key over (last writer
//!   wins); the other registration's lease no longer owns the key, so its expiry or revocation
//!   does not delete it. Ids are meant to be unique; this makes a crashed node that restarts
//!   under its old id replace its stale entry at once.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, LeaseKeepAliveStream, LeaseKeeper, PutOptions};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};

use super::Connector;
use crate::error::{Error, Result};
use crate::node::{Load, NodeInfo};
use crate::registration::{LOAD_PUBLISH_INTERVAL, Throttle};

/// The handle of a registration's background task (held by `Registration`).
#[derive(Debug)]
pub(crate) struct RegistrationTask {
    /// Sending asks for a deregistration; dropping ends the task without one.
    stop: oneshot::Sender<()>,
    task: JoinHandle<Result<()>>,
}

impl RegistrationTask {
    /// Registers `info` (errors if etcd refuses or does not answer), then spawns the task that
    /// keeps it registered.
    pub(crate) async fn start(conn: Arc<Connector>, client: Client, info: NodeInfo, load: watch::Receiver<Load>) -> Result<Self> {
        let key = conn.node_key(&info.id);
        let mut registrar = Registrar { conn, client, key, info, load, lease: None, ttl: Duration::ZERO };
        let session = registrar.establish().await?;
        let (stop, stopped) = oneshot::channel();
        let task = tokio::spawn(registrar.run(session, stopped));
        Ok(Self { stop, task })
    }

    /// Stops the task and revokes the lease.
    pub(crate) async fn deregister(self) -> Result<()> {
        // A send error means the task already ended, which the join below reports.
        let _ = self.stop.send(());
        self.task.await.map_err(|e| Error::Task(e.to_string()))?
    }
}

/// A live lease keep-alive stream.
struct Session {
    keeper: LeaseKeeper,
    answers: LeaseKeepAliveStream,
}

struct Registrar {
    conn: Arc<Connector>,
    client: Client,
    key: String,
    /// The node as registered; `load` is overwritten with the newest value before each put.
    info: NodeInfo,
    load: watch::Receiver<Load>,
    /// The lease the key is (or will be) attached to; `None` once etcd said it is gone.
    lease: Option<i64>,
    /// The TTL etcd granted (or reported on the last keep-alive).
    ttl: Duration,
}

impl Registrar {
    /// Keeps the registration alive until `stopped` resolves; on a stop request (not a drop)
    /// revokes the lease.
    async fn run(mut self, first: Session, stopped: oneshot::Receiver<()>) -> Result<()> {
        let deregister = tokio::select! {
            biased;
            stop = stopped => stop.is_ok(),
            never = self.maintain(first) => match never {},
        };
        if deregister { self.revoke().await } else { Ok(()) }
    }

    /// Keeps a session alive, and re-establishes one (with backoff) whenever it is lost.
    async fn maintain(&mut self, first: Session) -> Infallible {
        let mut backoff = self.conn.backoff();
        let mut session = Some(first);
        loop {
            let current = match session.take() {
                Some(current) => current,
                None => match self.establish().await {
                    Ok(current) => {
                        tracing::info!(node = %self.info.id, "membership: registered again in etcd");
                        current
                    }
                    Err(error) => {
                        tracing::warn!(node = %self.info.id, %error, "membership: etcd registration failed; retrying");
                        self.pause_and_reconnect(&mut backoff).await;
                        continue;
                    }
                },
            };
            let started = Instant::now();
            let error = self.keep(current).await;
            if started.elapsed() >= self.ttl {
                // The session was healthy for a while: this is a new outage, retry quickly.
                backoff.reset();
            }
            tracing::warn!(node = %self.info.id, %error, "membership: lost the etcd registration; re-registering");
            self.pause_and_reconnect(&mut backoff).await;
        }
    }

    async fn pause_and_reconnect(&mut self, backoff: &mut super::Backoff) {
        tokio::time::sleep(backoff.next_pause()).await;
        match self.conn.connect().await {
            Ok(client) => self.client = client,
            Err(error) => tracing::warn!(node = %self.info.id, %error, "membership: etcd reconnect failed"),
        }
    }

    /// Resumes the known lease if etcd still has it, else grants a new one; puts the key; returns
    /// the keep-alive session.
    async fn establish(&mut self) -> Result<Session> {
        if let Some(id) = self.lease {
            match self.conn.bounded("lease keep-alive", self.client.lease_keep_alive(id)).await {
                Ok((keeper, answers)) => {
                    self.put(id).await?;
                    return Ok(Session { keeper, answers });
                }
                // etcd-client reports "lease not found" (keep-alive answer with TTL 0) this way.
                Err(Error::Etcd { source: etcd_client::Error::LeaseKeepAliveError(_), .. }) => self.lease = None,
                Err(other) => return Err(other),
            }
        }
        let ttl_secs = i64::try_from(self.conn.opts.ttl.as_secs()).unwrap_or(i64::MAX);
        let grant = self.conn.bounded("lease grant", self.client.lease_grant(ttl_secs, None)).await?;
        self.lease = Some(grant.id());
        self.ttl = ttl_from_secs(grant.ttl());
        self.put(grant.id()).await?;
        let (keeper, answers) = self.conn.bounded("lease keep-alive", self.client.lease_keep_alive(grant.id())).await?;
        Ok(Session { keeper, answers })
    }

    /// Writes the key with the newest load, attached to `lease`.
    async fn put(&mut self, lease: i64) -> Result<()> {
        self.info.load = *self.load.borrow_and_update();
        let value = serde_json::to_vec(&self.info).map_err(Error::Encode)?;
        let options = PutOptions::new().with_lease(lease);
        self.conn.bounded("put", self.client.put(self.key.as_str(), value, Some(options))).await?;
        Ok(())
    }

    /// Runs one session: keep-alives every `ttl / 3`, load puts at most every
    /// [`LOAD_PUBLISH_INTERVAL`]. Returns why the session ended.
    async fn keep(&mut self, mut session: Session) -> Error {
        let mut last_answer = Instant::now();
        let mut throttle = Throttle::new(LOAD_PUBLISH_INTERVAL);
        throttle.published(); // `establish` just put the newest load
        let mut load_pending = self.load.has_changed().unwrap_or(false);
        let mut load_open = true;
        let mut period = keepalive_period(self.ttl);
        let mut ticks = tokio::time::interval_at(Instant::now() + period, period);
        ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticks.tick() => {
                    if last_answer.elapsed() > self.ttl {
                        return Error::KeepAliveStalled(last_answer.elapsed());
                    }
                    if let Err(source) = session.keeper.keep_alive().await {
                        return Error::Etcd { op: "lease keep-alive", source };
                    }
                }
                answer = session.answers.message() => match answer {
                    Ok(Some(answer)) if answer.ttl() > 0 => {
                        last_answer = Instant::now();
                        let ttl = ttl_from_secs(answer.ttl());
                        if ttl != self.ttl {
                            // etcd may report a different TTL (e.g. raised to its minimum).
                            self.ttl = ttl;
                            period = keepalive_period(ttl);
                            ticks = tokio::time::interval_at(Instant::now() + period, period);
                            ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
                        }
                    }
                    Ok(Some(answer)) => {
                        self.lease = None;
                        return Error::LeaseGone(answer.id());
                    }
                    Ok(None) => return Error::StreamEnded("lease keep-alive"),
                    Err(source) => return Error::Etcd { op: "lease keep-alive", source },
                },
                changed = self.load.changed(), if load_open && !load_pending => match changed {
                    Ok(()) => load_pending = true,
                    // The Registration was dropped; `run` sees the stop channel close too.
                    Err(_) => load_open = false,
                },
                () = tokio::time::sleep_until(throttle.next_at()), if load_pending => {
                    load_pending = false;
                    if let Err(error) = self.put(session.keeper.id()).await {
                        return error;
                    }
                    throttle.published();
                }
            }
        }
    }

    /// Revokes the current lease (deleting the key with it). A lease etcd no longer knows is
    /// already gone, with its key, so that is success too.
    async fn revoke(&mut self) -> Result<()> {
        let Some(id) = self.lease.take() else { return Ok(()) };
        match self.conn.bounded("lease revoke", self.client.lease_revoke(id)).await {
            Ok(_) => Ok(()),
            Err(Error::Etcd { source: etcd_client::Error::GRpcStatus(status), .. })
                if status.message().contains("lease not found") =>
            {
                Ok(())
            }
            Err(other) => Err(other),
        }
    }
}

fn ttl_from_secs(secs: i64) -> Duration {
    Duration::from_secs(u64::try_from(secs).unwrap_or(0))
}

/// Keep-alive interval: a third of the TTL, so two keep-alives can be lost before expiry.
fn keepalive_period(ttl: Duration) -> Duration {
    (ttl / 3).max(Duration::from_millis(100))
}
