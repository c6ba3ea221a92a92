//! Waiting for the signals that ask a service to stop.

/// Completes when the process receives SIGTERM (what Kubernetes, systemd
/// and `docker stop` send) or SIGINT (Ctrl-C), whichever comes first. Use
/// it to start a graceful shutdown: a consumer drains its batch, an HTTP
/// server finishes its requests, and the process exits 0.
///
/// ```no_run
/// # async fn demo() {
/// let shutdown = tokio_util::sync::CancellationToken::new();
/// tokio::spawn({
///     let shutdown = shutdown.clone();
///     async move {
///         outbox::shutdown_signal().await;
///         shutdown.cancel();
///     }
/// });
/// # }
/// ```
///
/// Should the handlers fail to install (no signal support), it waits for
/// Ctrl-C alone, and if that fails too it never completes.
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        if let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            tokio::select! {
                _ = term.recv() => tracing::info!("SIGTERM received; shutting down"),
                _ = int.recv() => tracing::info!("SIGINT received; shutting down"),
            }
            return;
        }
    }
    if tokio::signal::ctrl_c().await.is_err() {
        std::future::pending::<()>().await;
    }
    tracing::info!("Ctrl-C received; shutting down");
}
