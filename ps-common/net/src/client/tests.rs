//! Tests of the shard client: which errors are retryable, the push chunk layout, an unreachable shard named after the patience.

use super::*;
use ps_proto::PsError;

#[test]
fn retryable_only_where_the_same_call_can_succeed() {
    let refusal = |e: PsError| refused(0, "shard 0 refused x".into())(e.into());
    assert!(refusal(PsError::Unavailable("stopping".into())).is_retryable());
    assert!(refusal(PsError::OverBudget("partial messages".into())).is_retryable());
    assert!(
        refusal(PsError::Unavailable("stopping".into()))
            .to_string()
            .starts_with("shard 0 refused x: stopping")
    );
    for e in [
        PsError::NonFinite {
            index: 1,
            value: f32::NAN,
        },
        PsError::StaleStep {
            step: 1,
            expected: 2,
        },
        PsError::Conflict { rank: 0, step: 1 },
        PsError::Timeout("barrier".into()),
        PsError::Unauthenticated("request".into()),
        // a failed run: a retry would only meet the same refusal (or a shard gone)
        PsError::RunFailed("rank 1 stopped on an error".into()),
    ] {
        let code = e.code();
        let e = refusal(e);
        assert!(!e.is_retryable(), "{e}");
        assert_eq!(e.code(), Some(code));
    }
    let transport = refused(0, "x".into())(Status::unknown("connection reset"));
    assert!(transport.is_retryable());
    let bad = ClientError::BadReply {
        shard: 1,
        message: "empty pull reply".into(),
    };
    assert!(!bad.is_retryable() && bad.code().is_none());
    assert_eq!(bad.to_string(), "shard 1: empty pull reply");
}

#[test]
fn push_chunks_carry_the_header_once_and_offsets_in_values() {
    let h = PushHeader {
        step: 3,
        len: 5,
        ..Default::default()
    };
    let bytes = crate::wire::f32_to_bytes(&[1.0, 2.0, 3.0, 4.0, 5.0]);
    let msgs = push_chunks(h, &bytes, 8);
    assert_eq!(msgs.len(), 3);
    assert_eq!(msgs[0].header, Some(h));
    assert!(msgs[1..].iter().all(|m| m.header.is_none()));
    let offsets: Vec<u64> = msgs.iter().map(|m| m.offset).collect();
    assert_eq!(offsets, [0, 2, 4]);
    assert_eq!(msgs[2].data.len(), 4);
    let alone = push_chunks(h, &Bytes::new(), 8);
    assert_eq!(
        alone.len(),
        1,
        "a header alone (shared memory) is one chunk"
    );
    assert!(alone[0].data.is_empty() && alone[0].header.is_some());
    // what workers send: the header alone, then the data
    let msgs = push_messages(h, &bytes, 8);
    assert_eq!(msgs.len(), 4);
    assert!(msgs[0].header == Some(h) && msgs[0].data.is_empty());
    assert!(msgs[1..].iter().all(|m| m.header.is_none()));
    let offsets: Vec<u64> = msgs[1..].iter().map(|m| m.offset).collect();
    assert_eq!(offsets, [0, 2, 4]);
    assert_eq!(push_messages(h, &Bytes::new(), 8).len(), 1);
}

#[tokio::test]
async fn an_unreachable_shard_is_said_after_the_patience() {
    // a port nobody listens on: bind, read the port, close
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let t0 = Instant::now();
    let e = ShardClient::connect(
        2,
        &addr,
        &ClientSecurity::default(),
        Duration::from_millis(300),
    )
    .await
    .unwrap_err();
    assert!(
        t0.elapsed() >= Duration::from_millis(300),
        "retried until the patience ran out"
    );
    assert!(matches!(e, ClientError::Unreachable { .. }), "{e}");
    assert!(
        e.to_string()
            .starts_with(&format!("cannot reach shard at {addr}")),
        "{e}"
    );
    assert!(e.is_retryable());
    assert!(
        e.to_string()
            .contains("connection refused: nothing listens"),
        "the kind of failure is named: {e}"
    );
    let e = ShardClient::connect(0, "no port", &ClientSecurity::default(), Duration::ZERO)
        .await
        .unwrap_err();
    assert!(
        matches!(e, ClientError::BadAddress(_)) && !e.is_retryable(),
        "{e}"
    );
}
