//! `docs/GETTING_STARTED.md` is this example's tutorial, and quotes it:
//! every Rust block there names the file it comes from
//! (```` ```rust file=examples/payments/src/api.rs ````) and is a piece of
//! it as it is; a file's pieces, in the order the tutorial gives them and
//! a blank line apart, are the whole file, so whoever follows the
//! tutorial alone builds this crate. The versions its TOML blocks give
//! are the workspace's own.

use std::collections::BTreeMap;
use std::path::Path;

const DOC: &str = "docs/GETTING_STARTED.md";

fn read(path: &str) -> String {
    let full = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{}: {e}", full.display()))
}

/// A fenced block: the line its fence opens on, its info string, its text.
struct Block {
    line: usize,
    info: String,
    text: String,
}

/// The fenced blocks of a Markdown text (fences at the start of a line).
fn blocks(markdown: &str) -> Vec<Block> {
    let mut found = Vec::new();
    let mut open: Option<Block> = None;
    for (i, line) in markdown.lines().enumerate() {
        match (open.as_mut(), line.strip_prefix("```")) {
            (None, Some(info)) => {
                open = Some(Block {
                    line: i + 1,
                    info: info.trim().to_owned(),
                    text: String::new(),
                })
            }
            (Some(_), Some(rest)) if rest.trim().is_empty() => found.extend(open.take()),
            (Some(block), _) => {
                block.text.push_str(line);
                block.text.push('\n');
            }
            (None, None) => {}
        }
    }
    assert!(open.is_none(), "{DOC}: a fence is never closed");
    found
}

#[test]
fn every_rust_block_is_a_piece_of_the_example_and_the_pieces_are_whole_files() {
    let doc = read(DOC);
    let mut pieces: BTreeMap<&str, Vec<&Block>> = BTreeMap::new();
    let all = blocks(&doc);
    for block in all.iter().filter(|b| b.info.starts_with("rust")) {
        let file = block
            .info
            .split_whitespace()
            .find_map(|w| w.strip_prefix("file="))
            .unwrap_or_else(|| {
                panic!(
                    "{DOC}:{}: a rust block without file=<path>: every snippet is quoted from code CI compiles",
                    block.line
                )
            });
        assert!(
            read(file).contains(&block.text),
            "{DOC}:{}: this block is not in {file} as it is:\n{}",
            block.line,
            block.text
        );
        pieces.entry(file).or_default().push(block);
    }
    for file in [
        "examples/payments/src/lib.rs",
        "examples/payments/src/api.rs",
        "examples/payments/src/ledger.rs",
        "examples/payments/src/main.rs",
        "examples/payments/tests/payments.rs",
    ] {
        let quoted: Vec<&str> = pieces
            .get(file)
            .unwrap_or_else(|| panic!("{DOC} does not quote {file}"))
            .iter()
            .map(|b| b.text.as_str())
            .collect();
        assert!(
            quoted.join("\n") == read(file),
            "{DOC}: the pieces of {file}, in order and a blank line apart, are not the whole file"
        );
    }
}

/// The version a dependency line gives: `name = "1"` or
/// `name = { version = "1", ... }`.
fn version(line: &str) -> Option<(&str, &str)> {
    let (name, spec) = line.split_once('=')?;
    let spec = spec.trim();
    let quoted = match spec.strip_prefix('"') {
        Some(v) => v,
        None => spec.split_once("version = \"")?.1,
    };
    Some((name.trim(), quoted.split('"').next()?))
}

#[test]
fn the_versions_the_tutorial_gives_are_the_workspaces() {
    let manifest = read("Cargo.toml");
    let workspace: BTreeMap<&str, &str> = manifest
        .split("[workspace.dependencies]")
        .nth(1)
        .expect("[workspace.dependencies]")
        .lines()
        .take_while(|l| !l.starts_with('['))
        .filter_map(version)
        .collect();
    let doc = read(DOC);
    let blocks = blocks(&doc);
    let mut named = Vec::new();
    for block in blocks.iter().filter(|b| b.info == "toml") {
        for line in block
            .text
            .lines()
            .filter(|l| !l.is_empty() && !l.starts_with(['#', '[']))
        {
            let (name, given) = version(line)
                .unwrap_or_else(|| panic!("{DOC}:{}: no version in {line:?}", block.line));
            let ours = workspace
                .get(name)
                .unwrap_or_else(|| panic!("{DOC}: {name} is not a dependency of the workspace"));
            // "0.1" asks for what the workspace's "0.1.0" is.
            assert!(
                *ours == given || ours.starts_with(&format!("{given}.")),
                "{DOC}: {name} {given}, but the workspace uses {ours}"
            );
            named.push(name);
        }
    }
    for name in ["outbox", "outbox-consumer", "sqlx", "axum", "lapin"] {
        assert!(named.contains(&name), "{DOC} gives no version of {name}");
    }
}
