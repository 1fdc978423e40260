//! The entries of a declared model that the shards do not train (frozen parameters, buffers):
//! every worker must hold the same values, as DDP makes them by broadcasting rank 0's module
//! state at construction. Each Python worker sends shard 0 a fingerprint of each such entry
//! after registering; shard 0 keeps the first worker's and refuses a worker whose entries
//! differ, naming the first that does. Buffers change as the run trains (BatchNorm statistics
//! under `allow_buffers`), so they are compared only while the run is at version 0.

use ps_proto::pb::TensorPrint;
use ps_proto::{PsError, PsResult};

/// The first worker's entries, and its rank.
#[derive(Debug, Default)]
pub struct Constants {
    first: Option<(u32, Vec<TensorPrint>)>,
}

impl Constants {
    /// Checks `rank`'s `entries` against the first worker's (recording them when they are the
    /// first); `version`: the shard's, buffers are compared at version 0 only.
    pub fn check(&mut self, rank: u32, entries: Vec<TensorPrint>, version: u64) -> PsResult<()> {
        let Some((first, theirs)) = &self.first else {
            self.first = Some((rank, entries));
            return Ok(());
        };
        let differ = |why: String| {
            Err(PsError::ClusterMismatch(format!(
                "model mismatch: rank {rank}'s {why} rank {first}'s: every worker must start from the same frozen parameters and buffers (DDP broadcasts rank 0's); load them alike on every worker (e.g. from the same pretrained file)"
            )))
        };
        let names = |v: &[TensorPrint]| v.iter().map(|t| t.name.clone()).collect::<Vec<_>>();
        if names(&entries) != names(theirs) {
            return differ(format!(
                "frozen parameters and buffers {:?} differ in names or order from",
                names(&entries)
            ));
        }
        for (a, b) in entries.iter().zip(theirs) {
            if a.buffer && version > 0 {
                continue;
            }
            if a.shape != b.shape || a.dtype != b.dtype {
                return differ(format!(
                    "{} \"{}\" {} {:?} differs in type or shape from",
                    kind(a),
                    a.name,
                    a.dtype,
                    a.shape
                ));
            }
            if a.fingerprint != b.fingerprint {
                return differ(format!("{} \"{}\" differs in value from", kind(a), a.name));
            }
        }
        Ok(())
    }
}

fn kind(t: &TensorPrint) -> &'static str {
    if t.buffer {
        "buffer"
    } else {
        "frozen parameter"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn print(name: &str, fingerprint: u64, buffer: bool) -> TensorPrint {
        TensorPrint {
            name: name.into(),
            shape: vec![3],
            dtype: "float32".into(),
            fingerprint,
            buffer,
        }
    }

    #[test]
    fn the_first_workers_entries_are_the_reference() {
        let mut c = Constants::default();
        let mine = vec![
            print("emb.weight", 7, false),
            print("bn.running_mean", 9, true),
        ];
        c.check(1, mine.clone(), 0).unwrap();
        c.check(0, mine.clone(), 0).unwrap();
        let mut other = mine.clone();
        other[0].fingerprint = 8;
        let e = c.check(2, other, 5).unwrap_err().to_string();
        assert!(
            e.contains("rank 2's frozen parameter \"emb.weight\" differs in value from rank 1's"),
            "{e}"
        );
        // buffers train: compared at version 0 only
        let mut trained = mine.clone();
        trained[1].fingerprint = 10;
        c.check(2, trained.clone(), 5).unwrap();
        let e = c.check(2, trained, 0).unwrap_err().to_string();
        assert!(
            e.contains("buffer \"bn.running_mean\" differs in value"),
            "{e}"
        );
        let e = c.check(2, mine[..1].to_vec(), 0).unwrap_err().to_string();
        assert!(e.contains("differ in names or order"), "{e}");
    }
}
