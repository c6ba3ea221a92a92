//! Logging on stderr: text or JSON lines, filtered by `RUST_LOG`.

use super::args::LogFormat;

pub(crate) fn init_logging(format: LogFormat) {
    let mut filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // lapin logs a broker outage from inside its IO loop at ERROR; the
    // relay handles it (fails over, reconnects) and logs it itself at WARN
    // with the cause. Its lines only when RUST_LOG asks for them by name.
    if !std::env::var("RUST_LOG").is_ok_and(|v| v.contains("lapin")) {
        filter = filter.add_directive("lapin=off".parse().expect("a constant directive parses"));
    }
    // Colours only on a terminal: a log file or collector gets plain text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}
