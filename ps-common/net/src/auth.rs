//! Security between the processes of a cluster:
//! - the shared token (`[cluster] token_file`): every worker request and every shard-to-shard
//!   report carries `authorization: Bearer <token>`, and a shard refuses a request without it,
//!   or with another, as `UNAUTHENTICATED` (compared in constant time; logged with the peer's
//!   address, never with the token);
//! - TLS (`[cluster] tls_cert`, `tls_key`, `tls_ca`, rustls): shards present the certificate,
//!   and workers and reporting shards check it against the CA and the shard's name.
//!
//! Without either nothing is checked or encrypted: keep such a cluster on loopback or a trusted
//! network.

use crate::throttle::{Repeats, ThrottleMap};
pub use ps_config::credential::{
    SHARD_TOKEN_ENV, TlsFiles, Token, constant_time_eq, random_bytes, shard_token,
};
use ps_config::runid;
use ps_proto::PsError;
pub use ps_proto::keys::SHARD_TOKEN_KEY;
use ps_proto::pb::parameter_server_client::ParameterServerClient;
use std::sync::Arc;
use tonic::metadata::AsciiMetadataValue;
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{
    Certificate, Channel, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig,
};
use tonic::{Request, Status};

/// A client of a shard, with the cluster's token on every request.
pub type Client = ParameterServerClient<InterceptedService<Channel, AddToken>>;

/// The token as a metadata value (for [`SHARD_TOKEN_KEY`]).
pub fn metadata_value(token: &Token) -> AsciiMetadataValue {
    token
        .secret()
        .parse()
        .expect("a token of printable ASCII is a valid header value")
}

/// The shard side of TLS: its certificate and key.
pub fn server_tls(tls: &TlsFiles) -> ServerTlsConfig {
    ServerTlsConfig::new().identity(Identity::from_pem(tls.cert(), tls.key()))
}

/// How a process reaches a shard: the token to add, and TLS to use.
#[derive(Clone, Debug, Default)]
pub struct ClientSecurity {
    token: Option<Token>,
    tls: Option<TlsFiles>,
    /// The run id sent on every request (`ps_config::runid`); None for the unnamed run.
    run_id: Option<String>,
}

impl ClientSecurity {
    /// How `cfg`'s processes reach a shard: its `[cluster]` token, TLS files and run id.
    pub fn of(cfg: &ps_config::Config) -> Self {
        Self::new(cfg.cluster.token.clone(), cfg.cluster.tls.clone())
            .with_run_id(cfg.cluster.run_id.clone())
    }

    /// What `[cluster]` asks for.
    pub fn new(token: Option<Token>, tls: Option<TlsFiles>) -> Self {
        Self {
            token,
            tls,
            run_id: None,
        }
    }

    /// The same, sending `run_id` (a valid id, `runid::validate`) on every request.
    pub fn with_run_id(mut self, run_id: Option<String>) -> Self {
        self.run_id = run_id;
        self
    }

    /// The token's bytes (empty without one), for the tensor data connection's hello.
    pub fn token_bytes(&self) -> &[u8] {
        self.token
            .as_ref()
            .map_or(&[][..], |t| t.secret().as_bytes())
    }

    /// The run id sent with every request (empty: the unnamed run).
    pub fn run_id(&self) -> &str {
        self.run_id.as_deref().unwrap_or("")
    }

    /// Whether connections use TLS.
    pub fn uses_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// The endpoint of the shard at `addr` (`host:port`): `https` with the CA and the name to
    /// check when TLS is on, `http` otherwise.
    pub fn endpoint(&self, addr: &str) -> Result<Endpoint, EndpointError> {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let e = Endpoint::from_shared(format!("{scheme}://{addr}")).map_err(|e| {
            EndpointError::BadAddress {
                addr: addr.to_string(),
                reason: e.to_string(),
            }
        })?;
        let Some(tls) = &self.tls else {
            return Ok(e);
        };
        let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
        let domain = tls
            .domain()
            .map_or_else(|| host.trim_matches(['[', ']']).to_string(), str::to_string);
        e.tls_config(
            ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(tls.ca()))
                .domain_name(domain),
        )
        .map_err(|source| EndpointError::Tls {
            addr: addr.to_string(),
            source,
        })
    }

    /// The interceptor that adds the token and the run id.
    pub fn interceptor(&self) -> AddToken {
        AddToken::new(self.token.as_ref()).with_run_id(self.run_id.as_deref())
    }
}

