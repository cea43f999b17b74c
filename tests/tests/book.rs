//! The book's code comes from compiled files: every `{{#include}}` resolves to an existing
//! file (and anchor), and no chapter is empty.

use std::path::{Path, PathBuf};

fn book_src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../book/src")
}

#[test]
fn every_include_resolves_and_no_chapter_is_empty() {
    let src = book_src();
    let summary = std::fs::read_to_string(src.join("SUMMARY.md")).expect("SUMMARY.md");
    let chapters: Vec<String> = summary
        .lines()
        .filter_map(|l| {
            l.split_once("](")
                .map(|(_, rest)| rest.trim_end_matches(')').to_string())
        })
        .collect();
    assert!(!chapters.is_empty());
    let mut includes = 0;
    for chapter in &chapters {
        assert!(!chapter.is_empty(), "an empty chapter link in SUMMARY.md");
        let page =
            std::fs::read_to_string(src.join(chapter)).unwrap_or_else(|e| panic!("{chapter}: {e}"));
        assert!(page.lines().count() > 5, "{chapter} is nearly empty");
        for part in page.split("{{#include ").skip(1) {
            let target = part.split("}}").next().expect("closing braces");
            let (file, anchor) = match target.rsplit_once(':') {
                Some((f, a)) if !a.contains('/') => (f, Some(a)),
                _ => (target, None),
            };
            let text = std::fs::read_to_string(src.join(file))
                .unwrap_or_else(|e| panic!("{chapter}: include {file}: {e}"));
            if let Some(anchor) = anchor {
                assert!(
                    text.contains(&format!("ANCHOR: {anchor}"))
                        && text.contains(&format!("ANCHOR_END: {anchor}")),
                    "{chapter}: anchor {anchor} missing in {file}"
                );
            }
            includes += 1;
        }
    }
    assert!(includes >= 3, "only {includes} includes");
}
