//! Rate-limited warnings: a warning that can repeat (a refused push, a refused connection, a
//! failing write, an accept loop out of descriptors) is logged at most once per [`LOG_EVERY`]
//! for each kind, and the line that is logged says how many like it were not
//! ([`Repeats`], "(N more since the last report, T in all)"). What was counted but never
//! reported is said when the process stops ([`ThrottleMap::unreported`]), so the counts in the
//! log add up to every event.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// At most one log line per this long for each kind of repeated warning.
pub const LOG_EVERY: Duration = Duration::from_secs(5);

/// The count a rate-limited line carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repeats {
    /// Events since the previous line of this kind, this one included.
    pub since: u64,
    /// Events of this kind in all.
    pub total: u64,
}

impl Repeats {
    /// Events counted but not logged since the previous line: `since - 1`.
    pub fn more(&self) -> u64 {
        self.since.saturating_sub(1)
    }
}

/// Appended to the warning: nothing for the first of its kind, else
/// " (N more since the last report, T in all)".
impl fmt::Display for Repeats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.total <= 1 {
            return Ok(());
        }
        write!(
            f,
            " ({} more since the last report, {} in all)",
            self.more(),
            self.total
        )
    }
}

/// Counts an event and says when it is time to log it (once per [`LOG_EVERY`]).
#[derive(Debug, Default)]
pub struct Throttle {
    count: u64,
    since_log: u64,
    last: Option<Instant>,
}

impl Throttle {
    /// None counted yet (a `const fn`, for statics).
    pub const fn new() -> Self {
        Self {
            count: 0,
            since_log: 0,
            last: None,
        }
    }

    /// Counts one; the counts when it is time to log it.
    pub fn hit(&mut self) -> Option<Repeats> {
        self.count += 1;
        self.since_log += 1;
        let now = Instant::now();
        if self.last.is_none_or(|t| now.duration_since(t) >= LOG_EVERY) {
            self.last = Some(now);
            let since = std::mem::take(&mut self.since_log);
            Some(Repeats {
                since,
                total: self.count,
            })
        } else {
            None
        }
    }

    /// The events counted since the last line (None when there are none), now reported:
    /// `since` is how many were not logged.
    pub fn take_unreported(&mut self) -> Option<Repeats> {
        let since = std::mem::take(&mut self.since_log);
        (since > 0).then_some(Repeats {
            since,
            total: self.count,
        })
    }
}

/// A [`Throttle`] behind a lock, for a `static` (a warning of a code path without state of
/// its own, e.g. a failing write).
#[derive(Debug)]
pub struct SharedThrottle(Mutex<Throttle>);

impl SharedThrottle {
    /// None counted yet.
    pub const fn new() -> Self {
        Self(Mutex::new(Throttle::new()))
    }

    /// [`Throttle::hit`].
    pub fn hit(&self) -> Option<Repeats> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .hit()
    }
}

impl Default for SharedThrottle {
    fn default() -> Self {
        Self::new()
    }
}

/// One [`Throttle`] per kind of a warning (e.g. per gRPC code of a refused push), so that one
/// kind flooding the log does not hide the first of another.
#[derive(Debug)]
pub struct ThrottleMap<K>(Mutex<BTreeMap<K, Throttle>>);

impl<K: Ord + Clone> ThrottleMap<K> {
    /// None counted yet.
    pub const fn new() -> Self {
        Self(Mutex::new(BTreeMap::new()))
    }

    /// [`Throttle::hit`] for `kind`.
    pub fn hit(&self, kind: &K) -> Option<Repeats> {
        let mut m = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(t) = m.get_mut(kind) {
            return t.hit();
        }
        m.entry(kind.clone()).or_default().hit()
    }

    /// Every kind with events not logged yet, with their counts (now reported), for a closing
    /// line.
    pub fn unreported(&self) -> Vec<(K, Repeats)> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter_mut()
            .filter_map(|(k, t)| t.take_unreported().map(|r| (k.clone(), r)))
            .collect()
    }
}

impl<K: Ord + Clone> Default for ThrottleMap<K> {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_is_logged_once_and_counted_in_full() {
        let m = ThrottleMap::<&str>::new();
        let logged: Vec<Repeats> = (0..1000).filter_map(|_| m.hit(&"a")).collect();
        assert_eq!(logged, vec![Repeats { since: 1, total: 1 }]);
        assert_eq!(logged[0].to_string(), "");
        // another kind is logged at once
        assert!(m.hit(&"b").is_some());
        let left = m.unreported();
        assert_eq!(
            left,
            vec![(
                "a",
                Repeats {
                    since: 999,
                    total: 1000
                }
            )]
        );
        assert_eq!(
            Repeats {
                since: 999,
                total: 1000
            }
            .to_string(),
            " (998 more since the last report, 1000 in all)"
        );
        assert!(m.unreported().is_empty(), "reported once");
    }
}
