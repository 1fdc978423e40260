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
    /// The directory `<root>/ps-shard<index>-...` for `world` ranks; None (logged) when it
    /// cannot be made: tensors then go through gRPC.
    pub fn create(root: &Path, index: usize, world: usize) -> Option<Self> {
        match BoardDir::create(root, &format!("shard{index}")) {
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

    /// Opens `rank`'s gradient board: `file`, of `num_params` values, made with `token`, in a
    /// worker's board directory under the same shared-memory root as this shard's, belonging
    /// to this process's user ([`Board::open_trusted`]): never a file another user made or
    /// one elsewhere. The error says why it is not usable (then the rank pushes through gRPC).
    pub fn attach(
        &self,
        rank: usize,
        file: &Path,
        token: u64,
        num_params: usize,
    ) -> Result<(), String> {
        let root = self
            .dir
            .path()
            .parent()
            .ok_or_else(|| "this shard's board directory has no parent".to_string())?;
        let board = Board::open_trusted(root, file, token, num_params, 1)?;
        self.grads.lock().unwrap_or_else(|p| p.into_inner())[rank] = Some(Arc::new(board));
        Ok(())
    }

    /// `rank`'s gradient board, if attached.
    pub fn grad(&self, rank: usize) -> Option<Arc<Board>> {
        self.grads.lock().unwrap_or_else(|p| p.into_inner())[rank].clone()
    }

    /// Forgets `rank`'s gradient board (it was truncated: it is never read again; the rank
    /// must register again with a new one, or push through gRPC).
    pub fn detach(&self, rank: usize) {
        self.grads.lock().unwrap_or_else(|p| p.into_inner())[rank] = None;
    }
}
