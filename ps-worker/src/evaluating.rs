//! The worker's word to the shards while it evaluates the final weights: each shard waits
//! `[server] linger_secs` after a rank's last word for its leave (`ps_server::linger`), so a
//! final evaluation slower than the linger (a large model on a loaded CPU) neither fails a
//! run whose every step finished nor leaves its accuracy half counted.

use ps_net::client::ShardClient;
use ps_net::peer::Peer;
use ps_proto::pb::LeaveRequest;
use std::time::Duration;

/// How often the word is said: a quarter of `linger_secs`, between 10 ms and 5 s.
pub fn word_interval(linger_secs: f64) -> Duration {
    Duration::from_secs_f64((linger_secs / 4.0).clamp(0.01, 5.0))
}

/// Says to every shard of `peers` that `rank` is evaluating, now and then every
/// [`word_interval`], until the returned task is aborted. A shard that does not take the word
/// is left to the leave that follows, which says what went wrong.
pub fn say_evaluating(
    peers: &[Peer],
    rank: usize,
    linger_secs: f64,
) -> tokio::task::JoinHandle<()> {
    let clients: Vec<ShardClient> = peers.iter().map(|p| p.client.clone()).collect();
    let every = word_interval(linger_secs);
    tokio::spawn(async move {
        let mut clients = clients;
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            for c in &mut clients {
                let word = LeaveRequest {
                    rank: rank as u32,
                    evaluating: true,
                    ..Default::default()
                };
                match tokio::time::timeout(every, c.leave(word)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => tracing::debug!("rank {rank}: the word that it evaluates: {e}"),
                    Err(_) => tracing::debug!(
                        "rank {rank}: the word that it evaluates: no answer within {every:?}"
                    ),
                }
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_interval_is_a_quarter_of_the_linger_within_bounds() {
        assert_eq!(word_interval(30.0), Duration::from_secs(5));
        assert_eq!(word_interval(1.0), Duration::from_millis(250));
        assert_eq!(word_interval(0.001), Duration::from_millis(10));
    }
}
