//! Tensors a step's backward did not reach, as torch.optim treats a `.grad` of None: a worker
//! marks the tensors its backward did not reach before its push (whose gradient holds zeros
//! there); a tensor that no rank of the step reached is not updated at all (no momentum,
//! weight decay or Adam step), and one that some ranks reached is updated with the others'
//! zeros. Adam's bias correction counts each tensor's own steps: a tensor skipped `k` times
//! takes `k` fewer steps than the shard's count (`OptState::skipped`, checkpointed with the
//! optimizer state, so a resumed or rolled-back run counts as one that never stopped).

use ps_model::layout::ModelSpec;
use ps_proto::{PsError, PsResult};
use std::ops::Range;

/// The marks of the step being gathered.
#[derive(Debug, Clone, Default)]
pub struct Unused {
    /// Per rank: the step it marked and its tensors (sorted, no repeats).
    marks: Vec<Option<(u64, Vec<u32>)>>,
    /// The model's tensor count.
    tensors: usize,
}

impl Unused {
    /// No marks, for `world` ranks and a model of `tensors` tensors.
    pub fn new(world: usize, tensors: usize) -> Self {
        Self {
            marks: vec![None; world],
            tensors,
        }
    }

    /// Records that `rank`'s backward of `step` did not reach `tensors`. Refused (nothing
    /// changes) for a tensor index outside the model.
    pub fn mark(&mut self, rank: usize, step: u64, mut tensors: Vec<u32>) -> PsResult<()> {
        let n = self.tensors;
        if let Some(&t) = tensors.iter().find(|&&t| t as usize >= n) {
            return Err(PsError::BadChunk(format!(
                "rank {rank} marked tensor {t} unused at step {step}: the model has {n} tensors"
            )));
        }
        tensors.sort_unstable();
        tensors.dedup();
        self.marks[rank] = Some((step, tensors));
        Ok(())
    }

    /// The tensors that none of `ranks` reached in `step` (each marked them for it).
    pub fn skipped_by_all(&self, step: u64, ranks: &[u32]) -> Vec<u32> {
        let mut all: Option<Vec<u32>> = None;
        for &r in ranks {
            let Some(Some((s, ts))) = self.marks.get(r as usize) else {
                return Vec::new();
            };
            if *s != step {
                return Vec::new();
            }
            all = Some(match all {
                None => ts.clone(),
                Some(a) => a
                    .into_iter()
                    .filter(|t| ts.binary_search(t).is_ok())
                    .collect(),
            });
        }
        all.unwrap_or_default()
    }
}

/// The parts of `tensors` (indices into `spec`) in the shard's `range`, in the shard's own
/// coordinates (0 = `range.start`), with their tensor index.
pub fn local_parts(
    spec: &ModelSpec,
    range: &Range<usize>,
    tensors: &[u32],
) -> Vec<(u32, Range<usize>)> {
    tensors
        .iter()
        .filter_map(|&t| {
            let r = spec.tensors.get(t as usize)?.range();
            let (lo, hi) = (r.start.max(range.start), r.end.min(range.end));
            (lo < hi).then(|| (t, lo - range.start..hi - range.start))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ps_model::layout::Init;

    #[test]
    fn a_tensor_is_skipped_only_when_every_rank_marked_it_for_the_step() {
        let mut u = Unused::new(2, 4);
        u.mark(0, 3, vec![2, 1]).unwrap();
        assert_eq!(
            u.skipped_by_all(3, &[0, 1]),
            Vec::<u32>::new(),
            "rank 1 marked nothing"
        );
        u.mark(1, 3, vec![1, 3]).unwrap();
        assert_eq!(u.skipped_by_all(3, &[0, 1]), vec![1]);
        assert_eq!(
            u.skipped_by_all(4, &[0, 1]),
            Vec::<u32>::new(),
            "marks of another step"
        );
        assert_eq!(
            u.skipped_by_all(3, &[0]),
            vec![1, 2],
            "a step that went on with rank 0"
        );
        let e = u.mark(1, 3, vec![4]).unwrap_err().to_string();
        assert!(e.contains("tensor 4") && e.contains("4 tensors"), "{e}");
        assert_eq!(
            u.skipped_by_all(3, &[0, 1]),
            vec![1],
            "a refused mark changes nothing"
        );
    }

    #[test]
    fn parts_are_clipped_to_the_shard() {
        let spec = ModelSpec::new([
            ("a".to_string(), vec![4], Init::Zeros),
            ("b".to_string(), vec![3], Init::Zeros),
            ("c".to_string(), vec![5], Init::Zeros),
        ]);
        // the shard holds 5..10: b's last 2, c's first 3
        assert_eq!(
            local_parts(&spec, &(5..10), &[0, 1, 2]),
            vec![(1, 0..2), (2, 2..5)]
        );
    }
}
