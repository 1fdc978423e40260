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

/// What kind of connection failure `text` (an error chain) shows, in words: DNS, refused,
/// timeout, TLS, unreachable network, reset; None when it shows none of them.
pub fn kind(text: &str) -> Option<&'static str> {
    let t = text.to_ascii_lowercase();
    let has = |needles: &[&str]| needles.iter().any(|n| t.contains(n));
    if has(&[
        "dns error",
        "failed to lookup address",
        "name or service not known",
        "no address associated",
        "temporary failure in name resolution",
        "nodename nor servname",
    ]) {
        Some(
            "DNS: the shard's host name does not resolve (a typo, or the service/pod does not exist yet)",
        )
    } else if has(&["connection refused"]) {
        Some(
            "connection refused: nothing listens on that port (the shard has not started, has exited, or the port is wrong)",
        )
    } else if has(&[
        "timed out",
        "deadline has elapsed",
        "timeout expired",
        "deadline exceeded",
    ]) {
        Some(
            "timeout: no answer (the host is down, or a firewall or NetworkPolicy drops the packets)",
        )
    } else if has(&[
        "certificate",
        "invalidcertificate",
        "unknownissuer",
        "handshake",
        "tls",
        "alert",
    ]) {
        Some("TLS: the handshake failed (certificate, CA, name or a TLS/plain-text mismatch)")
    } else if has(&[
        "no route to host",
        "network is unreachable",
        "host is unreachable",
    ]) {
        Some("unreachable: no route to the shard's host")
    } else if has(&["connection reset", "broken pipe", "connection aborted"]) {
        Some("connection reset: the shard closed the connection (it stopped or restarted)")
    } else {
        None
    }
}

/// Whether the server at `addr` (host:port) answers a TLS handshake record with a TLS record
/// (an alert or a server hello), as a shard with tls_cert/tls_key does; a plain-text HTTP/2
/// server answers with an HTTP/2 frame or closes. For a plain-text client whose first request
/// was reset: a TLS server may close before its alert is read. Bounded by 2 s; false when it
/// cannot tell.
pub async fn speaks_tls(addr: &str) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let probe = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        // a handshake record holding a truncated ClientHello: a TLS server answers with an alert
        s.write_all(&[0x16, 0x03, 0x01, 0x00, 0x05, 0x01, 0x00, 0x00, 0x01, 0x00])
            .await
            .ok()?;
        let mut head = [0u8; 2];
        s.read_exact(&mut head).await.ok()?;
        Some(matches!(head, [0x15 | 0x16, 0x03]))
    };
    tokio::time::timeout(std::time::Duration::from_secs(2), probe)
        .await
        .ok()
        .flatten()
        .unwrap_or(false)
}

/// `err` as one line, followed by the TLS mismatch it shows, if any; otherwise led by the kind
/// of failure ([`kind`]), so a log never says only "transport error".
pub fn explain(err: &(dyn Error + 'static), client_tls: bool) -> String {
    let text = chain(err);
    match (tls_mismatch(&text, client_tls), kind(&text)) {
        (Some(why), _) => format!("{text} ({why})"),
        (None, Some(k)) => format!("{k} ({text})"),
        (None, None) => text,
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

    #[test]
    fn failures_are_named_by_kind() {
        let cases = [
            (
                "transport error: dns error: failed to lookup address information: Name or service not known",
                "DNS",
            ),
            (
                "transport error: tcp connect error: Connection refused (os error 111)",
                "connection refused",
            ),
            ("transport error: timed out", "timeout"),
            (
                "transport error: invalid peer certificate: UnknownIssuer",
                "TLS",
            ),
            (
                "tcp connect error: No route to host (os error 113)",
                "unreachable",
            ),
            ("connection reset by peer", "connection reset"),
        ];
        for (text, want) in cases {
            assert!(kind(text).unwrap().starts_with(want), "{text}");
            let e = std::io::Error::other(text);
            assert!(explain(&e, false).starts_with(want), "{text}");
        }
        assert_eq!(kind("transport error"), None);
    }
}
