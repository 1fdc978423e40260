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

use crate::error::PsError;
use crate::pb::parameter_server_client::ParameterServerClient;
use crate::throttle::{Repeats, ThrottleMap};
use std::fmt;
use std::path::Path;
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

/// The shared token, kept out of `Debug` output and logs.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(Arc<str>);

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

impl Token {
    /// Reads the token from `path` (surrounding whitespace trimmed), at most
    /// [`MAX_TOKEN_FILE_BYTES`](crate::config::limits::MAX_TOKEN_FILE_BYTES) bytes: a larger
    /// or endless file (`/dev/zero`) is refused, never read without bound. The error says what
    /// was expected, never what the file holds.
    pub fn read(path: &Path) -> Result<Self, String> {
        let max = crate::config::limits::MAX_TOKEN_FILE_BYTES;
        let bytes = crate::config::limits::read_bounded(path, max)
            .map_err(|e| format!("cannot read the token file {}: {e}", path.display()))?;
        let text = String::from_utf8_lossy(&bytes);
        let t = text.trim();
        if t.len() < 16 || !t.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(format!(
                "token file {}: expected one token of at least 16 printable ASCII characters without spaces (e.g. `openssl rand -hex 32`)",
                path.display()
            ));
        }
        Ok(Self(t.into()))
    }

    fn header(&self) -> String {
        format!("Bearer {}", self.0)
    }

    /// A token from `text` (surrounding whitespace trimmed), checked as [`Token::read`] checks
    /// a file's; `what` names the source in the error.
    pub fn parse(text: &str, what: &str) -> Result<Self, String> {
        let t = text.trim();
        if t.len() < 16 || !t.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(format!(
                "{what}: expected one token of at least 16 printable ASCII characters without spaces (e.g. `openssl rand -hex 32`)"
            ));
        }
        Ok(Self(t.into()))
    }

    /// A fresh random token (32 hex digits): the shard credential `ps-launch` gives its shards.
    pub fn random() -> Self {
        let hex: String = random_bytes::<16>()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        Self(hex.into())
    }

    /// The token's text (to hand to a child process; never log it).
    pub fn secret(&self) -> &str {
        &self.0
    }

    /// The token as a metadata value (for [`SHARD_TOKEN_KEY`]).
    pub fn metadata_value(&self) -> AsciiMetadataValue {
        self.0
            .parse()
            .expect("a token of printable ASCII is a valid header value")
    }

    /// True when `got` is this token (compared in constant time).
    pub fn matches(&self, got: &[u8]) -> bool {
        constant_time_eq(got, self.0.as_bytes())
    }
}

/// The environment variable that gives a shard its shard credential when `[server]
/// shard_token_file` is not set (`ps-launch` sets it for the shards it starts, with a fresh
/// random token; workers never get it).
pub const SHARD_TOKEN_ENV: &str = "PS_SHARD_TOKEN";

/// The shard credential of this process: `[server] shard_token_file` (`file`) when set, else
/// [`SHARD_TOKEN_ENV`]; None without either.
pub fn shard_token(file: Option<&Path>) -> Result<Option<Token>, String> {
    if let Some(f) = file {
        return Token::read(f)
            .map(Some)
            .map_err(|e| format!("[server] shard_token_file: {e}"));
    }
    match std::env::var(SHARD_TOKEN_ENV) {
        Ok(v) => Token::parse(&v, SHARD_TOKEN_ENV).map(Some),
        Err(_) => Ok(None),
    }
}

/// The metadata key of the shard credential (`[server] shard_token_file`) that shards put on
/// their step reports to shard 0; workers do not have it.
pub const SHARD_TOKEN_KEY: &str = "x-ps-shard-token";

/// The PEM files of `[cluster] tls_*`, read once (the key stays out of `Debug` output).
#[derive(Clone, PartialEq, Eq)]
pub struct TlsFiles {
    cert: Arc<[u8]>,
    key: Arc<[u8]>,
    ca: Arc<[u8]>,
    domain: Option<String>,
}

impl fmt::Debug for TlsFiles {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsFiles")
            .field("domain", &self.domain)
            .finish_non_exhaustive()
    }
}

