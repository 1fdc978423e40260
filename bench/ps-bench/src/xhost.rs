//! **Across hosts: the data connection against raw TCP** (`crosshost.sh` with `PUSHPULL=1`):
//! two ps-bench processes on two hosts (network namespaces), one serving, one measuring.
//!
//! - `--xhost-serve ADDR` (host 1): a shard of the large model, W = 2, served by `run_shard`
//!   on ADDR (its data connections on their own port beside it, as in `ps-server`), and a raw
//!   TCP peer on ADDR's port + 1: told `P` it reads the model's bytes into a preallocated
//!   buffer and answers one byte; told `G` it writes them from its own buffer; `Q` ends it.
//! - `--xhost-client ADDR` (host 2): ranks 0 and 1 registered without shared memory, so every
//!   value travels on the data connection. Per repeat: version t pulled by rank 0 (the gRPC
//!   request, the frame read straight into a `Vec<f32>`), rank 0's push of step t timed (the
//!   gradient encoded once before, as in section 2; the barrier is then incomplete, so the
//!   reply does not wait for an update): whole on even steps, in one piece per tensor, last
//!   first, on odd ones (a worker's progressive push); rank 1's push untimed, the update
//!   waited for, then the
//!   same bytes on the raw connection both ways (`P`: write all, wait for the byte; `G`: one
//!   byte asked, all read). The two transports alternate within each repeat, so load from
//!   elsewhere falls on both alike; the ratio printed is the median of the repeats' own
//!   ratios.

use super::*;
use crate::aggregation::bench_copy;
use crate::raw_tcp;
use crate::transfer::{InProcShard, push, register, spawn_runtime, wait_version};

/// Longest either side waits for the other (connect, a transfer, the shard's version).
const XHOST_WAIT: Duration = raw_tcp::WAIT;

/// The config both sides build (the same text: the same layout).
fn xhost_config(tmp: &Path) -> anyhow::Result<Config> {
    let dir = tmp.join("xhost");
    write_config(
        &dir.join("config.toml"),
        &config_text(1, 2, &LARGE, ENDLESS, &dir.join("out")),
    )
}

/// The raw peer's address: the shard's host, its port + 1.
fn raw_addr(addr: SocketAddr) -> anyhow::Result<SocketAddr> {
    let port = addr
        .port()
        .checked_add(1)
        .context("the shard's port + 1 (the raw TCP peer) is past 65535")?;
    Ok(SocketAddr::new(addr.ip(), port))
}

/// `--xhost-serve`: the shard and the raw peer on `addr` until the client says `Q` (or
/// nothing connects within [`XHOST_WAIT`]).
pub(crate) fn serve(addr: SocketAddr, tmp: &Path) -> anyhow::Result<()> {
    let cfg = xhost_config(tmp)?;
    let n = cfg.layout().num_params() * 4;
    let raw = std::net::TcpListener::bind(raw_addr(addr)?)
        .with_context(|| format!("raw TCP peer on {}", raw_addr(addr).unwrap_or(addr)))?;
    raw.set_nonblocking(true)?;
    let shard = InProcShard::start_on(cfg, addr)?;
    eprintln!(
        "ps-bench: serving the large model's shard on {} and raw TCP on {}",
        shard.addr,
        raw.local_addr()?
    );
    let peer = spawn_runtime(1, move || raw_tcp::peer(raw, n));
    let r = peer
        .join()
        .map_err(|_| anyhow::anyhow!("the raw TCP peer panicked"))?;
    shard.stop()?;
    r
}

/// Seconds of each repeat: (data connection pull, push; raw TCP shard → client, client →
/// shard).
#[derive(Debug, Default)]
struct XhostTimes {
    pull: Vec<f64>,
    push: Vec<f64>,
    pieces: Vec<f64>,
    raw_pull: Vec<f64>,
    /// Raw TCP client -> shard of the repeats with a whole push.
    raw_push: Vec<f64>,
    /// Raw TCP client -> shard of the repeats with a push in pieces.
    raw_push_pieces: Vec<f64>,
}

