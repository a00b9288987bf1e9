//! The commit-subject rule, checked on every commit made since it was adopted.
//!
//! A subject is at most [`MAX_SUBJECT`] characters and reads `area: summary` (`umbp-ssd: split the
//! read path into its own module`), so `git log --oneline` reads like a changelog; figures and
//! reasoning go in the body. The commits before [`ADOPTED_AFTER`] keep their long subjects: `main`
//! is only ever fast-forwarded, so rewriting landed history is refused, and the rule applies from
//! the first commit after that point on.

use std::path::Path;
use std::process::Command;

use anyhow::{Context as _, bail};

/// The last commit before the rule: every commit after it on `HEAD`'s history is checked.
pub const ADOPTED_AFTER: &str = "ce7b356ea85fb8c413f4b6e2c9877632185be3a1";

/// The longest subject allowed, in characters.
pub const MAX_SUBJECT: usize = 72;

/// Why a subject breaks the rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SubjectProblem {
    /// Longer than [`MAX_SUBJECT`] characters.
    TooLong(usize),
    /// Not `area: summary`: no area before a `": "`, or nothing after it.
    NoArea,
}

impl std::fmt::Display for SubjectProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::TooLong(n) => write!(f, "{n} characters, at most {MAX_SUBJECT}"),
            Self::NoArea => f.write_str("not `area: summary` (an area such as `umbp-ssd` or `docs`, then `: `)"),
        }
    }
}

/// Checks one subject line. An area is a short word or path (`umbp-ssd`, `PoolClient docs`,
/// `umbp-core/units`) of letters, digits and `-_./ ,`, at most 32 characters.
pub fn check_subject(subject: &str) -> Vec<SubjectProblem> {
    let mut problems = Vec::new();
    let len = subject.chars().count();
    if len > MAX_SUBJECT {
        problems.push(SubjectProblem::TooLong(len));
    }
    let well_formed = subject.split_once(": ").is_some_and(|(area, summary)| {
        !area.is_empty()
            && area.len() <= 32
            && area.chars().all(|c| c.is_ascii_alphanumeric() || "-_./ ,".contains(c))
            && !summary.trim().is_empty()
    });
    if !well_formed {
        problems.push(SubjectProblem::NoArea);
    }
    problems
}

/// Checks every commit after [`ADOPTED_AFTER`] in the repository at `root`. Returns how many were
/// checked; `None` when the adoption commit is not in this clone (a shallow clone), so there is
/// nothing to compare against.
pub fn check(root: &Path) -> anyhow::Result<Option<usize>> {
    let known = git(root, &["cat-file", "-e", &format!("{ADOPTED_AFTER}^{{commit}}")]);
    if known.is_err() {
        return Ok(None);
    }
    let log = git(root, &["log", "--no-merges", "--format=%h%x09%s", &format!("{ADOPTED_AFTER}..HEAD")])?;
    let mut bad = Vec::new();
    let mut checked = 0;
    for line in log.lines().filter(|l| !l.is_empty()) {
        checked += 1;
        let (hash, subject) = line.split_once('\t').unwrap_or((line, ""));
        for problem in check_subject(subject) {
            bad.push(format!("  {hash} {subject:?}: {problem}"));
        }
    }
    if !bad.is_empty() {
        bail!(
            "{} commit subject(s) break the rule (reword them before they land: `git rebase -i {}`):\n{}",
            bad.len(),
            &ADOPTED_AFTER[..12],
            bad.join("\n")
        );
    }
    Ok(Some(checked))
}

fn git(root: &Path, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new("git")
        .args(args)
        .current_dir(root)
        .output()
        .with_context(|| format!("running git {}", args.join(" ")))?;
    if !out.status.success() {
        bail!("git {} failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    String::from_utf8(out.stdout).context("git printed something that is not UTF-8")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_area_and_a_short_summary_pass() {
        assert!(check_subject("umbp-ssd: split the read path into its own module").is_empty());
        assert!(check_subject("PoolClient docs: staging_pages bounds concurrency").is_empty());
        assert!(check_subject("umbp-core/units: parse sizes once").is_empty());
    }

    #[test]
    fn a_long_subject_is_refused_with_its_length() {
        let subject = format!("docs: {}", "x".repeat(67));
        assert_eq!(check_subject(&subject), vec![SubjectProblem::TooLong(73)]);
        assert!(check_subject(&format!("docs: {}", "x".repeat(66))).is_empty());
    }

    #[test]
    fn a_subject_without_an_area_is_refused() {
        for subject in [
            "Tidy the grant check",
            ": no area",
            "docs:",
            "docs:no space",
            "a sentence with a colon somewhere: later on",
        ] {
            assert_eq!(check_subject(subject), vec![SubjectProblem::NoArea], "{subject}");
        }
    }

    #[test]
    fn the_commits_since_the_rule_was_adopted_follow_it() {
        // In a full clone this checks the real history; in a shallow one there is nothing to check.
        let root = crate::workspace_root();
        if let Some(checked) = check(&root).expect("history check") {
            assert!(checked > 0);
        }
    }
}
