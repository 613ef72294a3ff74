//! The report's renderings: a terminal table, JSON and JUnit XML.

use std::fmt::Write as _;

use super::{Level, Report, Verdict};

impl Level {
    /// The level as the reports spell it: `required` or `advisory`.
    pub fn as_str(self) -> &'static str {
        match self {
            Level::Required => "required",
            Level::Advisory => "advisory",
        }
    }
}

impl Verdict {
    /// The verdict as the reports spell it: `pass`, `FAIL`'s lowercase `fail`, `info`, `skipped`.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Pass => "pass",
            Verdict::Fail => "fail",
            Verdict::Info => "info",
            Verdict::Skipped => "skipped",
        }
    }
}

impl Report {
    /// A terminal table: check, level, verdict, rule, and what it saw; then a summary line.
    pub fn table(&self) -> String {
        let id_width = self
            .checks
            .iter()
            .map(|c| c.id.len())
            .max()
            .unwrap_or(5)
            .max(5);
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{:<id_width$}  {:<8}  {:<7}  rule / saw",
            "check", "level", "verdict"
        );
        for c in &self.checks {
            let verdict = match c.verdict {
                Verdict::Fail => "FAIL",
                other => other.as_str(),
            };
            let _ = writeln!(
                out,
                "{:<id_width$}  {:<8}  {:<7}  {}",
                c.id,
                c.level.as_str(),
                verdict,
                c.rule
            );
            let _ = writeln!(
                out,
                "{:<id_width$}  {:<8}  {:<7}  saw: {}",
                "", "", "", c.saw
            );
        }
        let failed = self
            .checks
            .iter()
            .filter(|c| c.level == Level::Required && c.verdict == Verdict::Fail)
            .count();
        let _ = writeln!(
            out,
            "{} checks, {} required failed; {} writes made of {} planned",
            self.checks.len(),
            failed,
            self.writes_made,
            self.writes_planned
        );
        out
    }

    /// The report as JSON: `writes_planned`, `writes_made`, `exit_code`, and `checks`, each
    /// with `id`, `rule`, `level`, `verdict`, `saw`.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "writes_planned": self.writes_planned,
            "writes_made": self.writes_made,
            "exit_code": self.exit_code(),
            "checks": self.checks.iter().map(|c| serde_json::json!({
                "id": c.id,
                "rule": c.rule,
                "level": c.level.as_str(),
                "verdict": c.verdict.as_str(),
                "saw": c.saw,
            })).collect::<Vec<_>>(),
        })
    }

    /// The report as JUnit XML, one test case per check: a failed required check is a
    /// `<failure>`, a skipped check `<skipped/>`; what it saw is the case's `system-out`.
    pub fn junit_xml(&self) -> String {
        let failures = self
            .checks
            .iter()
            .filter(|c| c.level == Level::Required && c.verdict == Verdict::Fail)
            .count();
        let skipped = self
            .checks
            .iter()
            .filter(|c| c.verdict == Verdict::Skipped)
            .count();
        let mut out = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
        let _ = writeln!(
            out,
            "<testsuite name=\"idemkey check\" tests=\"{}\" failures=\"{failures}\" skipped=\"{skipped}\">",
            self.checks.len()
        );
        for c in &self.checks {
            let _ = writeln!(
                out,
                "  <testcase classname=\"idemkey.check.{}\" name=\"{}\">",
                c.level.as_str(),
                c.id
            );
            match c.verdict {
                Verdict::Fail if c.level == Level::Required => {
                    let _ = writeln!(
                        out,
                        "    <failure message=\"{}\">{}</failure>",
                        escape(c.rule),
                        escape(&c.saw)
                    );
                }
                Verdict::Skipped => out.push_str("    <skipped/>\n"),
                _ => {}
            }
            let _ = writeln!(
                out,
                "    <system-out>{}: {}; saw: {}</system-out>",
                c.verdict.as_str(),
                escape(c.rule),
                escape(&c.saw)
            );
            out.push_str("  </testcase>\n");
        }
        out.push_str("</testsuite>\n");
        out
    }
}

/// Escapes text for an XML attribute or element; control characters XML 1.0 cannot carry
/// are written as `?`.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for ch in text.chars() {
        match ch {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            '\t' | '\n' | '\r' => out.push(ch),
            c if c.is_control() => out.push('?'),
            c => out.push(c),
        }
    }
    out
}
