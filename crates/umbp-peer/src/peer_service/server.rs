//! Serving [`PeerService`] over gRPC: the listener, the token check and a bounded graceful shutdown.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::server::TcpIncoming;
use umbp_proto::token::TokenCheck;
use umbp_proto::v1::umbp_peer_server::UmbpPeerServer;

use super::service::PeerService;

/// Settings of the peer service's gRPC server.
#[derive(Clone, PartialEq, Eq)]
pub struct PeerServerConfig {
    /// Listen address; port 0 picks a free port (see [`PeerServerHandle::local_addr`]). The port is
    /// bound without `SO_REUSEPORT`: a second server on a bound port fails. Default: `127.0.0.1:0`.
    pub listen: SocketAddr,
    /// The cluster token every call must carry in `x-umbp-token`; `None` accepts every call.
    /// Default: `None`.
    pub cluster_token: Option<String>,
    /// Largest request or reply, in bytes. Default: 64 MiB.
    pub max_message_bytes: usize,
    /// How long [`PeerServerHandle::shutdown`] waits for in-flight calls. Default: 3 s.
    pub shutdown_deadline: Duration,
}

// Manual `Debug`: the cluster token must never reach a log line.
impl std::fmt::Debug for PeerServerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerServerConfig")
            .field("listen", &self.listen)
            .field("cluster_token", &self.cluster_token.as_ref().map(|_| "<redacted>"))
            .field("max_message_bytes", &self.max_message_bytes)
            .field("shutdown_deadline", &self.shutdown_deadline)
            .finish()
    }
}

impl Default for PeerServerConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            cluster_token: None,
            max_message_bytes: 64 << 20,
            shutdown_deadline: Duration::from_secs(3),
        }
    }
}

/// Why the peer service could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PeerServiceError {
    /// The listen address could not be bound (in use, or not an address of this host).
    #[error("binding {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A setting is unusable.
    #[error("invalid peer server config: {reason}")]
    InvalidConfig {
        /// What is wrong.
        reason: String,
    },
}

impl PeerServiceError {
    /// What the caller does next: both are fixed in the settings (another address, a usable
    /// setting), never by retrying as is.
    pub fn kind(&self) -> umbp_core::ErrorKind {
        match self {
            Self::Bind { .. } | Self::InvalidConfig { .. } => umbp_core::ErrorKind::InvalidInput,
        }
    }
}

/// Starts the peer service's gRPC server (see [`PeerServer::start`]).
#[derive(Debug)]
#[non_exhaustive]
pub struct PeerServer;

impl PeerServer {
    /// Binds `config.listen` and serves `service` on the current tokio runtime until
    /// [`PeerServerHandle::shutdown`] (or until the handle is dropped, which aborts the server).
    ///
    /// Accepted connections use `TCP_NODELAY`: without it a multi-segment reply waits for the
    /// client's delayed ACK (about 40 ms).
    ///
    /// # Errors
    /// [`PeerServiceError::Bind`] when the address cannot be bound (for example, another server holds
    /// the port); [`PeerServiceError::InvalidConfig`] for a zero message limit.
    pub async fn start(config: PeerServerConfig, service: PeerService) -> Result<PeerServerHandle, PeerServiceError> {
        if config.max_message_bytes == 0 {
            return Err(PeerServiceError::InvalidConfig { reason: "max_message_bytes must be > 0".into() });
        }
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .map_err(|source| PeerServiceError::Bind { addr: config.listen, source })?;
        let addr = listener.local_addr().map_err(|source| PeerServiceError::Bind { addr: config.listen, source })?;
        tracing::info!(%addr, data_endpoint = service.data_endpoint(), "peer service listening");
        let grpc = UmbpPeerServer::new(service)
            .max_decoding_message_size(config.max_message_bytes)
            .max_encoding_message_size(config.max_message_bytes);
        let grpc = InterceptedService::new(grpc, TokenCheck::new(config.cluster_token.as_deref()));
        let (stop, mut stopped) = watch::channel(false);
        let server = tokio::spawn(tonic::transport::Server::builder().add_service(grpc).serve_with_incoming_shutdown(
            TcpIncoming::from(listener).with_nodelay(Some(true)),
            async move {
                let _ = stopped.wait_for(|s| *s).await;
            },
        ));
        Ok(PeerServerHandle { addr, stop, server: Some(server), shutdown_deadline: config.shutdown_deadline })
    }
}

/// A running peer service. Dropping it without [`shutdown`](Self::shutdown) aborts the server.
#[derive(Debug)]
pub struct PeerServerHandle {
    addr: SocketAddr,
    stop: watch::Sender<bool>,
    server: Option<JoinHandle<Result<(), tonic::transport::Error>>>,
    shutdown_deadline: Duration,
}

impl PeerServerHandle {
    /// The address the server is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting calls and waits for in-flight ones, at most the configured shutdown deadline;
    /// calls still running then are abandoned.
    pub async fn shutdown(mut self) {
        let _ = self.stop.send(true);
        let Some(mut server) = self.server.take() else { return };
        match tokio::time::timeout(self.shutdown_deadline, &mut server).await {
            Ok(Ok(Ok(()))) => tracing::info!(addr = %self.addr, "peer service stopped"),
            Ok(Ok(Err(e))) => tracing::warn!(error = %e, "peer service stopped with an error"),
            Ok(Err(e)) => tracing::warn!(error = %e, "peer service task failed"),
            Err(_) => {
                tracing::warn!("peer service calls outlived the shutdown deadline; abandoning them");
                server.abort();
            }
        }
    }
}

impl Drop for PeerServerHandle {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        if let Some(server) = &self.server {
            server.abort();
        }
    }
}
