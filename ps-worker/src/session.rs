//! A worker's connection to every shard without the training loop: register (with the model's
//! names and shapes), pull a version, push a gradient, leave. The Python package (`python/`)
//! drives a model that PyTorch computes through it, over the same transport as `ps-worker`
//! (shared-memory boards on one host, gRPC otherwise, token and TLS).

use crate::worker::{Peer, board_file, grad_board, pull_all, register_all};
use anyhow::Context;
use bytes::Bytes;
use ps_common::config::{Config, Transport};
use ps_common::pb::{LeaveRequest, PushHeader, TensorDesc};
use ps_common::shm::{Board, BoardDir};
use ps_common::wire::f32_to_bytes_reusing;
use std::time::{Duration, Instant};

/// Figures of one push or pull (for the speed comparison with `ps-worker`).
#[derive(Debug, Default, Clone, Copy)]
pub struct CommTiming {
    /// Pushes made.
    pub pushes: u64,
    /// Total time in pushes.
    pub push: Duration,
    /// Pulls made.
    pub pulls: u64,
    /// Total time in pulls.
    pub pull: Duration,
}

/// Registered with every shard of a run.
pub struct Session {
    /// This worker's rank.
    pub rank: usize,
    /// The run's steps.
    pub total_steps: u64,
    /// The step to start at (0, or the shards' step when a worker rejoins).
    pub start_step: u64,
    /// Flat parameter count.
    pub num_params: usize,
    peers: Vec<Peer>,
    board: Option<(BoardDir, Board)>,
    heap_grad: Vec<f32>,
    chunk_bytes: usize,
    /// Time spent communicating.
    pub timing: CommTiming,
}

impl Session {
    /// Connects and registers with every shard of `servers` as `rank`, describing `model`
    /// (names and shapes in flat order); `train_len` samples make the run's length.
    pub async fn connect(
        cfg: &Config,
        servers: &[String],
        rank: usize,
        model: Vec<TensorDesc>,
        train_len: usize,
    ) -> anyhow::Result<Self> {
        let total = cfg.total_steps(train_len)?;
        let num_params: usize = model
            .iter()
            .map(|t| t.shape.iter().product::<u64>() as usize)
            .sum();
        let board = match cfg.cluster.transport {
            Transport::Auto => grad_board(
                &ps_common::runid::board_prefix(cfg.cluster.run_id.as_deref()),
                rank,
                num_params,
            ),
            Transport::Grpc => None,
        };
        let (peers, start_step) =
            register_all(cfg, servers, rank, total, &board_file(&board), &model).await?;
        let heap_grad = if board.is_some() {
            Vec::new()
        } else {
            vec![0.0; num_params]
        };
        Ok(Self {
            rank,
            total_steps: total,
            start_step,
            num_params,
            peers,
            board,
            heap_grad,
            chunk_bytes: cfg.server.chunk_bytes,
            timing: CommTiming::default(),
        })
    }

    /// How tensors travel to each shard ("shared memory", "gRPC", ...).
    pub fn transport(&self) -> Vec<&'static str> {
        self.peers.iter().map(|p| p.link.describe()).collect()
    }

    /// Where the next push's gradient is written: this worker's shared-memory board (read by
    /// the shards on this host in place) or a heap buffer.
    pub fn grad_mut(&mut self) -> &mut [f32] {
        match &mut self.board {
            Some((_, b)) => b.slot_mut(0),
            None => &mut self.heap_grad,
        }
    }

    /// Pulls version `version` from every shard, in parallel, into `dst` (the flat vector).
    pub async fn pull(&mut self, version: u64, dst: &mut [f32]) -> anyhow::Result<()> {
        anyhow::ensure!(
            dst.len() == self.num_params,
            "pull buffer holds {} values: expected {}",
            dst.len(),
            self.num_params
        );
        let t = Instant::now();
        pull_all(&mut self.peers, version, dst).await?;
        self.timing.pulls += 1;
        self.timing.pull += t.elapsed();
        Ok(())
    }

    /// Pushes the gradient in [`Session::grad_mut`] for `step` to every shard in parallel.
    pub async fn push(
        &mut self,
        step: u64,
        samples: u32,
        loss_sum: f64,
        correct: u64,
        eval: (u64, u64),
    ) -> anyhow::Result<()> {
        let t = Instant::now();
        let (rank, chunk_bytes) = (self.rank as u32, self.chunk_bytes);
        let grad: &[f32] = match &mut self.board {
            Some((_, b)) => b.slot_mut(0),
            None => &self.heap_grad,
        };
        let mut pushes = Vec::with_capacity(self.peers.len());
        for (s, peer) in self.peers.iter_mut().enumerate() {
            if peer.ahead {
                continue; // this shard applied the step already (a rejoining worker)
            }
            let r = peer.range.clone();
            let bytes = if peer.link.grad {
                Bytes::new()
            } else {
                f32_to_bytes_reusing(&grad[r.clone()], peer.push_buf.take())
            };
            let h = PushHeader {
                rank,
                step,
                samples,
                loss_sum,
                correct,
                len: r.len() as u64,
                eval_correct: eval.0,
                eval_count: eval.1,
                shm: peer.link.grad,
            };
            let client = peer.client.clone();
            pushes.push(tokio::spawn(async move {
                client.push_retrying(h, &bytes, chunk_bytes).await?;
                Ok::<_, anyhow::Error>((s, bytes))
            }));
        }
        for p in pushes {
            let (s, bytes) = p.await.context("push task")??;
            self.peers[s].push_buf = Some(bytes);
        }
        self.peers.iter_mut().for_each(|p| p.ahead = false);
        self.timing.pushes += 1;
        self.timing.push += t.elapsed();
        Ok(())
    }

    /// Leaves every shard, reporting this rank's share of the final test evaluation.
    pub async fn leave(&mut self, eval_correct: u64, eval_count: u64) -> anyhow::Result<()> {
        for p in &mut self.peers {
            p.client
                .leave(LeaveRequest {
                    rank: self.rank as u32,
                    eval_correct,
                    eval_count,
                })
                .await?;
        }
        Ok(())
    }
}
