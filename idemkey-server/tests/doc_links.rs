//! Every relative link of the README and of `docs/` resolves: the file exists, and an anchor
//! (`page.md#heading`, `#heading`) names a heading of that page, as GitHub makes them.
//! Links to other sites are not followed (no network here).

use std::collections::{BTreeMap, BTreeSet};

mod doc_pages;

use doc_pages::{pages, root};

/// The page's lines outside fenced code blocks.
fn prose(text: &str) -> Vec<&str> {
    let mut fenced = false;
    text.lines()
        .filter(|line| {
            if line.trim_start().starts_with("```") {
                fenced = !fenced;
                return false;
            }
            !fenced
        })
        .collect()
}

/// GitHub's anchor of a heading: lower case, inline code marks and punctuation other than
/// `-` and `_` dropped, spaces made `-`; a repeated heading gets `-1`, `-2`, ….
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut anchors = BTreeSet::new();
    for line in prose(text) {
        let Some(heading) = line.strip_prefix('#') else {
            continue;
        };
        let heading = heading.trim_start_matches('#');
        if !heading.starts_with(' ') {
            continue;
        }
        let slug: String = heading
            .trim()
            .to_lowercase()
            .chars()
            .filter_map(|c| match c {
                ' ' => Some('-'),
                '-' | '_' => Some(c),
                c if c.is_alphanumeric() => Some(c),
                _ => None,
            })
            .collect();
        let n = seen.entry(slug.clone()).or_default();
        anchors.insert(if *n == 0 {
            slug.clone()
        } else {
            format!("{slug}-{n}")
        });
        *n += 1;
    }
    anchors
}

/// The targets of the page's inline links `[text](target)` and reference definitions
/// `[name]: target`, outside code blocks and inline code.
fn links(text: &str) -> Vec<String> {
    let mut links = Vec::new();
    for line in prose(text) {
        // Inline code may hold `](`: leave it out.
        let line: String = line
            .split('`')
            .enumerate()
            .filter(|(i, _)| i % 2 == 0)
            .map(|(_, part)| part)
            .collect();
        let mut rest = line.as_str();
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            let Some(end) = rest.find(')') else { break };
            let target = rest[..end].split_whitespace().next().unwrap_or("");
            links.push(target.to_owned());
            rest = &rest[end..];
        }
        let trimmed = line.trim_start();
        if let Some(def) = trimmed.strip_prefix('[')
            && let Some((_, target)) = def.split_once("]: ")
        {
            links.push(target.split_whitespace().next().unwrap_or("").to_owned());
        }
    }
    links
}

#[test]
fn every_relative_link_and_anchor_resolves() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for page in pages() {
        let name = page.strip_prefix(root()).unwrap().display().to_string();
        let text = std::fs::read_to_string(&page).unwrap();
        for target in links(&text) {
            if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            let (file, anchor) = match target.split_once('#') {
                Some((file, anchor)) => (file, Some(anchor)),
                None => (target.as_str(), None),
            };
            let linked = if file.is_empty() {
                page.clone()
            } else {
                page.parent().unwrap().join(file)
            };
            if !linked.exists() {
                broken.push(format!("{name}: {target}: no such file"));
                continue;
            }
            if let Some(anchor) = anchor {
                let linked_text = std::fs::read_to_string(&linked).unwrap_or_default();
                if !anchors(&linked_text).contains(anchor) {
                    broken.push(format!("{name}: {target}: no such heading"));
                }
            }
        }
    }
    assert!(
        checked > 20,
        "only {checked} links found: the parser lost them"
    );
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn anchors_are_made_as_github_makes_them() {
    let page = "# The key secret\n## `--lease` and renewal\n```\n# not a heading\n```\n## The key secret\n";
    let anchors = anchors(page);
    assert_eq!(
        anchors,
        BTreeSet::from([
            "the-key-secret".to_owned(),
            "--lease-and-renewal".to_owned(),
            "the-key-secret-1".to_owned(),
        ])
    );
    let links = links("see [a](b.md#c), `[not](this)` and [d](e.md 'title')\n[ref]: f.md\n");
    assert_eq!(links, ["b.md#c", "e.md", "f.md"]);
}
