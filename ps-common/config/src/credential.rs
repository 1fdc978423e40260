//! The credentials a config names, read and checked, with nothing of gRPC in them: the
//! shared worker token (`[cluster] token_file`), the shard credential (`[server]
//! shard_token_file` or `PS_SHARD_TOKEN`) and the TLS files (`[cluster] tls_*`). How they go
//! on the wire (headers, interceptors, rustls) is `ps_net::auth`'s.

use std::fmt;
use std::path::Path;
use std::sync::Arc;

pub use crate::error::CredentialError;

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
    /// [`MAX_TOKEN_FILE_BYTES`](crate::limits::MAX_TOKEN_FILE_BYTES) bytes: a larger
    /// or endless file (`/dev/zero`) is refused, never read without bound. The error says what
    /// was expected, never what the file holds.
    pub fn read(path: &Path) -> Result<Self, CredentialError> {
        let max = crate::limits::MAX_TOKEN_FILE_BYTES;
        let bytes = crate::limits::read_bounded(path, max).map_err(|source| {
            CredentialError::ReadToken {
                path: path.to_path_buf(),
                source,
            }
        })?;
        Self::parse(
            &String::from_utf8_lossy(&bytes),
            &format!("token file {}", path.display()),
        )
    }

    /// The `authorization` header value: `Bearer <token>`.
    pub fn header(&self) -> String {
        format!("Bearer {}", self.0)
    }

    /// A token from `text` (surrounding whitespace trimmed), checked as [`Token::read`] checks
    /// a file's; `what` names the source in the error.
    pub fn parse(text: &str, what: &str) -> Result<Self, CredentialError> {
        let t = text.trim();
        if t.len() < 16 || !t.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(CredentialError::BadToken { what: what.into() });
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

    /// True when `got` is this token (compared in constant time).
    pub fn matches(&self, got: &[u8]) -> bool {
        constant_time_eq(got, self.0.as_bytes())
    }
}

/// The files [`write_credentials`] makes in its folder: the workers' token (`[cluster]
/// token_file`, read by every process) and the shard credential (`[server] shard_token_file`,
/// read by the shards only).
pub const CREDENTIAL_FILES: [&str; 2] = ["token", "shard-token"];

/// The credentials step of a cluster started without `ps-launch` (by hand, Slurm, Kubernetes):
/// writes a fresh random workers' token and shard credential into `dir` (created if needed),
/// each readable by its owner only (0600), and returns the config lines that point at them.
/// Files already there are never replaced (the error names them): every host of a run must
/// read the same ones.
pub fn write_credentials(dir: &Path) -> Result<String, CredentialError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::create_dir_all(dir).map_err(|source| CredentialError::Create {
        path: dir.to_path_buf(),
        source,
    })?;
    if let Some(path) = CREDENTIAL_FILES
        .iter()
        .map(|f| dir.join(f))
        .find(|p| p.symlink_metadata().is_ok())
    {
        return Err(CredentialError::Exists { path });
    }
    for f in CREDENTIAL_FILES {
        let path = dir.join(f);
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(|source| CredentialError::Create {
                path: path.clone(),
                source,
            })?;
        writeln!(file, "{}", Token::random().secret())
            .and_then(|()| file.sync_all())
            .map_err(|source| CredentialError::Write {
                path: path.clone(),
                source,
            })?;
    }
    let abs = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
    Ok(format!(
        "[cluster]\ntoken_file = \"{}\"\n\n[server]\nshard_token_file = \"{}\"\n",
        abs.join(CREDENTIAL_FILES[0]).display(),
        abs.join(CREDENTIAL_FILES[1]).display()
    ))
}

/// The environment variable that gives a shard its shard credential when `[server]
/// shard_token_file` is not set (`ps-launch` sets it for the shards it starts, with a fresh
/// random token; workers never get it).
pub const SHARD_TOKEN_ENV: &str = "PS_SHARD_TOKEN";

/// The shard credential of this process: `[server] shard_token_file` (`file`) when set, else
/// [`SHARD_TOKEN_ENV`]; None without either.
pub fn shard_token(file: Option<&Path>) -> Result<Option<Token>, CredentialError> {
    if let Some(f) = file {
        return Token::read(f)
            .map(Some)
            .map_err(|e| CredentialError::ShardTokenFile(Box::new(e)));
    }
    match std::env::var(SHARD_TOKEN_ENV) {
        Ok(v) => Token::parse(&v, SHARD_TOKEN_ENV).map(Some),
        Err(_) => Ok(None),
    }
}

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
    ) -> Result<Self, CredentialError> {
        let pem = |p: &Path, what: &'static str| -> Result<Arc<[u8]>, CredentialError> {
            let b = crate::limits::read_bounded(p, crate::limits::MAX_PEM_FILE_BYTES).map_err(
                |source| CredentialError::ReadPem {
                    what,
                    path: p.to_path_buf(),
                    source,
                },
            )?;
            if !b.windows(11).any(|w| w == b"-----BEGIN ") {
                return Err(CredentialError::NotPem {
                    what,
                    path: p.to_path_buf(),
                });
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

    /// The certificate chain (PEM).
    pub fn cert(&self) -> &[u8] {
        &self.cert
    }

    /// The private key (PEM).
    pub fn key(&self) -> &[u8] {
        &self.key
    }

    /// The CA certificate (PEM).
    pub fn ca(&self) -> &[u8] {
        &self.ca
    }

    /// The name clients check the certificate against, when set.
    pub fn domain(&self) -> Option<&str> {
        self.domain.as_deref()
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
