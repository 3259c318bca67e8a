//! The standard gRPC health protocol (`grpc.health.v1.Health`, through tonic-health) on every cluster
//! server's own gRPC listener, so Kubernetes' native gRPC probes ask the port that serves requests,
//! and the drain that turns it NOT_SERVING.
//!
//! Statuses, per service name:
//! - a node: `""` and its role's service (`tandem.node.v1.Prefill` or `tandem.node.v1.Decode`) are
//!   SERVING from its serving line on, NOT_SERVING once it drains or its engine thread is gone;
//! - a router (also `tandem up`'s): `""` is SERVING until it drains; `tandem.v1.Tandem` is SERVING
//!   while the router could route a request (a live decode node: what `tandem.v1.Tandem/Health` and
//!   HTTP `/health` report) and it is not draining.
//!
//! A drain (SIGTERM, Ctrl-C, `tandem up` shutting down) turns every status NOT_SERVING first; a node
//! then leaves membership and keeps serving on the same listener until its engine is idle (nothing
//! waiting or running, every KV block free), then the server finishes the calls still open. The whole
//! drain is bounded by `--drain-timeout`; past it the process exits with what is left in flight.
//!
//! Invariant: nothing answers SERVING after the server's stop signal (status changes and the drain
//! flag are set under one lock).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tandem_node::NodeCore;
use tokio::time::Instant;
use tonic_health::ServingStatus;
use tonic_health::pb::health_server::HealthServer;
use tonic_health::server::{HealthReporter, HealthService};

/// The health statuses one server reports.
#[derive(Clone)]
pub(super) struct Health {
    reporter: HealthReporter,
    /// The tandem service this server serves (its status besides the server's `""`).
    service: &'static str,
    /// Whether the server drains; held while any status changes.
    draining: Arc<tokio::sync::Mutex<bool>>,
}

impl Health {
    /// Health for a server of `service`: `""` SERVING, `service` at `initial`.
    pub(super) async fn new(service: &'static str, initial: ServingStatus) -> Health {
        let reporter = HealthReporter::new();
        reporter.set_service_status(service, initial).await;
        Health { reporter, service, draining: Arc::new(tokio::sync::Mutex::new(false)) }
    }

    /// The `grpc.health.v1.Health` service answering these statuses.
    pub(super) fn server(&self) -> HealthServer<HealthService> {
        HealthServer::new(HealthService::from_health_reporter(self.reporter.clone()))
    }

    /// Sets the tandem service's status, unless the server drains (then it stays NOT_SERVING).
    pub(super) async fn set(&self, status: ServingStatus) {
        let draining = self.draining.lock().await;
        if !*draining {
            self.reporter.set_service_status(self.service, status).await;
        }
    }

    /// Turns every status NOT_SERVING for good.
    pub(super) async fn drain(&self) {
        let mut draining = self.draining.lock().await;
        *draining = true;
        self.reporter.set_service_status(self.service, ServingStatus::NotServing).await;
        self.reporter.set_service_status("", ServingStatus::NotServing).await;
    }

    async fn is_draining(&self) -> bool {
        *self.draining.lock().await
    }

    /// Whether the server's own status (`""`) is SERVING: until it drains (for a node, also until its
    /// engine thread is gone, which drains it).
    pub(super) async fn serving(&self) -> bool {
        !self.is_draining().await
    }
}

/// Turns `health` NOT_SERVING if the node's engine thread stops answering (checked every second);
/// ends when the node drains.
pub(super) fn watch_engine(core: Arc<NodeCore>, health: Health) {
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            if health.is_draining().await {
                return;
            }
            if let Err(e) = core.engine.load().await {
                tracing::error!(error = %e, "the engine thread is gone; health turns NOT_SERVING");
                health.drain().await;
                return;
            }
        }
    });
}

/// Keeps the router's `tandem.v1.Tandem` status in step with whether it could route a request:
/// checked at every membership change and every second (a node failing calls is skipped for a while).
pub(super) fn watch_router(
    router: tandem_router::Router,
    mut nodes: tokio::sync::watch::Receiver<Vec<tandem_membership::NodeInfo>>,
    health: Health,
) {
    use tandem_proto::v1::tandem_server::Tandem;
    tokio::spawn(async move {
        loop {
            let serving = match router.health(tonic::Request::new(tandem_proto::v1::HealthRequest {})).await {
                Ok(h) => h.into_inner().serving,
                Err(_) => false,
            };
            if health.is_draining().await {
                return;
            }
            health.set(if serving { ServingStatus::Serving } else { ServingStatus::NotServing }).await;
            tokio::select! {
                changed = nodes.changed() => if changed.is_err() { return },
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
    });
}

/// Waits until the node's engine is idle (nothing waiting or running, every KV block free), its
/// engine thread is gone, or `deadline` passed.
pub(super) async fn wait_idle(core: &NodeCore, deadline: Instant) {
    loop {
        match core.engine.load().await {
            Ok(l) if l.waiting == 0 && l.running == 0 && l.free_blocks == l.total_blocks => return,
            Ok(_) => {}
            Err(_) => return,
        }
        if Instant::now() >= deadline {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Runs `serving` to its end, or until the drain deadline sent on `drain_deadline` passed (then
/// `None`: the caller exits with what is still in flight).
pub(super) async fn within_drain<F: Future>(
    serving: F,
    drain_deadline: tokio::sync::oneshot::Receiver<Instant>,
) -> Option<F::Output> {
    let expired = async {
        match drain_deadline.await {
            Ok(deadline) => tokio::time::sleep_until(deadline).await,
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        out = serving => Some(out),
        _ = expired => {
            tracing::warn!("the drain timed out; exiting with requests still in flight");
            None
        }
    }
}
