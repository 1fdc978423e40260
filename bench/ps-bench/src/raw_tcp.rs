//! Raw TCP of the same bytes, the limit that section 2 (one host, loopback) and the
//! cross-host mode (`xhost.rs`) set the shard's transfers against, with one protocol: a peer
//! on one connection that, told `P`, reads `n` bytes into a preallocated buffer and answers
//! one byte; told `G`, writes `n` bytes from its own buffer; told `Q`, ends. Every wait on
//! either side is bounded by [`WAIT`].

use super::*;

/// Longest either side waits for the other (connect, a command, a transfer).
pub(crate) const WAIT: Duration = Duration::from_secs(120);

/// The raw TCP peer: one connection, commands `P` (receive `n` bytes, answer one), `G` (send
/// `n` bytes), `Q` (end).
pub(crate) async fn peer(listener: std::net::TcpListener, n: usize) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let (mut s, _) = tokio::time::timeout(WAIT, listener.accept())
        .await
        .context("no client on the raw TCP port")??;
    s.set_nodelay(true)?;
    let mut buf: Vec<u8> = (0..n).map(|i| i as u8).collect();
    let mut cmd = [0u8; 1];
    loop {
        tokio::time::timeout(WAIT, s.read_exact(&mut cmd))
            .await
            .context("the client said nothing")??;
        match cmd[0] {
            b'P' => {
                within("reading the client's bytes", s.read_exact(&mut buf)).await?;
                within("answering the client", s.write_all(&[1])).await?;
            }
            b'G' => within("writing the bytes to the client", s.write_all(&buf)).await?,
            b'Q' => break,
            c => bail!("raw TCP peer: command {c:#04x}: expected P, G or Q"),
        }
    }
    black_box(&buf);
    Ok(())
}

/// `io` within [`WAIT`], or an error saying what did not finish.
async fn within<T>(what: &str, io: impl Future<Output = std::io::Result<T>>) -> anyhow::Result<T> {
    match tokio::time::timeout(WAIT, io).await {
        Ok(r) => r.with_context(|| what.to_string()),
        Err(_) => bail!("{what}: not done within {} s", WAIT.as_secs()),
    }
}

/// The raw peer's connection, retried until it listens (bounded by [`WAIT`]).
pub(crate) async fn connect(addr: SocketAddr) -> anyhow::Result<tokio::net::TcpStream> {
    let deadline = Instant::now() + WAIT;
    loop {
        match tokio::net::TcpStream::connect(addr).await {
            Ok(s) => {
                s.set_nodelay(true)?;
                return Ok(s);
            }
            Err(e) if Instant::now() > deadline => {
                return Err(e).with_context(|| format!("raw TCP peer at {addr}"));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// `P`: `data` to the peer, then its one-byte answer (the peer has read all of it).
pub(crate) async fn send(s: &mut tokio::net::TcpStream, data: &[u8]) -> anyhow::Result<()> {
    within("raw TCP to the peer", async {
        s.write_all(b"P").await?;
        s.write_all(data).await?;
        s.read_exact(&mut [0u8; 1]).await
    })
    .await?;
    Ok(())
}

/// `G`: the peer's `buf.len()` bytes into `buf`.
pub(crate) async fn fetch(s: &mut tokio::net::TcpStream, buf: &mut [u8]) -> anyhow::Result<()> {
    within("raw TCP from the peer", async {
        s.write_all(b"G").await?;
        s.read_exact(buf).await
    })
    .await?;
    Ok(())
}

/// `Q`: ends the peer.
pub(crate) async fn end(s: &mut tokio::net::TcpStream) -> anyhow::Result<()> {
    within("ending the raw peer", s.write_all(b"Q")).await
}