/// Why no endpoint could be made for a shard's address: trying again cannot help.
#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    /// Not `host:port`.
    #[error("bad server address {addr:?}: expected host:port ({reason})")]
    BadAddress {
        /// The address given.
        addr: String,
        /// What the URI parser said.
        reason: String,
    },
    /// The TLS configuration (the CA, the name to check) was refused.
    #[error("TLS set-up for {addr}: {source}")]
    Tls {
        /// The address given.
        addr: String,
        /// The transport's error.
        source: tonic::transport::Error,
    },
}

/// Client side: adds the token (nothing without one) and the run id (`x-ps-run-id`, nothing
/// for the unnamed run) to every request.
#[derive(Clone, Debug, Default)]
pub struct AddToken(Option<AsciiMetadataValue>, Option<AsciiMetadataValue>);

impl AddToken {
    /// Adds `token`, if any.
    pub fn new(token: Option<&Token>) -> Self {
        Self(
            token.map(|t| {
                t.header()
                    .parse()
                    .expect("a token of printable ASCII is a valid header value")
            }),
            None,
        )
    }

    /// Also adds `run_id` (an id that [`runid::validate`] accepts is a valid header
    /// value; another is left out, and the shard then refuses the request as another run's).
    pub fn with_run_id(mut self, run_id: Option<&str>) -> Self {
        self.1 = run_id.and_then(|id| id.parse().ok());
        self
    }
}

impl Interceptor for AddToken {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        if let Some(v) = &self.1 {
            req.metadata_mut().insert(ps_proto::keys::RUN_ID, v.clone());
        }
        Ok(req)
    }
}

/// Server side: refuses every request that does not carry the token (accepts all without one),
/// and every request of another run (a run id other than the shard's, `ps_config::runid`).
#[derive(Clone, Debug, Default)]
pub struct CheckToken {
    expected: Option<Arc<[u8]>>,
    shard: usize,
    run_id: Option<Arc<str>>,
}

impl CheckToken {
    /// The check of shard `shard` for `token`, if any.
    pub fn new(token: Option<&Token>, shard: usize) -> Self {
        Self {
            expected: token.map(|t| t.header().into_bytes().into()),
            shard,
            run_id: None,
        }
    }

    /// Also refuses requests whose run id differs from `run_id` (None: the unnamed run, which
    /// accepts only requests without a run id).
    pub fn with_run_id(mut self, run_id: Option<&str>) -> Self {
        self.run_id = run_id.map(Into::into);
        self
    }

    /// The run check: after the token (an unauthenticated peer learns nothing of the run).
    fn check_run(&self, req: &Request<()>) -> Result<(), Status> {
        let theirs = req
            .metadata()
            .get(ps_proto::keys::RUN_ID)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
        if theirs.as_deref() == self.run_id.as_deref() {
            return Ok(());
        }
        let peer = req
            .remote_addr()
            .map_or_else(|| "an unknown peer".to_string(), |a| a.to_string());
        let (ours, theirs) = (
            runid::show(self.run_id.as_deref()),
            runid::show(theirs.as_deref()),
        );
        if let Some(r) = REFUSED.hit(&"of another run") {
            tracing::warn!(
                "shard {}: refused a request from {peer} of {theirs} (this shard belongs to {ours}){r}",
                self.shard
            );
        }
        Err(PsError::RunMismatch {
            shard: self.shard,
            ours,
            theirs,
        }
        .into())
    }
}

/// Requests refused by [`CheckToken`] (a scanner or a stale worker repeats them), by kind,
/// logged at most once per [`crate::throttle::LOG_EVERY`] with a count.
static REFUSED: ThrottleMap<&'static str> = ThrottleMap::new();

