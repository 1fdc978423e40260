//! Connection errors in words: a client and a shard that disagree about TLS fail deep inside
//! HTTP/2 or rustls ("h2 protocol error: frame with invalid size", "received corrupt message of
//! type InvalidContentType"); [`explain`] adds what went wrong, with the words "TLS expected".

use std::error::Error;

/// The error and its sources as one line (`outer: inner: innermost`, repeats left out).
pub fn chain(err: &(dyn Error + 'static)) -> String {
    let mut parts: Vec<String> = vec![err.to_string()];
    let mut src = err.source();
    while let Some(e) = src {
        let s = e.to_string();
        if !parts.iter().any(|p| p.contains(&s)) {
            parts.push(s);
        }
        src = e.source();
    }
    parts.join(": ")
}

/// What a TLS mismatch looks like from a client, if `text` (an error chain) shows one.
/// `client_tls`: whether the client spoke TLS.
pub fn tls_mismatch(text: &str, client_tls: bool) -> Option<&'static str> {
    let has = |needles: &[&str]| needles.iter().any(|n| text.contains(n));
    if client_tls {
        // a plain-text HTTP/2 answer read as a TLS record
        has(&["InvalidContentType", "corrupt message", "tls handshake eof"]).then_some(
            "TLS expected by this client (the config sets tls_cert/tls_key/tls_ca), but the shard answered in plain text: start the shards with the same [cluster] TLS settings",
        )
    } else {
        // a TLS alert read as an HTTP/2 frame header (its length is then far too large)
        has(&["frame with invalid size", "h2 protocol error", "invalid HTTP version"]).then_some(
            "TLS expected by the shard, probably: it did not answer HTTP/2 in plain text, as a shard with tls_cert/tls_key does; give this client the same [cluster] TLS settings (tls_ca)",
        )
    }
}

/// `err` as one line, followed by the TLS mismatch it shows, if any.
pub fn explain(err: &(dyn Error + 'static), client_tls: bool) -> String {
    let text = chain(err);
    match tls_mismatch(&text, client_tls) {
        Some(why) => format!("{text} ({why})"),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mismatches_named_both_ways() {
        let plain_to_tls =
            "status: Unknown, message: \"h2 protocol error: http2 error\": frame with invalid size";
        assert!(
            tls_mismatch(plain_to_tls, false)
                .unwrap()
                .contains("TLS expected")
        );
        let tls_to_plain = "transport error: received corrupt message of type InvalidContentType";
        assert!(
            tls_mismatch(tls_to_plain, true)
                .unwrap()
                .contains("TLS expected")
        );
        assert_eq!(tls_mismatch("connection refused", false), None);
        assert_eq!(tls_mismatch("connection refused", true), None);
        let e = std::io::Error::other("frame with invalid size");
        assert!(explain(&e, false).starts_with("frame with invalid size (TLS expected"));
    }
}
