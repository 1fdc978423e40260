//! `[cluster]`: where the shards are, how many workers, how tensors travel, and security.

use super::Resolve;
use super::kinds::{Transport, Wire};
use super::limits::{MAX_SHARDS, MAX_WORKERS, at_most};
use crate::credential::{TlsFiles, Token};
use crate::error::Invalid;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawCluster {
    pub servers: Vec<String>,
    pub workers: usize,
    #[serde(default = "default_transport")]
    pub transport: Transport,
    #[serde(default, skip_serializing_if = "is_f32")]
    pub wire: Wire,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_file: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_cert: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_key: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_ca: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_domain: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<String>,
}

fn is_f32(w: &Wire) -> bool {
    *w == Wire::F32
}

fn default_transport() -> Transport {
    Transport::Auto
}

/// `[cluster]`, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterConfig {
    /// Shard addresses, shard `i` at `servers[i]`.
    pub servers: Vec<String>,
    /// `W`.
    pub workers: usize,
    /// How tensors travel between workers and shards.
    pub transport: Transport,
    /// How gradients pushed over the network are encoded (`[cluster] wire`).
    pub wire: Wire,
    /// The shared token every request must carry (`token_file`), if any.
    pub token: Option<Token>,
    /// TLS between every process (`tls_cert`, `tls_key`, `tls_ca`), if set.
    pub tls: Option<TlsFiles>,
    /// The run id (`run_id`; the processes replace it with the one they resolve, see
    /// `crate::runid`): every request carries it, and a shard refuses another run's.
    pub run_id: Option<String>,
}

impl RawCluster {
    pub(super) fn validate(&self, resolve: &Resolve) -> Result<ClusterConfig, Invalid> {
        if self.servers.is_empty() {
            return Err("[cluster] servers = []: expected at least one shard address".into());
        }
        if self.servers.len() > MAX_SHARDS {
            return Err(invalid!(
                "[cluster] servers has {} addresses: expected at most {MAX_SHARDS}",
                self.servers.len()
            ));
        }
        for (i, s) in self.servers.iter().enumerate() {
            if s.parse::<std::net::SocketAddr>().is_err() && !s.contains(':') {
                return Err(invalid!(
                    "[cluster] servers[{i}] = {s:?}: expected host:port"
                ));
            }
        }
        let token = match &self.token_file {
            Some(f) => {
                Some(
                    Token::read(&resolve.path(f)).map_err(|source| Invalid::Credential {
                        key: "[cluster] token_file",
                        source,
                    })?,
                )
            }
            None => None,
        };
        let tls = match (&self.tls_cert, &self.tls_key, &self.tls_ca) {
            (None, None, None) => {
                if self.tls_domain.is_some() {
                    return Err("[cluster] tls_domain without tls_cert, tls_key and tls_ca".into());
                }
                None
            }
            (Some(cert), Some(key), Some(ca)) => Some(
                TlsFiles::read(
                    &resolve.path(cert),
                    &resolve.path(key),
                    &resolve.path(ca),
                    self.tls_domain.clone(),
                )
                .map_err(|source| Invalid::Credential {
                    key: "[cluster] tls",
                    source,
                })?,
            ),
            _ => {
                return Err(
                    "[cluster] tls_cert, tls_key, tls_ca: expected all three (every shard presents the certificate, every process checks it against the CA) or none".into(),
                );
            }
        };
        if self.workers == 0 {
            return Err("[cluster] workers = 0: expected at least one worker".into());
        }
        let workers = at_most("[cluster] workers", self.workers, MAX_WORKERS)?;
        if let Some(id) = &self.run_id {
            crate::runid::validate(id).map_err(|e| invalid!("[cluster] run_id: {e}"))?;
        }
        Ok(ClusterConfig {
            servers: self.servers.clone(),
            workers,
            transport: self.transport,
            wire: self.wire,
            token,
            tls,
            run_id: self.run_id.clone(),
        })
    }
}
