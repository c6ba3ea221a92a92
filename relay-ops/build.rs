//! Names the commit the relay was built from, for `outbox-relay --version`
//! (`outbox-relay 0.1.0 (abc1234 2026-12-02)`), in `OUTBOX_RELAY_BUILD`.
//!
//! In order: the environment variable `OUTBOX_RELAY_COMMIT` when set (a
//! build without `.git`, such as a container build, passes it); the commit
//! cargo recorded in `.cargo_vcs_info.json` when these are packaged sources
//! (`cargo publish`, `cargo install outbox-relay-ops`); `git` when the sources sit
//! in a work tree; else `unknown`. Never fails the build.
//!
//! Only builds of the `release` profile and those inheriting it (`dist`,
//! `cargo install`) ask git:
//! naming the commit makes cargo rebuild this package, and everything that
//! depends on it, whenever `HEAD` moves, and in a development work tree
//! that is every commit, for every test binary. Debug builds say
//! `dev build` instead.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=OUTBOX_RELAY_COMMIT");
    let manifest_dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    let build = match std::env::var("OUTBOX_RELAY_COMMIT") {
        Ok(commit) if !commit.trim().is_empty() => commit.trim().to_owned(),
        _ => packaged_commit(&manifest_dir).unwrap_or_else(|| {
            if std::env::var("PROFILE").as_deref() == Ok("debug") {
                "dev build".to_owned()
            } else {
                git_commit(&manifest_dir).unwrap_or_else(|| "unknown".to_owned())
            }
        }),
    };
    println!("cargo:rustc-env=OUTBOX_RELAY_BUILD={build}");
}

/// Packaged sources (no `.git`, even when unpacked inside another work
/// tree, as `cargo publish` verifies them under `target/package/`): the
/// commit cargo packaged them from.
fn packaged_commit(manifest_dir: &Path) -> Option<String> {
    let info = manifest_dir.join(".cargo_vcs_info.json");
    // Cargo reruns a build script on every build while a watched path is
    // missing: watch only what exists.
    let text = std::fs::read_to_string(&info).ok()?;
    println!("cargo:rerun-if-changed={}", info.display());
    // `"sha1": "<40 hex digits>"`; no JSON parser for one field.
    let rest = &text[text.find("\"sha1\"")? + "\"sha1\"".len()..];
    let start = rest.find('"')? + 1;
    let sha1 = rest[start..].split('"').next()?;
    let short = sha1
        .get(..7)
        .filter(|s| s.bytes().all(|b| b.is_ascii_hexdigit()))?;
    let dirty = if text.contains("\"dirty\": true") {
        "-dirty"
    } else {
        ""
    };
    Some(format!("{short}{dirty}"))
}

/// The work tree's `HEAD`: short hash and commit date. Reruns only when
/// `HEAD` moves (a commit, a checkout): cargo watches `HEAD`, the branch's
/// ref file and `packed-refs`.
fn git_commit(manifest_dir: &Path) -> Option<String> {
    // Packaged sources have no work tree of their own: the one git would
    // find above them is someone else's.
    if manifest_dir.join(".cargo_vcs_info.json").exists() {
        return None;
    }
    let git = |args: &[&str]| -> Option<String> {
        let out = Command::new("git")
            .args(args)
            .current_dir(manifest_dir)
            .output()
            .ok()?;
        let text = String::from_utf8(out.stdout).ok()?;
        (out.status.success() && !text.trim().is_empty()).then(|| text.trim().to_owned())
    };
    let watch = |path: Option<String>| {
        if let Some(path) = path {
            let path = manifest_dir.join(path);
            if path.exists() {
                println!("cargo:rerun-if-changed={}", path.display());
            }
        }
    };
    // Git paths are relative to the current directory (here the manifest
    // directory) unless absolute; `--git-path` also finds them in a linked
    // work tree.
    watch(git(&["rev-parse", "--git-path", "HEAD"]));
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watch(git(&["rev-parse", "--git-path", &branch]));
    }
    watch(git(&["rev-parse", "--git-path", "packed-refs"]));
    let hash = git(&["rev-parse", "--short", "HEAD"])?;
    match git(&["show", "-s", "--format=%cs", "HEAD"]) {
        Some(date) => Some(format!("{hash} {date}")),
        None => Some(hash),
    }
}
