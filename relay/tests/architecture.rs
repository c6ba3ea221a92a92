//! `docs/ARCHITECTURE.md` matches the code: every file or folder it names
//! in backticks (a name ending in `.rs`, `.sql`, `.md` or `/`, or a path
//! with a `/`) exists in the workspace, at the end of some path (`claim/`
//! is `relay/src/claim/`), and a `*` stands for one name (`lease/*.sql`).
//! A module renamed, moved or removed fails here until the page follows.

use std::path::Path;

/// The workspace's files and folders (folders with a trailing `/`),
/// relative to its root; build output and version control left out.
fn tree(root: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut todo = vec![root.to_path_buf()];
    while let Some(dir) = todo.pop() {
        for entry in std::fs::read_dir(&dir).expect("readable workspace folder") {
            let path = entry.expect("readable entry").path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if matches!(name, "target" | ".git" | "node_modules") {
                continue;
            }
            let rel = path
                .strip_prefix(root)
                .expect("below the root")
                .to_string_lossy()
                .into_owned();
            if path.is_dir() {
                out.push(format!("{rel}/"));
                todo.push(path);
            } else {
                out.push(rel);
            }
        }
    }
    out
}

/// The names in backticks that are files or folders.
fn named_paths(page: &str) -> Vec<String> {
    page.split('`')
        .skip(1)
        .step_by(2)
        .filter(|t| {
            !t.is_empty()
                && t.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_./*-".contains(c))
                && !t.starts_with(['-', '.'])
                && (t.contains('/') || [".rs", ".sql", ".md"].iter().any(|e| t.ends_with(e)))
        })
        .map(str::to_owned)
        .collect()
}

/// `path` ends with `name` at a folder boundary; `*` in `name` is one
/// name.
fn names(path: &str, name: &str) -> bool {
    // A folder matches with or without its trailing slash.
    let at_boundary = |p: &str, tail: &str| {
        [p, p.trim_end_matches('/')]
            .iter()
            .any(|p| *p == tail || p.ends_with(&format!("/{tail}")))
    };
    match name.split_once('*') {
        None => at_boundary(path, name),
        Some((before, after)) => path.strip_suffix(after).is_some_and(|rest| {
            rest.rfind('/')
                .map_or(rest.is_empty() && before.is_empty(), |slash| {
                    !rest[slash + 1..].is_empty() && at_boundary(&rest[..=slash], before)
                })
        }),
    }
}

#[test]
fn every_module_the_architecture_page_names_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let page = std::fs::read_to_string(root.join("docs/ARCHITECTURE.md")).expect("the page");
    let tree = tree(&root);
    let named = named_paths(&page);
    assert!(named.len() > 40, "too few names read: {named:?}");
    let missing: Vec<&String> = named
        .iter()
        .filter(|n| !tree.iter().any(|p| names(p, n)))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/ARCHITECTURE.md names what the workspace does not hold: {missing:?}"
    );
}

#[test]
fn a_name_matches_at_a_folder_boundary_only() {
    assert!(names("relay/src/claim/", "claim/"));
    assert!(names("tests/support/", "tests/support"));
    assert!(!names("relay/src/subclaim/", "claim/"));
    assert!(names("relay/src/lease/round.sql", "lease/*.sql"));
    assert!(!names("relay/src/lease/x/round.sql", "lease/*.sql"));
    assert!(!names("relay/src/lease/", "lease/*.sql"));
    assert_eq!(
        named_paths("`a.rs`, `--flag`, `Type`, `x::y`, `d/`, `{schema}`, `.sql`"),
        ["a.rs", "d/"]
    );
}

/// The libraries' and the binary's sources: every `.rs` under a `src/` of
/// the published crates.
fn library_sources(root: &Path) -> Vec<String> {
    const CRATES: [&str; 5] = [
        "outbox-core",
        "outbox-lib",
        "consumer-lib",
        "relay",
        "relay-ops",
    ];
    tree(root)
        .into_iter()
        .filter(|p| {
            p.ends_with(".rs") && CRATES.iter().any(|c| p.starts_with(&format!("{c}/src/")))
        })
        .collect()
}

/// One SQL style (`outbox_core::sql`): no library code vouches for SQL
/// text of its own making. Every statement naming a schema is a template
/// rendered by `outbox_core::sql`, the only user of `AssertSqlSafe`.
#[test]
fn sql_text_is_rendered_from_templates_only() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let sources = library_sources(&root);
    assert!(
        sources.len() > 100,
        "too few sources read: {}",
        sources.len()
    );
    let own: Vec<&String> = sources
        .iter()
        .filter(|p| p.as_str() != "outbox-core/src/sql.rs")
        .filter(|p| {
            std::fs::read_to_string(root.join(p))
                .expect("readable source")
                .contains("AssertSqlSafe")
        })
        .collect();
    assert!(
        own.is_empty(),
        "SQL text made outside outbox_core::sql (render a template instead): {own:?}"
    );
}

/// The type an inherent `impl` block at the start of `line` is for (`impl
/// Name {`, `impl<T> Name<T> {`), or `None` for anything else (a trait's
/// impl, `impl X for Y`, is allowed anywhere).
fn inherent_impl(line: &str) -> Option<&str> {
    let rest = line.trim_start().strip_prefix("impl")?;
    if !line.trim_end().ends_with('{') || line.contains(" for ") {
        return None;
    }
    // Skip the impl's own generics, `impl<T: X<Y>>`.
    let rest = match rest.strip_prefix('<') {
        Some(generic) => {
            let mut depth = 1;
            let end = generic.char_indices().find_map(|(i, c)| {
                depth += match c {
                    '<' => 1,
                    '>' => -1,
                    _ => 0,
                };
                (depth == 0).then_some(i)
            })?;
            &generic[end + 1..]
        }
        None => rest,
    };
    let rest = rest.strip_prefix(' ')?.trim_start();
    let end = rest
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(rest.len());
    let name = &rest[..end];
    name.starts_with(|c: char| c.is_ascii_uppercase())
        .then_some(name)
}

/// One `impl` per type, in one file: a type's inherent methods are read in
/// one place, and calls between them draw no arrow a reader would miss.
/// Two types of one name in one crate fail too: a name means one thing.
#[test]
fn no_type_has_its_inherent_impl_split_across_files() {
    use std::collections::BTreeMap;
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files_of: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
    for path in library_sources(&root) {
        let krate = path.split('/').next().unwrap_or("").to_owned();
        let text = std::fs::read_to_string(root.join(&path)).expect("readable source");
        for name in text.lines().filter_map(inherent_impl) {
            let files = files_of
                .entry((krate.clone(), name.to_owned()))
                .or_default();
            if !files.contains(&path) {
                files.push(path.clone());
            }
        }
    }
    assert!(
        files_of.len() > 80,
        "too few impls read: {}",
        files_of.len()
    );
    let split: Vec<_> = files_of
        .iter()
        .filter(|(_, files)| files.len() > 1)
        .collect();
    assert!(
        split.is_empty(),
        "a type's impl in several files: {split:?}"
    );
}

#[test]
fn an_inherent_impl_is_told_from_a_trait_impl() {
    assert_eq!(inherent_impl("impl Relay {"), Some("Relay"));
    assert_eq!(
        inherent_impl("    impl<'a, T: Into<X<Y>>> Window<'a, T> {"),
        Some("Window")
    );
    assert_eq!(inherent_impl("impl Default for Relay {"), None);
    assert_eq!(inherent_impl("impl<S> FromRequest<S> for Idempotent"), None);
    assert_eq!(inherent_impl("// impl Relay {"), None);
    assert_eq!(inherent_impl("impl Relay"), None);
}
