//! The browser harness of the console tests: headless chromium behind a
//! chromedriver of its own, driven through WebDriver (fantoccini), with
//! waits that give the pages time to render and refresh.

use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::KillOnDrop;
use fantoccini::elements::Element;
use fantoccini::{Client, ClientBuilder, Locator};

use crate::console::artifacts;
use crate::{free_port, wait_for_port};

/// Headless chromium behind its own chromedriver.
pub struct Browser {
    /// The WebDriver session.
    pub client: Client,
    _driver: KillOnDrop,
}

impl Browser {
    /// Starts chromedriver on a free port and a headless chromium session.
    pub async fn start() -> Browser {
        let port = free_port();
        // Its own process group, so the chromium it starts goes with it
        // when the test ends, a panicking one included (see `Drop`).
        let driver = Command::new("chromedriver")
            .process_group(0)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver not found: run `make browser` (installs chromium and chromium-driver)");
        let driver = KillOnDrop(driver);
        wait_for_port(port, "chromedriver to listen").await;
        let mut caps = serde_json::Map::new();
        caps.insert(
            "goog:chromeOptions".to_owned(),
            serde_json::json!({ "args": [
                "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,1000", "--no-first-run", "--disable-extensions"
            ] }),
        );
        let client = ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
            .capabilities(caps)
            .connect(&format!("http://127.0.0.1:{port}"))
            .await
            .expect("a chromium session (is chromium installed? `make browser`)");
        Browser {
            client,
            _driver: driver,
        }
    }

    /// Opens `url`.
    pub async fn goto(&self, url: &str) {
        self.client.goto(url).await.expect("navigate");
    }

    /// The text of the first element matching `css`, waiting up to 10 s
    /// for it (the overview replaces its content as it refreshes).
    pub async fn text(&self, css: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let got = match self.client.find(Locator::Css(css)).await {
                Ok(e) => e.text().await,
                Err(e) => Err(e),
            };
            match got {
                Ok(t) => return t,
                Err(e) if Instant::now() > deadline => panic!("no text at {css}: {e}"),
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    /// The first element matching `css`, waiting up to 10 s for it. A find
    /// that fails is tried again until then: the element may not be there
    /// yet, or the page a click loads may abort the find ("aborted by
    /// navigation", seen on a busy machine).
    async fn find(&self, css: &str) -> Element {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match self.client.find(Locator::Css(css)).await {
                Ok(e) => return e,
                Err(e) if Instant::now() > deadline => panic!("no element {css}: {e}"),
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    /// Attribute `name` of the first element matching `css`, if both exist,
    /// waiting up to 10 s for the element (as [`Browser::text`] does, a
    /// read that a navigation interrupts is tried again).
    pub async fn attr(&self, css: &str, name: &str) -> Option<String> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match self.find(css).await.attr(name).await {
                Ok(v) => return v,
                Err(e) if Instant::now() > deadline => panic!("attribute {name} of {css}: {e}"),
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    /// Clicks the first element matching `css`.
    pub async fn click(&self, css: &str) {
        self.find(css)
            .await
            .click()
            .await
            .unwrap_or_else(|e| panic!("click {css}: {e}"));
    }

    /// Clicks `css`, which loads another page (a form's submit, a link),
    /// and waits up to 10 s for that page to have loaded. A read straight
    /// after a bare click can still find the old page, whose elements the
    /// new one often shares (a filter's count, a page of rows).
    pub async fn click_to_page(&self, css: &str) {
        self.client
            .execute("window.__outboxOldPage = true;", vec![])
            .await
            .expect("mark the page");
        self.click(css).await;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            // Errors while the page unloads count as not loaded yet.
            let loaded = self
                .client
                .execute(
                    "return window.__outboxOldPage !== true && document.readyState === 'complete';",
                    vec![],
                )
                .await
                .ok()
                .and_then(|v| v.as_bool())
                .unwrap_or(false);
            if loaded {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "no new page within 10 s of clicking {css}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Replaces the text of the input matching `css` with `text`.
    pub async fn type_into(&self, css: &str, text: &str) {
        let e = self.find(css).await;
        e.clear().await.expect("clear");
        e.send_keys(text).await.expect("type");
    }

    /// Whether an element matches `css` now.
    pub async fn exists(&self, css: &str) -> bool {
        !self
            .client
            .find_all(Locator::Css(css))
            .await
            .expect("find")
            .is_empty()
    }

    /// On an action's confirmation page: checks it counts `n` events
    /// (screenshot `shot` of it, if given), gives a reason, confirms, and
    /// checks the result says it touched `n`.
    pub async fn confirm_action(&self, n: usize, shot: Option<&str>) {
        let n = n.to_string();
        let counted = self.attr("#confirm-count", "data-count").await;
        assert_eq!(
            counted.as_deref(),
            Some(n.as_str()),
            "the confirmation's count"
        );
        if let Some(name) = shot {
            self.screenshot(name).await;
        }
        self.type_into("#reason", "consumer fixed, see ticket 7")
            .await;
        self.click("#confirm").await;
        let touched = self.attr("#result", "data-count").await;
        assert_eq!(
            touched.as_deref(),
            Some(n.as_str()),
            "what the action touched"
        );
    }

    /// Saves a screenshot as `target/console-screenshots/<name>.png`.
    pub async fn screenshot(&self, name: &str) {
        let png = self.client.screenshot().await.expect("screenshot");
        let path = artifacts("console-screenshots").join(format!("{name}.png"));
        std::fs::write(&path, png).expect("write screenshot");
    }

    /// Ends the session and its chromium.
    pub async fn close(self) {
        let _ = self.client.clone().close().await;
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // chromedriver's group: chromedriver and the chromium it started.
        let group = nix::unistd::Pid::from_raw(self._driver.id() as i32);
        let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL);
    }
}
