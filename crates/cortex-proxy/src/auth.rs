//! Bearer tokens: the admin API's, and the public API's optional one.
//!
//! Key decision: one comparison for both listeners, in constant time for a given secret — every
//! byte of the secret is compared whatever was given, with no early return on a length mismatch
//! or at the first differing byte — so timing tells an attacker nothing about the token but its
//! length bound.

use std::sync::Arc;

use http::HeaderMap;

/// A bearer token a listener requires (`Authorization: Bearer <token>`). Its `Debug` never
/// shows the secret.
#[derive(Clone)]
pub struct Token(Arc<str>);

impl Token {
    /// The token `secret`.
    #[must_use]
    pub fn new(secret: &str) -> Self {
        Token(secret.into())
    }

    /// Whether `headers` carry this token as `Authorization: Bearer <token>`. The scheme is
    /// matched case-insensitively (`bearer`, `BEARER`: RFC 9110 §11.1), the token exactly and in
    /// constant time. A request with more than one `Authorization` header is not admitted: which
    /// of them counts would be a guess (and a server behind may take another).
    #[must_use]
    pub fn admits(&self, headers: &HeaderMap) -> bool {
        let mut all = headers.get_all(http::header::AUTHORIZATION).iter();
        let given = match (all.next(), all.next()) {
            (Some(v), None) => bearer_credentials(v.as_bytes()).unwrap_or_default(),
            _ => b"",
        };
        // An empty token is refused at configuration: nothing given never matches.
        constant_time_eq(given, self.0.as_bytes())
    }
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

/// The bearer token a worker's engine requires (its `--api-key`): Cortex sends
/// `Authorization: Bearer <key>` on every request to the worker, in place of any the client
/// sent. Marked sensitive (HTTP/2's header compression leaves it out of its table); its `Debug`
/// never shows the secret.
#[derive(Clone, PartialEq, Eq)]
pub struct WorkerKey(http::HeaderValue);

impl WorkerKey {
    /// The key `secret` (visible ASCII: the caller checks it, as for [`Token`]).
    ///
    /// # Errors
    /// `secret` cannot be a header value.
    pub fn new(secret: &str) -> Result<Self, http::header::InvalidHeaderValue> {
        let mut v = http::HeaderValue::try_from(format!("Bearer {secret}"))?;
        v.set_sensitive(true);
        Ok(WorkerKey(v))
    }

    /// Puts the key in `headers`, replacing every `Authorization` there.
    pub fn apply(&self, headers: &mut HeaderMap) {
        headers.insert(http::header::AUTHORIZATION, self.0.clone());
    }
}

impl std::fmt::Debug for WorkerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WorkerKey(<redacted>)")
    }
}

impl PartialEq for Token {
    fn eq(&self, other: &Self) -> bool {
        constant_time_eq(self.0.as_bytes(), other.0.as_bytes())
    }
}

/// The credentials of an `Authorization` value of the `Bearer` scheme (any case), after the
/// spaces that follow the scheme; `None` for another scheme.
fn bearer_credentials(value: &[u8]) -> Option<&[u8]> {
    const SCHEME: &[u8] = b"bearer";
    let (scheme, rest) = value.split_at_checked(SCHEME.len())?;
    if !scheme.eq_ignore_ascii_case(SCHEME) || rest.first() != Some(&b' ') {
        return None;
    }
    Some(rest.trim_ascii_start())
}

/// Whether `given` is `secret`, in a time that depends on the secret's length only: every byte
/// of the secret is compared, whatever was given and wherever it differs (a shorter or longer
/// token included), with no early return.
#[must_use]
pub fn constant_time_eq(given: &[u8], secret: &[u8]) -> bool {
    let mut diff = given.len() ^ secret.len();
    for (i, s) in secret.iter().enumerate() {
        diff |= usize::from(given.get(i).copied().unwrap_or(0) ^ s);
    }
    diff == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_compare() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
        assert!(!constant_time_eq(b"ab", b"abc"));
        assert!(!constant_time_eq(b"abc\0", b"abc"));
        assert!(!constant_time_eq(b"abcd", b"abc"));
        assert!(!constant_time_eq(b"", b"abc"));
        assert!(constant_time_eq(b"", b""));
    }

    #[test]
    fn only_the_exact_bearer_token_is_admitted() {
        let t = Token::new("s3cret");
        let with = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(http::header::AUTHORIZATION, v.parse().unwrap());
            h
        };
        // The scheme is case-insensitive (RFC 9110 §11.1); the token is not.
        for good in ["Bearer s3cret", "bearer s3cret", "BEARER s3cret", "bEaReR  s3cret"] {
            assert!(t.admits(&with(good)), "{good}");
        }
        for bad in [
            "Bearer s3cre",
            "Bearer s3cret!",
            "Bearer S3cret",
            "s3cret",
            "Basic s3cret",
            "Bearer ",
            "Bearers3cret",
            "Bearer\ts3cret",
            "Beare s3cret",
            "Bearer s3cret ",
        ] {
            assert!(!t.admits(&with(bad)), "{bad}");
        }
        assert!(!t.admits(&HeaderMap::new()));
        // Two headers: refused in either order, the right token first or last.
        for (first, second) in [("Bearer s3cret", "Bearer wrong"), ("Bearer wrong", "Bearer s3cret")] {
            let mut h = with(first);
            h.append(http::header::AUTHORIZATION, second.parse().unwrap());
            assert!(!t.admits(&h), "{first}, {second}");
        }
        let mut h = with("Bearer s3cret");
        h.append(http::header::AUTHORIZATION, "Bearer s3cret".parse().unwrap());
        assert!(!t.admits(&h), "even twice the same");
        assert_eq!(format!("{t:?}"), "Token(<redacted>)");
    }
}
