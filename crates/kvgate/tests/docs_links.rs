//! The docs stay usable: every link in README.md and docs/ resolves, offline (a relative
//! link names a file or folder of the repository, an anchor names a heading of the file
//! it points into, by GitHub's slugs; web links are not fetched); DESIGN.md numbers its
//! sections in order; README and BENCHMARKS stay within their sizes.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The markdown files checked: README.md and everything under docs/.
fn pages() -> Vec<PathBuf> {
    let mut out = vec![repo().join("README.md")];
    let mut dirs = vec![repo().join("docs")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                out.push(path);
            }
        }
    }
    out
}

/// Text outside fenced code blocks.
fn prose(text: &str) -> String {
    let mut fenced = false;
    text.lines()
        .filter(|l| {
            if l.trim_start().starts_with("```") {
                fenced = !fenced;
                return false;
            }
            !fenced
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// GitHub's anchor of a heading: lower case, punctuation dropped, spaces to dashes.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a markdown file's headings (a repeated heading gets `-1`, `-2`, ...).
fn anchors(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in prose(text).lines() {
        let Some(heading) = line.strip_prefix('#') else {
            continue;
        };
        let base = slug(heading.trim_start_matches('#'));
        let mut anchor = base.clone();
        let mut n = 0;
        while !out.insert(anchor.clone()) {
            n += 1;
            anchor = format!("{base}-{n}");
        }
    }
    out
}

/// The targets of `[text](target)` links in a page's prose.
fn links(text: &str) -> Vec<String> {
    let prose = prose(text);
    let mut out = Vec::new();
    let mut rest = prose.as_str();
    while let Some(i) = rest.find("](") {
        let after = &rest[i + 2..];
        let Some(end) = after.find(')') else { break };
        out.push(after[..end].trim().to_owned());
        rest = &after[end..];
    }
    out
}

#[test]
fn every_link_in_the_docs_resolves() {
    let mut broken = Vec::new();
    let pages = pages();
    assert!(pages.len() >= 4, "{pages:?}");
    for page in &pages {
        let text = std::fs::read_to_string(page).unwrap();
        for link in links(&text) {
            if link.starts_with("http://") || link.starts_with("https://") {
                continue;
            }
            let (file, anchor) = link.split_once('#').unwrap_or((&link, ""));
            let target = if file.is_empty() {
                page.clone()
            } else {
                page.parent().unwrap().join(file)
            };
            if !target.exists() {
                broken.push(format!("{}: {link} (no such file)", page.display()));
                continue;
            }
            if !anchor.is_empty() && target.extension().is_some_and(|e| e == "md") {
                let headings = anchors(&std::fs::read_to_string(&target).unwrap());
                if !headings.contains(anchor) {
                    broken.push(format!("{}: {link} (no such heading)", page.display()));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn slugs_follow_github() {
    assert_eq!(
        slug("3. Load and the cost model"),
        "3-load-and-the-cost-model"
    );
    assert_eq!(
        slug("Inside Ray Serve LLM: `kvgate.ray.llm`"),
        "inside-ray-serve-llm-kvgaterayllm"
    );
    assert_eq!(
        slug("2. Shared-prefix herding (one system prompt shared by everyone)"),
        "2-shared-prefix-herding-one-system-prompt-shared-by-everyone"
    );
}

/// docs/DESIGN.md numbers its sections 0, 1, 2, ... in the order they appear.
#[test]
fn design_sections_are_numbered_in_order() {
    let text = std::fs::read_to_string(repo().join("docs/DESIGN.md")).unwrap();
    let numbers: Vec<u32> = prose(&text)
        .lines()
        .filter_map(|l| l.strip_prefix("## "))
        .filter_map(|h| h.split('.').next()?.parse().ok())
        .collect();
    let expected: Vec<u32> = (0..numbers.len() as u32).collect();
    assert_eq!(numbers, expected);
}

/// README.md stays a guide and docs/BENCHMARKS.md a reference of today's results: at
/// most 300 and 400 lines (details go to docs/operations.md and docs/configuration.md,
/// history to git).
#[test]
fn readme_and_benchmarks_stay_short() {
    for (file, max) in [("README.md", 300), ("docs/BENCHMARKS.md", 400)] {
        let lines = std::fs::read_to_string(repo().join(file))
            .unwrap()
            .lines()
            .count();
        assert!(lines <= max, "{file} has {lines} lines (at most {max})");
    }
}
