//! The pull path: a pull's lease and version checked, the reply cut into zero-copy chunks of
//! the shared snapshot, and streamed with an idle bound.

use super::*;

impl ShardService {
    pub(super) async fn pull_inner(
        &self,
        req: PullRequest,
        via_data: Option<u32>,
    ) -> PsResult<Vec<PullChunk>> {
        let puller = self.leases.check(req.lease.as_ref(), via_data, || {
            format!("pull of version {}", req.min_version)
        })?;
        let last = self.shard.total_steps;
        if req.min_version > last {
            return Err(PsError::VersionOutOfRange {
                asked: req.min_version,
                last,
            });
        }
        let mut rx = self.shard.subscribe();
        let shard = &self.shard;
        let ready = rx.wait_for(|&v| v >= req.min_version || shard.failure().is_some());
        let waited = tokio::time::timeout(self.pull_timeout, ready).await;
        self.shard.refuse_failed(puller)?;
        match waited {
            Err(_) => {
                return Err(PsError::Timeout(format!(
                    "waited {:?} for version {}: shard {} is still at version {}",
                    self.pull_timeout,
                    req.min_version,
                    self.shard.index,
                    self.shard.version()
                )));
            }
            Ok(Err(_)) => return Err(PsError::Unavailable("shard is shutting down".into())),
            Ok(Ok(_)) => {}
        }
        drop(waited);
        if req.exact {
            let (version, snapshot) = self.shard.exactly(req.min_version)?;
            return Ok(pull_chunks(
                version,
                self.shard.range.start as u64,
                &snapshot,
                self.chunk_bytes,
            ));
        }
        if req.shm && self.shard.has_board() {
            // the worker copies the version out of the board (and checks it is still there)
            return Ok(vec![PullChunk {
                header: Some(PullHeader {
                    version: self.shard.version(),
                    start: self.shard.range.start as u64,
                    len: self.shard.len() as u64,
                    shm: true,
                    data_tcp: false,
                }),
                offset: 0,
                data: Bytes::new(),
            }]);
        }
        let (version, snapshot) = self.shard.snapshot()?;
        if let (Some(rank), Some(data)) = (via_data.map(|_| puller), &self.data) {
            // the rank's connection, unless another frame is being written on it: chunks then
            if let Some(mut w) = data.try_take_write(rank).await {
                let (data, idle, len) = (data.clone(), self.stream_idle, snapshot.len());
                let shard = self.shard.index;
                tokio::spawn(async move {
                    let write = datalink::write_frame(&mut w.half, version, &snapshot);
                    match tokio::time::timeout(idle, write).await {
                        Ok(Ok(())) => data.put_write(rank, w).await,
                        Ok(Err(e)) => tracing::warn!(
                            "shard {shard}: pull of version {version} by rank {rank} on its data connection failed after its header: {e}; connection dropped"
                        ),
                        Err(_) => tracing::warn!(
                            "shard {shard}: pull of version {version} by rank {rank}: {len} bytes not taken within {:.1} s (stream_idle_secs); data connection dropped",
                            idle.as_secs_f64()
                        ),
                    }
                });
                return Ok(vec![PullChunk {
                    header: Some(PullHeader {
                        version,
                        start: self.shard.range.start as u64,
                        len: self.shard.len() as u64,
                        shm: false,
                        data_tcp: true,
                    }),
                    offset: 0,
                    data: Bytes::new(),
                }]);
            }
        }
        Ok(pull_chunks(
            version,
            self.shard.range.start as u64,
            &snapshot,
            self.chunk_bytes,
        ))
    }
}

/// The chunks of one pull reply: zero-copy slices of the shared snapshot, the header on the first.
pub fn pull_chunks(
    version: u64,
    start: u64,
    snapshot: &Bytes,
    chunk_bytes: usize,
) -> Vec<PullChunk> {
    let len = (snapshot.len() / 4) as u64;
    chunks(snapshot, chunk_bytes)
        .enumerate()
        .map(|(i, (offset, data))| PullChunk {
            header: (i == 0).then_some(PullHeader {
                version,
                start,
                len,
                shm: false,
                data_tcp: false,
            }),
            offset,
            data,
        })
        .collect()
}

pub(super) type PullStream = Pin<Box<dyn Stream<Item = Result<PullChunk, Status>> + Send>>;

/// A pull reply's chunks, ended with `DEADLINE_EXCEEDED` when the client takes none of them
/// for `idle` (`[server] stream_idle_secs`): a watchdog then drops the chunks (they hold the
/// version's snapshot) and the stream ends with that status as soon as it is polled again.
pub(super) struct IdlePull {
    state: Arc<std::sync::Mutex<PullState>>,
}

impl IdlePull {
    pub(super) fn start(chunks: Vec<PullChunk>, idle: Duration, shard: usize) -> Self {
        let state = Arc::new(std::sync::Mutex::new(PullState {
            chunks: chunks.into(),
            progress: std::time::Instant::now(),
            expired: None,
            finished: false,
        }));
        let watched = Arc::downgrade(&state);
        tokio::spawn(async move {
            let mut wait = idle;
            loop {
                tokio::time::sleep(wait).await;
                let Some(state) = watched.upgrade() else {
                    return;
                };
                let mut st = state.lock().unwrap_or_else(|p| p.into_inner());
                if st.finished {
                    return;
                }
                let quiet = st.progress.elapsed();
                if quiet >= idle {
                    let left: usize = st.chunks.iter().map(|c| c.data.len()).sum();
                    let why = format!(
                        "pull stream idle for {:.1} s with {left} bytes not taken (stream_idle_secs): ended",
                        quiet.as_secs_f64()
                    );
                    tracing::warn!("shard {shard}: {why}");
                    st.chunks.clear();
                    st.expired = Some(why);
                    return;
                }
                wait = idle - quiet;
            }
        });
        Self { state }
    }
}

impl Stream for IdlePull {
    type Item = Result<PullChunk, Status>;

    fn poll_next(
        self: Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if st.finished {
            return std::task::Poll::Ready(None);
        }
        if let Some(why) = st.expired.take() {
            st.finished = true;
            return std::task::Poll::Ready(Some(Err(PsError::Timeout(why).into())));
        }
        st.progress = std::time::Instant::now();
        let next = st.chunks.pop_front();
        if next.is_none() {
            st.finished = true;
        }
        std::task::Poll::Ready(next.map(Ok))
    }
}
