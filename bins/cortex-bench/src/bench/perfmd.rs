//! The generated blocks of `docs/perf.md`.
//!
//! `cargo xtask bench` owns only the text between `<!-- bench:begin NAME -->` and
//! `<!-- bench:end NAME -->` (each marker alone on its line); everything outside — the prose the
//! crate engineers wrote — is kept byte for byte.
//!
//! Key decision: a missing, repeated or unterminated block is an error before anything runs,
//! never a silent append: where a table goes is decided by a person, once, by placing markers.

use anyhow::{Result, bail};

/// The begin marker of block `name`.
#[must_use]
pub fn begin(name: &str) -> String {
    format!("<!-- bench:begin {name} -->")
}

/// The end marker of block `name`.
#[must_use]
pub fn end(name: &str) -> String {
    format!("<!-- bench:end {name} -->")
}

/// The line range strictly between block `name`'s markers, as byte offsets into `doc`.
fn locate(doc: &str, name: &str) -> Result<(usize, usize)> {
    let (b, e) = (begin(name), end(name));
    let mut start = None;
    let mut stop = None;
    let mut offset = 0;
    for line in doc.split_inclusive('\n') {
        let t = line.trim();
        if t == b {
            if start.is_some() {
                bail!("docs/perf.md: block `{name}` begins twice");
            }
            start = Some(offset + line.len());
        } else if t == e {
            if stop.is_some() {
                bail!("docs/perf.md: block `{name}` ends twice");
            }
            if start.is_none() {
                bail!("docs/perf.md: block `{name}` ends before it begins");
            }
            stop = Some(offset);
        }
        offset += line.len();
    }
    match (start, stop) {
        (Some(s), Some(e)) => Ok((s, e)),
        (None, _) => bail!("docs/perf.md has no `{b}` marker: place the block's markers first"),
        (Some(_), None) => bail!("docs/perf.md: block `{name}` is not terminated by `{e}`"),
    }
}

/// Checks that every block of `names` is present exactly once and well formed.
///
/// # Errors
/// The first block that is not.
pub fn check(doc: &str, names: &[&str]) -> Result<()> {
    for n in names {
        locate(doc, n)?;
    }
    Ok(())
}

/// `doc` with block `name`'s content replaced by `content` (a trailing newline is added if
/// missing).
///
/// # Errors
/// The block is missing or malformed.
pub fn replace(doc: &str, name: &str, content: &str) -> Result<String> {
    let (s, e) = locate(doc, name)?;
    let mut out = String::with_capacity(doc.len() + content.len());
    out.push_str(&doc[..s]);
    out.push_str(content);
    if !content.is_empty() && !content.ends_with('\n') {
        out.push('\n');
    }
    out.push_str(&doc[e..]);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOC: &str =
        "# Perf\n\nProse a.\n\n<!-- bench:begin x -->\nold\ntable\n<!-- bench:end x -->\n\nProse b.\n";

    #[test]
    fn replaces_only_inside_the_markers() {
        let out = replace(DOC, "x", "| new |").unwrap();
        assert_eq!(
            out,
            "# Perf\n\nProse a.\n\n<!-- bench:begin x -->\n| new |\n<!-- bench:end x -->\n\nProse b.\n"
        );
        // Idempotent, and an empty block stays well formed.
        assert_eq!(replace(&out, "x", "| new |\n").unwrap(), out);
        let empty = replace(DOC, "x", "").unwrap();
        assert_eq!(replace(&empty, "x", "old\ntable\n").unwrap(), DOC);
    }

    #[test]
    fn malformed_blocks_are_errors() {
        assert!(replace(DOC, "y", "t").is_err());
        assert!(check(DOC, &["x", "y"]).is_err());
        assert!(check(DOC, &["x"]).is_ok());
        let twice = format!("{DOC}{}\n{}\n", begin("x"), end("x"));
        assert!(replace(&twice, "x", "t").is_err());
        let open = "<!-- bench:begin x -->\nold\n";
        assert!(replace(open, "x", "t").is_err());
        let reversed = "<!-- bench:end x -->\n<!-- bench:begin x -->\n";
        assert!(replace(reversed, "x", "t").is_err());
    }
}
