//! The shard's side of the shared-memory data path (`ps_common::shm`): the directory where it
//! offers its parameters board to the workers on its host, and the workers' gradient boards it
//! reads pushes from.

use ps_common::shm::{Board, BoardDir, params_path};
use std::path::Path;
use std::sync::{Arc, Mutex};

/// The shared-memory side of one shard.
#[derive(Debug)]
pub struct ShmHost {
    /// The directory of the parameters board.
    dir: BoardDir,
    /// Each rank's gradient board (the worker's file), once opened.
    grads: Mutex<Vec<Option<Arc<Board>>>>,
}

impl ShmHost {
    /// The directory `<root>/ps-<run>-shard<index>-...` for `world` ranks (`run`: the run id,
    /// `ps_common::runid::board_prefix`); None (logged) when it cannot be made: tensors then go
    /// through gRPC.
    pub fn create(root: &Path, run: &str, index: usize, world: usize) -> Option<Self> {
        match BoardDir::create(root, &format!("{run}-shard{index}")) {
            Ok(dir) => Some(Self {
                dir,
                grads: Mutex::new(vec![None; world]),
            }),
            Err(e) => {
                tracing::warn!(
                    "shard {index}: no shared-memory data path ({e}); tensors go through gRPC"
                );
                None
            }
        }
    }

    /// The directory offered to workers.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The token of its boards.
    pub fn token(&self) -> u64 {
        self.dir.token()
    }

    /// Creates the parameters board (two slots of `len` values); the error is logged by the
    /// caller, which then serves pulls through gRPC.
    pub fn create_params_board(&self, len: usize) -> Result<Board, String> {
        let path = params_path(self.dir.path());
        Board::create(&path, self.token(), len, 2)
            .map_err(|e| format!("cannot create {}: {e}", path.display()))
    }

    /// Opens `rank`'s gradient board: `file`, of `num_params` values, made with `token`. The
    /// error says why it is not usable here (then the rank pushes through gRPC).
    pub fn attach(
        &self,
        rank: usize,
        file: &Path,
        token: u64,
        num_params: usize,
    ) -> Result<(), String> {
        let board = Board::open(file, token, num_params, 1)?;
        self.grads.lock().unwrap_or_else(|p| p.into_inner())[rank] = Some(Arc::new(board));
        Ok(())
    }

    /// `rank`'s gradient board, if attached.
    pub fn grad(&self, rank: usize) -> Option<Arc<Board>> {
        self.grads.lock().unwrap_or_else(|p| p.into_inner())[rank].clone()
    }
}
