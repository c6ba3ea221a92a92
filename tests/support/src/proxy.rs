//! A loopback TCP proxy that injects network faults between a component
//! and a real service: pass, blackhole, reset, and cut after N bytes.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What the proxy does with traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Forward everything.
    Pass,
    /// Accept and keep connections, forward nothing (a silent network).
    Blackhole,
    /// Reset every connection (new and existing) with an RST.
    Reset,
    /// Forward this many more bytes from client to server on each
    /// connection open while this mode is on (or opened while it is),
    /// then close it: the budget sticks to the connection, so the cut
    /// lands once that much traffic has flowed, whatever the mode is by
    /// then. [`Proxy::cuts`] counts the cuts.
    CutAfter(usize),
    /// Forward everything, holding each chunk from the server back this
    /// long (a slow broker: every round trip takes at least that much).
    Delay(Duration),
}

/// A running proxy on 127.0.0.1.
#[derive(Debug, Clone)]
pub struct Proxy {
    /// Where clients connect.
    pub addr: SocketAddr,
    mode: watch::Sender<Mode>,
    connections: Arc<AtomicU64>,
    /// Connections being forwarded now.
    open: Arc<AtomicU64>,
    cuts: Arc<AtomicU64>,
    task: Arc<Mutex<Option<tokio::task::JoinHandle<()>>>>,
}

impl Proxy {
    /// Starts proxying to `upstream`.
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy addr");
        let (mode, _) = watch::channel(Mode::Pass);
        let connections = Arc::new(AtomicU64::new(0));
        let open = Arc::new(AtomicU64::new(0));
        let cuts = Arc::new(AtomicU64::new(0));
        let task = tokio::spawn({
            let mode = mode.clone();
            let connections = connections.clone();
            let open = open.clone();
            let cuts = cuts.clone();
            async move {
                while let Ok((client, _)) = listener.accept().await {
                    connections.fetch_add(1, Ordering::Relaxed);
                    let rx = mode.subscribe();
                    let cuts = cuts.clone();
                    let open = open.clone();
                    tokio::spawn(async move {
                        if *rx.borrow() == Mode::Reset {
                            reset(client);
                            return;
                        }
                        let Ok(server) = TcpStream::connect(upstream).await else {
                            return;
                        };
                        let _ = client.set_nodelay(true);
                        let _ = server.set_nodelay(true);
                        open.fetch_add(1, Ordering::Relaxed);
                        pipe(client, server, rx, &cuts).await;
                        open.fetch_sub(1, Ordering::Relaxed);
                    });
                }
            }
        });
        Self {
            addr,
            mode,
            connections,
            open,
            cuts,
            task: Arc::new(Mutex::new(Some(task))),
        }
    }

    /// Changes the mode; existing connections follow it at once.
    pub fn set(&self, mode: Mode) {
        self.mode.send_replace(mode);
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.connections.load(Ordering::Relaxed)
    }

    /// Connections being forwarded now (a [`Mode::Reset`] has closed
    /// every one once this is 0).
    pub fn open(&self) -> u64 {
        self.open.load(Ordering::Relaxed)
    }

    /// Connections closed by [`Mode::CutAfter`] so far.
    pub fn cuts(&self) -> u64 {
        self.cuts.load(Ordering::Relaxed)
    }

    /// `url` (amqp:// or postgres://) pointed at this proxy.
    pub fn url(&self, url: &str) -> String {
        let mut u = url::Url::parse(url).expect("url");
        u.set_host(Some("127.0.0.1")).expect("host");
        u.set_port(Some(self.addr.port())).expect("port");
        u.to_string()
    }

    /// Stops accepting.
    pub fn stop(&self) {
        if let Some(t) = self.task.lock().unwrap().take() {
            t.abort();
        }
    }
}

fn reset(stream: TcpStream) {
    // SO_LINGER 0: close sends an RST instead of a FIN.
    #[allow(deprecated)]
    let _ = stream.set_linger(Some(Duration::ZERO));
    drop(stream);
}

async fn pipe(
    client: TcpStream,
    server: TcpStream,
    mut mode: watch::Receiver<Mode>,
    cuts: &AtomicU64,
) {
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let mut budget: Option<usize> = None;
    let mut up = [0u8; 16 * 1024];
    let mut down = [0u8; 16 * 1024];
    loop {
        let current = *mode.borrow_and_update();
        match current {
            Mode::Reset => {
                let (Ok(c), Ok(s)) = (cr.reunite(cw), sr.reunite(sw)) else {
                    return;
                };
                reset(c);
                reset(s);
                return;
            }
            Mode::CutAfter(n) if budget.is_none() => budget = Some(n),
            _ => {}
        }
        let forward = current != Mode::Blackhole;
        tokio::select! {
            _ = mode.changed() => {}
            r = cr.read(&mut up) => {
                let Ok(n) = r else { return };
                if n == 0 { return; }
                if forward {
                    let take = budget.map_or(n, |b| b.min(n));
                    if take > 0 && sw.write_all(&up[..take]).await.is_err() { return; }
                    if let Some(b) = budget.as_mut() {
                        *b -= take;
                        if *b == 0 {
                            cuts.fetch_add(1, Ordering::Relaxed);
                            return; // cut: both halves drop and close
                        }
                    }
                }
            }
            r = sr.read(&mut down) => {
                let Ok(n) = r else { return };
                if n == 0 { return; }
                if let Mode::Delay(d) = current {
                    tokio::time::sleep(d).await;
                }
                if forward && cw.write_all(&down[..n]).await.is_err() { return; }
            }
        }
    }
}
