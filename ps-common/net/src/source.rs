//! Where a shard reads a push's values: [`PushSource`], the receiving side's counterpart of
//! [`crate::sink::PullSink`]. Whatever plane carried the values (gRPC chunks or a data
//! connection's frame received into a shard buffer, a worker's shared-memory board read in
//! place), the shard's update reads them through one type: the values of the range the push is
//! for, in place, and whether the memory behind them faulted while they were read.
//!
//! A source is a value with an owner: held in an `Arc`, it keeps its memory (a buffer, a
//! board's mapping) alive and unchanged for as long as it lives, so the update, the bucket
//! applier, or a device that registers the memory for DMA read it until the last holder drops
//! it. [`BoardSource`] is the shared-memory plane's: a range of slot 0 of a worker's gradient
//! board.

use crate::shm::Board;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;

/// Why the values a source gave are not the push's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SourceFault {
    /// The board's file was shrunk under its mapping: what was read since is zeros (the
    /// SIGBUS guard of `crate::shm`), and the board is never read again.
    #[error(
        "shared-memory gradient board {} was truncated (another process shrank the file): push refused; register again with a new board, or push through gRPC",
        path.display()
    )]
    BoardTruncated {
        /// The board's file.
        path: PathBuf,
    },
}

impl SourceFault {
    /// The refusal of `rank`'s push whose values were read from the faulted source.
    pub fn refused(&self, rank: u32) -> ps_proto::PsError {
        ps_proto::PsError::BadChunk(format!("rank {rank}'s {self}"))
    }
}

/// A push's values for the range the source was made for, read in place by the shard.
///
/// Contract: [`PushSource::values`] gives the same memory (pointer and length) on every call
/// for as long as the source lives, and nothing writes it through the source; what the values
/// are may only change by a writer that breaks its plane's protocol (a worker writing its board
/// before the update it pushed for), which the update's finiteness checks and
/// [`PushSource::fault`] catch where they matter.
pub trait PushSource: Send + Sync + std::fmt::Debug {
    /// The values, in place.
    fn values(&self) -> &[f32];

    /// Why the values read so far are not the push's (the memory faulted under them); None
    /// while they are. Ask after reading them: a fault is known only once a read met it.
    fn fault(&self) -> Option<SourceFault> {
        None
    }
}

/// Values `range` of slot 0 of a worker's gradient board (`crate::shm`), read in place: the
/// shared-memory plane's source. The `Arc` keeps the board mapped while the source lives.
#[derive(Debug)]
pub struct BoardSource {
    board: Arc<Board>,
    range: Range<usize>,
}

impl BoardSource {
    /// The source of `range` of `board`'s slot 0 (the range must lie in the slot).
    ///
    /// # Safety
    /// Nothing may write that range while the source lives, except a writer breaking the
    /// board's protocol (the worker does not write its gradient board between its push and the
    /// update of the version the push is for, `crate::shm`); such a writer only changes the
    /// values read, which every reader of a source checks for finiteness where it uses them.
    pub unsafe fn new(board: Arc<Board>, range: Range<usize>) -> Self {
        assert!(
            range.start <= range.end && range.end <= board.len(),
            "board source {range:?} outside a slot of {} values",
            board.len()
        );
        Self { board, range }
    }

    /// The board.
    pub fn board(&self) -> &Arc<Board> {
        &self.board
    }
}

impl PushSource for BoardSource {
    fn values(&self) -> &[f32] {
        // SAFETY: the board stays mapped while `self.board` lives; the range lies in the slot
        // (checked in `new`); writes are excluded by `new`'s contract.
        unsafe { &self.board.slot(0)[self.range.clone()] }
    }

    fn fault(&self) -> Option<SourceFault> {
        self.board.faulted().then(|| SourceFault::BoardTruncated {
            path: self.board.path().to_path_buf(),
        })
    }
}

/// A buffer of values owned by the source (a push received whole into memory of its own).
impl PushSource for Vec<f32> {
    fn values(&self) -> &[f32] {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::{BoardDir, grad_path, shm_root};

    /// A board source reads the board's range in place (the same memory as the slot), and a
    /// board truncated under its mapping is a fault naming its file.
    #[test]
    fn a_board_source_reads_its_range_in_place_and_names_a_truncated_board() {
        let Some(root) = shm_root() else {
            return;
        };
        let dir = BoardDir::create(&root, "source-test").unwrap();
        let path = grad_path(dir.path());
        let mut board = Board::create(&path, dir.token(), 8, 1).unwrap();
        for (i, v) in board.slot_mut(0).iter_mut().enumerate() {
            *v = i as f32;
        }
        let board = Arc::new(board);
        // SAFETY: nothing writes the board while the source lives
        let src = unsafe { BoardSource::new(board.clone(), 2..6) };
        assert_eq!(src.values(), &[2.0, 3.0, 4.0, 5.0]);
        // SAFETY: read only
        let slot = unsafe { board.slot(0) };
        assert_eq!(src.values().as_ptr(), slot[2..].as_ptr(), "read in place");
        assert_eq!(src.fault(), None);
        // another process shrinks the file: the read meets the fault, read as zeros
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(0)
            .unwrap();
        assert_eq!(src.values().iter().sum::<f32>(), 0.0);
        let fault = src.fault().expect("a fault after the truncation");
        let ps_proto::PsError::BadChunk(msg) = fault.refused(3) else {
            panic!("a refusal of the push as a bad chunk");
        };
        assert_eq!(
            msg,
            format!(
                "rank 3's shared-memory gradient board {} was truncated (another process shrank the file): push refused; register again with a new board, or push through gRPC",
                path.display()
            )
        );
        let owned: Vec<f32> = vec![1.0, 2.0];
        assert_eq!(PushSource::values(&owned), &[1.0, 2.0]);
        assert_eq!(PushSource::fault(&owned), None);
    }
}
