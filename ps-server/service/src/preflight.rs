//! What a shard refuses before it listens, each with what to set: a missing shard credential
//! ([`needs_shard_credential`]), an unauthenticated port outside loopback ([`check_exposure`]),
//! output directories that cannot be written ([`check_output_dirs`]).

use anyhow::Context;
use ps_config::Config;

/// What shard `index` of `cfg` cannot do without the shard credential (`has_credential`),
/// refused before it listens, with the step that fixes it: with several shards, `[optimizer]
/// clip_norm` (the shards exchange gradient norms through shard 0 every step) and `--recover`
/// (`recover`: the replacement orders every shard to roll back).
pub fn needs_shard_credential(
    cfg: &Config,
    index: usize,
    has_credential: bool,
    recover: bool,
) -> Result<(), StartRefused> {
    let needs = if has_credential || cfg.num_shards() < 2 {
        None
    } else if cfg.clip_norm.is_some() {
        Some(format!(
            "[optimizer] clip_norm over {} shards (the shards exchange gradient norms every step)",
            cfg.num_shards()
        ))
    } else if recover {
        Some("--recover (the replacement orders the other shards to roll back)".to_string())
    } else {
        None
    };
    match needs {
        None => Ok(()),
        Some(what) => Err(StartRefused::NoShardCredential { index, what }),
    }
}

/// Whether shard `index` may serve on `bound`: outside loopback, a shard with no credential at
/// all (neither the workers' `[cluster] token_file` nor a shard credential) would let anyone who
/// can reach the port register, push, read the weights and order rollbacks, so it refuses to
/// start (the error says what to set) unless `[server] allow_unauthenticated = true`. Ok holds
/// the warning to log, if any: the opt-out taken, or a port with a shard credential but no
/// workers' token.
pub fn check_exposure(
    cfg: &Config,
    index: usize,
    bound: std::net::SocketAddr,
    shard_credential: bool,
) -> Result<Option<String>, StartRefused> {
    // a token without a shard credential is safe: the shard refuses every shard-to-shard call
    if bound.ip().is_loopback() || cfg.cluster.token.is_some() {
        return Ok(None);
    }
    if shard_credential {
        return Ok(Some(format!(
            "shard {index} listens on {bound}, outside loopback, without a token: anyone who can reach this port can register, push gradients and read the weights; set [cluster] token_file (and TLS: tls_cert, tls_key, tls_ca)"
        )));
    }
    if cfg.server.allow_unauthenticated {
        return Ok(Some(format!(
            "shard {index} listens on {bound}, outside loopback, WITHOUT ANY CREDENTIAL ([server] allow_unauthenticated = true): anyone who can reach this port can register, push gradients, read the weights and stop or roll back the run"
        )));
    }
    Err(StartRefused::Unauthenticated { index, bound })
}

/// Why a shard refuses to start ([`needs_shard_credential`], [`check_exposure`]); the message
/// says what to set.
#[derive(Debug, thiserror::Error)]
pub enum StartRefused {
    /// Something the config asks for needs the shard credential, and none is set.
    #[error(
        "shard {index}: {what} needs the shard credential, and none is set ([server] shard_token_file, or {env}): run `ps-server credentials --dir DIR` once for the run, copy DIR to every host, and put the lines it prints in the config (ps-launch makes its own; see deploy/README.md, \"Credentials\")",
        env = ps_net::auth::SHARD_TOKEN_ENV
    )]
    NoShardCredential {
        /// The shard.
        index: usize,
        /// What needs it.
        what: String,
    },
    /// The shard would listen outside loopback with no credential at all.
    #[error(
        "shard {index} would listen on {bound}, outside loopback, without any credential: anyone who can reach this port could register, push gradients, read the weights and stop or roll back the run. Set [cluster] token_file (the workers' token, e.g. `openssl rand -hex 32 > token`) and a shard credential ([server] shard_token_file or PS_SHARD_TOKEN; ps-launch, the Slurm recipe and the Kubernetes manifests set one), or listen on loopback (--listen 127.0.0.1:PORT); on a network where every host is trusted, [server] allow_unauthenticated = true (or --set server.allow_unauthenticated=true) starts it anyway"
    )]
    Unauthenticated {
        /// The shard.
        index: usize,
        /// The address it would listen on.
        bound: std::net::SocketAddr,
    },
}

/// Checks that the output directory (final weights, metrics) and, when the run writes
/// checkpoints, the checkpoint directory can be written: each is created if missing and a probe
/// file is written and removed. `ps-server` calls it before listening, so that a run that
/// could not save its results never starts (and a launcher never sees such a shard ready).
pub fn check_output_dirs(cfg: &Config) -> anyhow::Result<()> {
    let mut dirs = vec![("[server] out_dir", cfg.server.out_dir.clone())];
    if cfg.checkpoint.every > 0 {
        dirs.push(("[checkpoint] dir", cfg.checkpoint_dir()));
    }
    for (what, dir) in dirs {
        check_writable(&dir).with_context(|| {
            format!(
                "{what} {} is not writable: the run could not save its results",
                dir.display()
            )
        })?;
    }
    Ok(())
}

pub(crate) fn check_writable(dir: &std::path::Path) -> std::io::Result<()> {
    use std::io::Write;
    std::fs::create_dir_all(dir)?;
    let probe = dir.join(format!(
        ".ps-write-check-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let written = std::fs::File::create(&probe).and_then(|mut f| {
        f.write_all(b"probe")?;
        f.sync_all()
    });
    let _ = std::fs::remove_file(&probe);
    written
}