/// The requests [`CheckToken`] refused but did not log yet, by kind, now reported (for the
/// shard's closing lines).
pub fn unreported_refusals() -> Vec<(&'static str, Repeats)> {
    REFUSED.unreported()
}

impl Interceptor for CheckToken {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        let Some(expected) = &self.expected else {
            self.check_run(&req)?;
            return Ok(req);
        };
        let got = req
            .metadata()
            .get("authorization")
            .map_or(&[][..], |v| v.as_bytes());
        if constant_time_eq(got, expected) {
            self.check_run(&req)?;
            return Ok(req);
        }
        let peer = req
            .remote_addr()
            .map_or_else(|| "an unknown peer".to_string(), |a| a.to_string());
        let what = if got.is_empty() {
            "without a token"
        } else {
            "with a wrong token"
        };
        if let Some(r) = REFUSED.hit(&what) {
            tracing::warn!(
                "shard {}: refused a request from {peer} {what}{r}",
                self.shard
            );
        }
        Err(PsError::Unauthenticated(format!(
            "request {what}: expected the cluster's shared token (`authorization: Bearer <token>`, from [cluster] token_file)"
        ))
        .into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_checked_redacted_and_validated() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("token");
        std::fs::write(&p, "0123456789abcdef0123\n").unwrap();
        let t = Token::read(&p).unwrap();
        assert_eq!(format!("{t:?}"), "Token(<redacted>)");
        std::fs::write(&p, "short").unwrap();
        let e = Token::read(&p).unwrap_err().to_string();
        assert!(e.contains("at least 16") && !e.contains("short"), "{e}");
        std::fs::write(&p, "has a space in the middle!").unwrap();
        assert!(Token::read(&p).is_err());
        assert!(Token::read(&dir.path().join("missing")).is_err());

        let mut add = AddToken::new(Some(&t));
        let mut check = CheckToken::new(Some(&t), 0);
        let req = add.call(Request::new(())).unwrap();
        assert!(check.call(req).is_ok());
        let e = check.call(Request::new(())).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        assert!(e.message().contains("without a token"), "{e:?}");
        std::fs::write(&p, "0123456789abcdef0124").unwrap();
        let other = Token::read(&p).unwrap();
        let req = AddToken::new(Some(&other)).call(Request::new(())).unwrap();
        let e = check.call(req).unwrap_err();
        assert!(
            e.message().contains("wrong token") && !e.message().contains("0123"),
            "{e:?}"
        );
        // no token configured: nothing is checked
        assert!(CheckToken::new(None, 0).call(Request::new(())).is_ok());
        // the run id: equal ids pass, another run (or none against one) is refused naming both
        let mut run7 = CheckToken::new(Some(&t), 1).with_run_id(Some("7"));
        let req = AddToken::new(Some(&t))
            .with_run_id(Some("7"))
            .call(Request::new(()))
            .unwrap();
        assert!(run7.call(req).is_ok());
        let req = AddToken::new(Some(&t))
            .with_run_id(Some("6"))
            .call(Request::new(()))
            .unwrap();
        let e = run7.call(req).unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
        assert!(
            e.message().contains("shard 1 belongs to run 7")
                && e.message().contains("comes from run 6"),
            "{e:?}"
        );
        let req = AddToken::new(Some(&t)).call(Request::new(())).unwrap();
        let e = run7.call(req).unwrap_err();
        assert!(e.message().contains("unnamed run"), "{e:?}");
        let req = AddToken::default()
            .with_run_id(Some("6"))
            .call(Request::new(()))
            .unwrap();
        let e = CheckToken::new(None, 0).call(req).unwrap_err();
        assert!(e.message().contains("belongs to the unnamed run"), "{e:?}");
        // a wrong token is refused as such, before the run is looked at
        let req = AddToken::new(Some(&other))
            .with_run_id(Some("6"))
            .call(Request::new(()))
            .unwrap();
        assert_eq!(
            run7.call(req).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"ab", b"abc"));
        assert!(!constant_time_eq(b"abcd", b"abc"));
    }
}
