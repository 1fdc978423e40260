//! What is wrong with a config before the file is named: the checks of every section and
//! across sections return an [`Invalid`]; [`super::ConfigError`] adds the file, once, where
//! the config is read.

use crate::credential::CredentialError;

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
        $crate::invalid::Invalid::Rule(format!($($t)*))
    };
}