/// Pushes the encoded gradient `grad` as step `step` of `rank` in pieces, one per tensor of
/// `layout`, last tensor first (as the backward pass hands them to a worker's progressive
/// push), all ready at once.
async fn push_pieces(
    c: &Client,
    rank: usize,
    step: u64,
    grad: &Bytes,
    layout: &ps_model::layout::ModelSpec,
) -> anyhow::Result<()> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    for t in layout.tensors.iter().rev() {
        let r = t.range();
        tx.send((r.start, grad.slice(4 * r.start..4 * r.end)))
            .map_err(|_| anyhow::anyhow!("the push's piece receiver is gone"))?;
    }
    drop(tx);
    let header = PushHeader {
        rank: rank as u32,
        step,
        samples: BATCH as u32,
        loss_sum: 1.0,
        correct: 0,
        len: (grad.len() / 4) as u64,
        eval_correct: 0,
        eval_count: 0,
        shm: false,
    };
    c.push_progressive(header, rx, CHUNK_BYTES).await.0?;
    Ok(())
}

/// `--xhost-client`: `repeats` timed rounds (after one untimed) against the shard on `addr`;
/// the table's rows.
pub(crate) fn client(addr: SocketAddr, repeats: usize, tmp: &Path) -> anyhow::Result<Vec<Value>> {
    let cfg = xhost_config(tmp)?;
    let len = cfg.layout().num_params();
    let grad = f32_to_bytes(&vec![1e-6f32; len]);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let times = rt.block_on(rounds(addr, &cfg, &grad, repeats))?;
    let mut rows = xhost_rows(&times, len * 4);
    rows.extend(shard_passes(len, repeats));
    Ok(rows)
}

/// The passes over the range that the shard makes and raw TCP does not, timed on this
/// machine in the same run: the pull's snapshot (a copy of the parameters, once per version)
/// and the push's check after its last byte (`check_and_fingerprint` of the whole range).
fn shard_passes(len: usize, repeats: usize) -> Vec<Value> {
    let copy = median(&bench_copy(len, repeats));
    let values: Vec<f32> = (0..len).map(|i| 1e-6 * (i % 7) as f32).collect();
    let mut fp = Vec::new();
    for rep in 0..=repeats {
        let t = Instant::now();
        black_box(ps_net::wire::check_and_fingerprint(black_box(&values)).is_ok());
        if rep > 0 {
            fp.push(t.elapsed().as_secs_f64());
        }
    }
    let row = |what: &str, s: f64| json!({ "what": what, "pass": true, "ms": s * 1e3 });
    vec![
        row(
            "pull: the shard's snapshot of the version (memcpy of the range)",
            copy,
        ),
        row(
            "push: the shard's check after the last byte (check_and_fingerprint of the range)",
            median(&fp),
        ),
    ]
}

async fn rounds(
    addr: SocketAddr,
    cfg: &Config,
    grad: &Bytes,
    repeats: usize,
) -> anyhow::Result<XhostTimes> {
    let len = cfg.layout().num_params();
    let connect = |_| async {
        ShardClient::connect(0, &addr.to_string(), &ClientSecurity::default(), XHOST_WAIT)
            .await
            .with_context(|| format!("connecting to the shard at {addr}"))
    };
    let (mut c0, mut c1) = (connect(0).await?, connect(1).await?);
    register(&mut c0, cfg, 0).await?;
    register(&mut c1, cfg, 1).await?;
    if !c0.has_data_link() || !c1.has_data_link() {
        bail!("the shard at {addr} offered no data connection");
    }
    let mut raw = raw_tcp::connect(raw_addr(addr)?).await?;
    let mut w = vec![0f32; len];
    let mut rbuf = vec![0u8; len * 4];
    let raw_data: Vec<u8> = (0..len * 4).map(|i| (i * 7) as u8).collect();
    let layout = cfg.layout();
    let mut out = XhostTimes::default();
    // odd steps push in pieces, even ones whole: `repeats` of each after the untimed step 0
    for t in 0..=2 * repeats as u64 {
        wait_version(&mut c0, cfg, t).await?;
        let t0 = Instant::now();
        c0.pull_into(t, false, None, &mut w).await?;
        let t1 = Instant::now();
        if t % 2 == 1 {
            push_pieces(&c0, 0, t, grad, &layout).await?;
        } else {
            push(&mut c0, 0, t, grad).await?;
        }
        let t2 = Instant::now();
        push(&mut c1, 1, t, grad).await?;
        // the update done before the raw transfers, so they do not share the CPU with it
        wait_version(&mut c0, cfg, t + 1).await?;
        let t3 = Instant::now();
        raw_tcp::send(&mut raw, &raw_data).await?;
        let t4 = Instant::now();
        raw_tcp::fetch(&mut raw, &mut rbuf).await?;
        let t5 = Instant::now();
        if t > 0 {
            let s = |a: Instant, b: Instant| (b - a).as_secs_f64();
            out.pull.push(s(t0, t1));
            out.raw_pull.push(s(t4, t5));
            if t % 2 == 1 {
                out.pieces.push(s(t1, t2));
                out.raw_push_pieces.push(s(t3, t4));
            } else {
                out.push.push(s(t1, t2));
                out.raw_push.push(s(t3, t4));
            }
        }
    }
    raw_tcp::end(&mut raw).await?;
    if !c0.data_link_usable() || !c1.data_link_usable() {
        bail!(
            "the data connection to {addr} was found unreachable: the values went through gRPC chunks"
        );
    }
    black_box((&w, &rbuf));
    Ok(out)
}

