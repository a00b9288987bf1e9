//! [`PoolClientBuilder`]: `PoolClient::builder(node_id, master).medium(…).start().await`.

use std::sync::Arc;

use umbp_core::{Clock, SystemClock};

use super::{Medium, PoolClient, PoolClientConfig, PoolError};

/// Builds and starts a [`PoolClient`]. Starts from [`PoolClientConfig::new`]'s defaults (a
/// client-only node); every setting the builder has no method for is reachable through
/// [`configure`](Self::configure).
///
/// ```no_run
/// use umbp_peer::pool_client::{DramConfig, Medium, PoolClient};
///
/// # async fn run() -> Result<(), umbp_peer::pool_client::PoolError> {
/// let node = PoolClient::builder("node-a", "127.0.0.1:50051")
///     .medium(Medium::Dram(DramConfig { capacity_bytes: 1 << 30, ..DramConfig::default() }))
///     .configure(|c| c.max_reroutes = 3)
///     .start()
///     .await?;
/// node.put("key", b"value").await.expect("stored");
/// node.close().await;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
#[must_use = "a builder does nothing until `start`"]
pub struct PoolClientBuilder {
    config: PoolClientConfig,
    clock: Arc<dyn Clock>,
}

impl PoolClientBuilder {
    /// The medium this node lends (none by default: a client-only node).
    pub fn medium(mut self, medium: Medium) -> Self {
        self.config.medium = medium;
        self
    }

    /// The cluster token, when the cluster has one.
    pub fn cluster_token(mut self, token: impl Into<String>) -> Self {
        self.config.cluster_token = Some(token.into());
        self
    }

    /// Changes any other setting.
    pub fn configure(mut self, change: impl FnOnce(&mut PoolClientConfig)) -> Self {
        change(&mut self.config);
        self
    }

    /// The clock the client's read-lease and slot-TTL checks read (the real one by default; a
    /// [`ManualClock`](umbp_core::ManualClock) in tests).
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// The settings so far.
    pub fn config(&self) -> &PoolClientConfig {
        &self.config
    }

    /// Starts the node (see [`PoolClient::start`]).
    ///
    /// # Errors
    /// As [`PoolClient::start`].
    pub async fn start(self) -> Result<PoolClient, PoolError> {
        PoolClient::start_with_clock(self.config, self.clock).await
    }
}

impl PoolClient {
    /// A builder for node `node_id` of the master at `master` (`host:port`).
    pub fn builder(node_id: impl Into<String>, master: impl Into<String>) -> PoolClientBuilder {
        PoolClientBuilder { config: PoolClientConfig::new(node_id, master), clock: SystemClock::shared() }
    }

    /// A builder starting from `config`.
    pub fn builder_from(config: PoolClientConfig) -> PoolClientBuilder {
        PoolClientBuilder { config, clock: SystemClock::shared() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_builder_sets_what_it_names_and_keeps_the_defaults() {
        let b = PoolClient::builder("n1", "127.0.0.1:1")
            .medium(Medium::None)
            .cluster_token("t")
            .configure(|c| c.max_reroutes = 7);
        let c = b.config();
        assert_eq!((c.node_id.as_str(), c.master_address.as_str()), ("n1", "127.0.0.1:1"));
        assert_eq!((c.cluster_token.as_deref(), c.max_reroutes), (Some("t"), 7));
        assert_eq!(c.page_size, PoolClientConfig::new("x", "y").page_size, "the rest is default");
    }
}