impl TlsFiles {
    /// Reads the shards' certificate chain, its key and the CA (all PEM); `domain` is the name
    /// clients check the certificate against (default: each shard address's host).
    pub fn read(
        cert: &Path,
        key: &Path,
        ca: &Path,
        domain: Option<String>,
    ) -> Result<Self, String> {
        let pem = |p: &Path, what: &str| -> Result<Arc<[u8]>, String> {
            let b =
                crate::config::limits::read_bounded(p, crate::config::limits::MAX_PEM_FILE_BYTES)
                    .map_err(|e| format!("cannot read {what} {}: {e}", p.display()))?;
            if !b.windows(11).any(|w| w == b"-----BEGIN ") {
                return Err(format!(
                    "{what} {}: expected PEM (-----BEGIN ...)",
                    p.display()
                ));
            }
            Ok(b.into())
        };
        Ok(Self {
            cert: pem(cert, "certificate")?,
            key: pem(key, "private key")?,
            ca: pem(ca, "CA certificate")?,
            domain,
        })
    }

    /// The shard side: its certificate and key.
    pub fn server(&self) -> ServerTlsConfig {
        ServerTlsConfig::new().identity(Identity::from_pem(&*self.cert, &*self.key))
    }
}

/// How a process reaches a shard: the token to add, and TLS to use.
#[derive(Clone, Debug, Default)]
pub struct ClientSecurity {
    token: Option<Token>,
    tls: Option<TlsFiles>,
    /// The run id sent on every request (`crate::runid`); None for the unnamed run.
    run_id: Option<String>,
}

impl ClientSecurity {
    /// What `[cluster]` asks for.
    pub fn new(token: Option<Token>, tls: Option<TlsFiles>) -> Self {
        Self {
            token,
            tls,
            run_id: None,
        }
    }

    /// The same, sending `run_id` (a valid id, `crate::runid::validate`) on every request.
    pub fn with_run_id(mut self, run_id: Option<String>) -> Self {
        self.run_id = run_id;
        self
    }

    /// The token's bytes (empty without one), for the tensor data connection's hello.
    pub fn token_bytes(&self) -> &[u8] {
        self.token.as_ref().map_or(&[][..], |t| t.0.as_bytes())
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
    pub fn endpoint(&self, addr: &str) -> Result<Endpoint, String> {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let e = Endpoint::from_shared(format!("{scheme}://{addr}"))
            .map_err(|e| format!("bad server address {addr:?}: expected host:port ({e})"))?;
        let Some(tls) = &self.tls else {
            return Ok(e);
        };
        let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
        let domain = tls
            .domain
            .clone()
            .unwrap_or_else(|| host.trim_matches(['[', ']']).to_string());
        e.tls_config(
            ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(&*tls.ca))
                .domain_name(domain),
        )
        .map_err(|e| format!("TLS set-up for {addr}: {e}"))
    }

    /// The interceptor that adds the token and the run id.
    pub fn interceptor(&self) -> AddToken {
        AddToken::new(self.token.as_ref()).with_run_id(self.run_id.as_deref())
    }
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

    /// Also adds `run_id` (an id that [`crate::runid::validate`] accepts is a valid header
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
            req.metadata_mut().insert(crate::runid::HEADER, v.clone());
        }
        Ok(req)
    }
}

/// Server side: refuses every request that does not carry the token (accepts all without one),
/// and every request of another run (a run id other than the shard's, `crate::runid`).
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
            .get(crate::runid::HEADER)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
        if theirs.as_deref() == self.run_id.as_deref() {
            return Ok(());
        }
        let peer = req
            .remote_addr()
            .map_or_else(|| "an unknown peer".to_string(), |a| a.to_string());
        let (ours, theirs) = (
            crate::runid::show(self.run_id.as_deref()),
            crate::runid::show(theirs.as_deref()),
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

/// `N` random bytes from the kernel (`getrandom(2)`): lease ids, generated shard credentials.
pub fn random_bytes<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    let mut filled = 0;
    while filled < N {
        // SAFETY: getrandom(2) writes at most `N - filled` bytes into the rest of `b`.
        let n = unsafe {
            libc::getrandom(
                b[filled..].as_mut_ptr().cast::<libc::c_void>(),
                N - filled,
                0,
            )
        };
        if n > 0 {
            filled += n as usize;
        } else if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            panic!(
                "getrandom(2) failed: {}: no random bytes for a credential",
                std::io::Error::last_os_error()
            );
        }
    }
    b
}

/// `a == b`, in a time that depends on the lengths only, not on where they differ.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = u8::from(a.len() != b.len());
    for (i, &y) in b.iter().enumerate() {
        diff |= a.get(i).copied().unwrap_or(0) ^ y;
    }
    diff == 0
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
        let e = Token::read(&p).unwrap_err();
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
