//! The crate's errors: what is wrong with a config before the file is named (the checks of
//! every section and across sections return an [`Invalid`]; [`super::ConfigError`] adds the
//! file, once, where the config is read), and why a credential could not be read or written
//! ([`CredentialError`], `crate::credential`'s).

use std::path::PathBuf;

/// What the advice of a malformed token says: what a token must be.
const TOKEN_RULE: &str = "expected one token of at least 16 printable ASCII characters without spaces (e.g. `openssl rand -hex 32`)";

/// Why a credential could not be read or written. The messages name the file and what was
/// expected, never what a token file holds.
#[derive(Debug, thiserror::Error)]
pub enum CredentialError {
    /// The token file could not be read.
    #[error("cannot read the token file {}: {source}", path.display())]
    ReadToken {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A token (from `what`: a file, an environment variable) that is not one.
    #[error("{what}: {TOKEN_RULE}")]
    BadToken {
        /// Where it came from: "token file PATH", "PS_SHARD_TOKEN".
        what: String,
    },
    /// `[server] shard_token_file` could not be read or holds no token.
    #[error("[server] shard_token_file: {0}")]
    ShardTokenFile(Box<CredentialError>),
    /// A folder or file of [`write_credentials`] could not be created.
    #[error("cannot create {}: {source}", path.display())]
    Create {
        /// The folder or file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A credential file could not be written.
    #[error("cannot write {}: {source}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// [`write_credentials`] found a credential file already there.
    #[error(
        "{} exists: the credentials of a run are written once and copied to every host; remove the files to make new ones (every shard and worker must then read the new ones)",
        path.display()
    )]
    Exists {
        /// The file.
        path: PathBuf,
    },
    /// A TLS file could not be read.
    #[error("cannot read {what} {}: {source}", path.display())]
    ReadPem {
        /// "certificate", "private key", "CA certificate".
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A TLS file that is not PEM.
    #[error("{what} {}: expected PEM (-----BEGIN ...)", path.display())]
    NotPem {
        /// "certificate", "private key", "CA certificate".
        what: &'static str,
        /// The file.
        path: PathBuf,
    },
}

/// A config's value or combination of values refused, naming the key and what was expected.
#[derive(Debug, thiserror::Error)]
pub enum Invalid {
    /// A duration that is not a positive, finite number of seconds.
    #[error("{key} = {value}: expected a positive number of seconds")]
    NotPositiveSecs {
        /// The key.
        key: String,
        /// The value as written.
        value: String,
    },
    /// A duration past the longest any key allows.
    #[error("{key} = {value}: expected at most {max} seconds (7 days)")]
    TooManySecs {
        /// The key.
        key: String,
        /// The value as written.
        value: String,
        /// The maximum ([`crate::limits::MAX_SECS`]).
        max: f64,
    },
    /// A count or size past its stated maximum ([`crate::limits`]).
    #[error("{key} = {value}: expected at most {max}")]
    TooLarge {
        /// The key.
        key: String,
        /// The value.
        value: String,
        /// The maximum.
        max: String,
    },
    /// A credential file the key names that cannot be read or holds no credential.
    #[error("{key}: {source}")]
    Credential {
        /// `[cluster] token_file`, `[cluster] tls`.
        key: &'static str,
        /// Why.
        source: CredentialError,
    },
    /// Any other rule of a section or across sections; the message names the keys, the
    /// values and what was expected.
    #[error("{0}")]
    Rule(String),
}

impl From<String> for Invalid {
    fn from(message: String) -> Self {
        Self::Rule(message)
    }
}

impl From<&str> for Invalid {
    fn from(message: &str) -> Self {
        Self::Rule(message.to_string())
    }
}

/// `invalid!("{key} = {v}: expected ...")`: an [`Invalid::Rule`] with that message.
macro_rules! invalid {
    ($($t:tt)*) => {
        $crate::error::Invalid::Rule(format!($($t)*))
    };
}
