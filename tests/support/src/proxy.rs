//! A loopback TCP proxy that injects network faults between a component
//! and a real service: pass, blackhole, silent (old connections dead for
//! good, new ones pass), reset, and cut after N bytes.

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
    /// A link that went silent for the connections open now and stays
    /// dead for them, whatever the mode becomes later (a dead NAT entry, a
    /// failed-over load balancer): they forward nothing and never close
    /// (no FIN, no RST reaches either side), while connections opened
    /// after the switch pass. [`Proxy::dead`] counts the connections it
    /// killed.
    Silent,
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
    dead: Arc<AtomicU64>,
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
        let dead = Arc::new(AtomicU64::new(0));
        let task = tokio::spawn({
            let mode = mode.clone();
            let connections = connections.clone();
            let open = open.clone();
            let cuts = cuts.clone();
            let dead = dead.clone();
            async move {
                while let Ok((client, _)) = listener.accept().await {
                    connections.fetch_add(1, Ordering::Relaxed);
                    let rx = mode.subscribe();
                    let cuts = cuts.clone();
                    let open = open.clone();
                    let dead = dead.clone();
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
                        pipe(client, server, rx, &cuts, &dead).await;
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
            dead,
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

    /// Connections a [`Mode::Silent`] killed so far.
    pub fn dead(&self) -> u64 {
        self.dead.load(Ordering::Relaxed)
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
    dead: &AtomicU64,
) {
    // A connection opened while the link is silent is a new one: it passes.
    let born_silent = *mode.borrow_and_update() == Mode::Silent;
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
            Mode::Silent if !born_silent => {
                dead.fetch_add(1, Ordering::Relaxed);
                hold_silently(cr, cw, sr, sw).await;
                return;
            }
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

/// A connection on a link that went silent: whatever either side sends is
/// swallowed, and neither side hears of the other closing (their sockets
/// stay open until the proxy stops), as on a link no packet crosses.
async fn hold_silently(
    mut cr: tokio::net::tcp::OwnedReadHalf,
    cw: tokio::net::tcp::OwnedWriteHalf,
    mut sr: tokio::net::tcp::OwnedReadHalf,
    sw: tokio::net::tcp::OwnedWriteHalf,
) {
    let (mut up, mut down) = ([0u8; 16 * 1024], [0u8; 16 * 1024]);
    let (mut client_open, mut server_open) = (true, true);
    while client_open || server_open {
        tokio::select! {
            r = cr.read(&mut up), if client_open => client_open = matches!(r, Ok(n) if n > 0),
            r = sr.read(&mut down), if server_open => server_open = matches!(r, Ok(n) if n > 0),
        }
    }
    // Both sides gave up on their own (their timeouts): nothing to hold.
    drop((cw, sw));
}
