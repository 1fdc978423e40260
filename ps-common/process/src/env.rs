//! Where a worker's rank, world size and local rank come from: explicit flags, or the
//! environment of the launcher that started it (torchrun, Slurm, Kubernetes Indexed Jobs).

use std::collections::HashMap;

const WORLD_FLAG: &str = "flags (--world-size)";

/// Why no placement could be resolved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    /// A launcher variable that is not a non-negative integer.
    #[error("environment {key}={value:?}: expected a non-negative integer")]
    NotAnInteger {
        /// The variable.
        key: String,
        /// Its value.
        value: String,
    },
    /// Neither a flag nor any launcher's environment gives a rank.
    #[error(
        "no rank: pass --rank R, or run under torchrun (RANK), Slurm (SLURM_PROCID) or a Kubernetes Indexed Job (JOB_COMPLETION_INDEX)"
    )]
    NoRank,
}

/// A worker's place in the job and where it was read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// Global rank.
    pub rank: usize,
    /// World size, if the source states one.
    pub world: Option<usize>,
    /// Rank on this host (picks the GPU).
    pub local_rank: usize,
    /// "flags", "torchrun (RANK/WORLD_SIZE/LOCAL_RANK)", ...: where the rank came from.
    pub source: &'static str,
    /// Where the world size came from ("flags (--world-size)", "torchrun (WORLD_SIZE)", ...);
    /// None when no source states one (then it is the config's `[cluster] workers`).
    pub world_source: Option<&'static str>,
}

/// Resolves the placement from flags first, then `env` (pass `std::env::vars().collect()`).
pub fn resolve(
    rank: Option<usize>,
    world: Option<usize>,
    local_rank: Option<usize>,
    env: &HashMap<String, String>,
) -> Result<Placement, PlacementError> {
    let get = |k: &str| -> Result<Option<usize>, PlacementError> {
        env.get(k)
            .map(|v| {
                v.trim()
                    .parse::<usize>()
                    .map_err(|_| PlacementError::NotAnInteger {
                        key: k.to_string(),
                        value: v.clone(),
                    })
            })
            .transpose()
    };
    // the local rank: the flag, else the launcher's (with any rank source: `--rank` beside
    // torchrun's or Slurm's environment still runs on that launcher's GPU)
    let env_local = || -> Result<Option<usize>, PlacementError> {
        Ok(get("LOCAL_RANK")?.or(get("SLURM_LOCALID")?))
    };
    if let Some(rank) = rank {
        return Ok(Placement {
            rank,
            world,
            local_rank: match local_rank {
                Some(l) => l,
                None => env_local()?.unwrap_or(0),
            },
            source: "flags (--rank)",
            world_source: world.map(|_| WORLD_FLAG),
        });
    }
    let sources: [(&str, &str, &str, &'static str, &'static str); 2] = [
        (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "torchrun (RANK/WORLD_SIZE/LOCAL_RANK)",
            "torchrun (WORLD_SIZE)",
        ),
        (
            "SLURM_PROCID",
            "SLURM_NTASKS",
            "SLURM_LOCALID",
            "slurm (SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID)",
            "slurm (SLURM_NTASKS)",
        ),
    ];
    for (r, w, l, source, world_env) in sources {
        if let Some(rank) = get(r)? {
            let (world, world_source) = match world {
                Some(n) => (Some(n), Some(WORLD_FLAG)),
                None => {
                    let n = get(w)?;
                    (n, n.map(|_| world_env))
                }
            };
            return Ok(Placement {
                rank,
                world,
                local_rank: local_rank.or(get(l)?).unwrap_or(0),
                source,
                world_source,
            });
        }
    }
    if let Some(rank) = get("JOB_COMPLETION_INDEX")? {
        return Ok(Placement {
            rank,
            world,
            local_rank: match local_rank {
                Some(l) => l,
                None => env_local()?.unwrap_or(0),
            },
            source: "kubernetes (JOB_COMPLETION_INDEX)",
            world_source: world.map(|_| WORLD_FLAG),
        });
    }
    Err(PlacementError::NoRank)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn sources_in_order() {
        let e = env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("SLURM_PROCID", "9"),
        ]);
        let p = resolve(None, None, None, &e).unwrap();
        assert_eq!((p.rank, p.world, p.local_rank), (3, Some(4), 1));
        assert!(p.source.starts_with("torchrun"));
        assert_eq!(p.world_source, Some("torchrun (WORLD_SIZE)"));
        // the world size's own source, not the rank's: --world-size with a rank from torchrun
        let p = resolve(None, Some(6), None, &e).unwrap();
        assert_eq!(p.world_source, Some("flags (--world-size)"));
        assert!(p.source.starts_with("torchrun"));
        let p = resolve(Some(1), None, None, &e).unwrap();
        assert_eq!(p.world_source, None, "--rank alone states no world size");
        let p = resolve(Some(1), Some(3), None, &e).unwrap();
        assert_eq!(p.world_source, Some("flags (--world-size)"));
        let p = resolve(Some(2), Some(4), None, &e).unwrap();
        assert_eq!((p.rank, p.world, p.source), (2, Some(4), "flags (--rank)"));
        // --rank keeps the launcher's LOCAL_RANK (it used to be 0: every worker on cuda:0);
        // --local-rank wins
        assert_eq!(p.local_rank, 1);
        assert_eq!(resolve(Some(2), None, Some(3), &e).unwrap().local_rank, 3);
        let p = resolve(Some(0), None, None, &env(&[("SLURM_LOCALID", "2")])).unwrap();
        assert_eq!(p.local_rank, 2);
        assert_eq!(
            resolve(Some(0), None, None, &env(&[])).unwrap().local_rank,
            0
        );
        let p = resolve(
            None,
            None,
            None,
            &env(&[
                ("SLURM_PROCID", "5"),
                ("SLURM_NTASKS", "8"),
                ("SLURM_LOCALID", "1"),
            ]),
        )
        .unwrap();
        assert_eq!((p.rank, p.world, p.local_rank), (5, Some(8), 1));
        assert!(p.source.starts_with("slurm"));
        let p = resolve(None, None, None, &env(&[("JOB_COMPLETION_INDEX", "2")])).unwrap();
        assert_eq!((p.rank, p.world), (2, None));
        let e = resolve(None, None, None, &env(&[])).unwrap_err();
        assert_eq!(e, PlacementError::NoRank);
        assert!(e.to_string().starts_with("no rank: pass --rank R"), "{e}");
        let e = resolve(None, None, None, &env(&[("RANK", "x")])).unwrap_err();
        assert_eq!(
            e.to_string(),
            "environment RANK=\"x\": expected a non-negative integer"
        );
    }
}
