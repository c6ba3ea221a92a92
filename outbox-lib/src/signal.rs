//! Waiting for the signals that ask a service to stop.

/// Completes when the process receives SIGTERM (what Kubernetes, systemd
/// and `docker stop` send) or SIGINT (Ctrl-C), whichever comes first. Use
/// it to start a graceful shutdown: a consumer drains its batch, an HTTP
/// server finishes its requests, and the process exits 0.
///
/// The handlers are installed when this is **called**, not when the future
/// is first polled: call it before the service reports ready (binds its
/// port, starts consuming), or a signal in between would kill the process.
/// Call it inside a Tokio runtime.
///
/// ```no_run
/// # async fn demo() {
/// let stop = outbox::shutdown_signal(); // installed now
/// let shutdown = tokio_util::sync::CancellationToken::new();
/// tokio::spawn({
///     let shutdown = shutdown.clone();
///     async move {
///         stop.await;
///         shutdown.cancel();
///     }
/// });
/// # }
/// ```
///
/// Should the handlers fail to install (no signal support), it waits for
/// Ctrl-C alone, and if that fails too it never completes.
pub fn shutdown_signal() -> impl Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    let signals = {
        use tokio::signal::unix::{SignalKind, signal};
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(term), Ok(int)) => Some((term, int)),
            _ => None,
        }
    };
    async move {
        #[cfg(unix)]
        if let Some((mut term, mut int)) = signals {
            tokio::select! {
                _ = term.recv() => tracing::info!("SIGTERM received; shutting down"),
                _ = int.recv() => tracing::info!("SIGINT received; shutting down"),
            }
            return;
        }
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
        tracing::info!("Ctrl-C received; shutting down");
    }
}