/// One row per direction: the data connection's median against raw TCP's of the same bytes.
fn xhost_rows(t: &XhostTimes, bytes: usize) -> Vec<Value> {
    let row = |what: &str, how: &str, dl: &[f64], raw: &[f64]| {
        let (d, r) = (median(dl), median(raw));
        // each repeat's two transfers ran back to back: their ratio, then the median, so that
        // a burst of load from elsewhere falls on both sides of one ratio
        let paired: Vec<f64> = dl.iter().zip(raw).map(|(a, b)| a / b).collect();
        json!({
            "what": what, "how": how, "bytes": bytes,
            "ms": d * 1e3, "gbs": gbs(bytes, d), "raw_ms": r * 1e3, "raw_gbs": gbs(bytes, r),
            "ratio": median(&paired), "ratio_of_medians": d / r,
            "ms_samples": dl.iter().map(|v| v * 1e3).collect::<Vec<_>>(),
            "raw_ms_samples": raw.iter().map(|v| v * 1e3).collect::<Vec<_>>(),
        })
    };
    vec![
        row(
            "pull",
            "version t by rank 0: gRPC request, one frame shard -> worker read into a Vec<f32>; raw: 1 byte asked, all bytes read into a buffer",
            &t.pull,
            &t.raw_pull,
        ),
        row(
            "push",
            "step t of rank 0 (W = 2: no update before the reply), pre-encoded: gRPC header + one frame worker -> shard; raw: all bytes written, 1-byte ack",
            &t.push,
            &t.raw_push,
        ),
        row(
            "push in pieces",
            "as push, the frame in one piece per tensor, last first (a worker's progressive push, every piece ready); raw: all bytes written, 1-byte ack",
            &t.pieces,
            &t.raw_push_pieces,
        ),
    ]
}

/// The table of `--xhost-client`.
pub(crate) fn table(rows: &[Value], addr: SocketAddr) -> String {
    let mut s = format!(
        "## Across hosts: the data connection against raw TCP (large model, S = 1, this host -> {addr})\n\n\
         | transfer | what exactly | bytes | data connection ms | GB/s | raw TCP ms (same bytes, same hosts, same run) | GB/s | ratio (data connection / raw: median of the repeats' ratios) |\n\
         |---|---|---:|---:|---:|---:|---:|---:|\n"
    );
    for r in rows.iter().filter(|r| r.get("pass").is_none()) {
        let _ = writeln!(
            s,
            "| {} | {} | {:.1} MB | {:.1} | {:.2} | {:.1} | {:.2} | {:.2} |",
            r["what"].as_str().unwrap_or("?"),
            r["how"].as_str().unwrap_or("?"),
            f(r, "bytes") / 1e6,
            f(r, "ms"),
            f(r, "gbs"),
            f(r, "raw_ms"),
            f(r, "raw_gbs"),
            f(r, "ratio"),
        );
    }
    let _ = writeln!(
        s,
        "\nPasses over the range the shard makes and raw TCP does not (timed on this host, same run):"
    );
    for r in rows.iter().filter(|r| r.get("pass").is_some()) {
        let _ = writeln!(
            s,
            "- {}: {:.1} ms",
            r["what"].as_str().unwrap_or("?"),
            f(r, "ms")
        );
    }
    s
}
