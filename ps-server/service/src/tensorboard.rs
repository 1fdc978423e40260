//! TensorBoard event files: shard 0 writes `events.out.tfevents.<unix seconds>.<host>` next to
//! `metrics.jsonl` (loss, train accuracy, lr, gradient norm, step time, barrier wait, test
//! accuracy), so `tensorboard --logdir <out_dir>` shows the run.
//!
//! The format is TensorFlow's: a sequence of TFRecords (`u64` length little-endian, masked
//! CRC-32C of the length, the bytes, masked CRC-32C of the bytes), each an `Event` protobuf
//! generated from TensorFlow's own `event.proto` and `summary.proto` ([`ps_proto::tensorflow`],
//! trimmed copies in `proto/tensorflow/` with the upstream field numbers); the first one says
//! `file_version: "brain.Event:2"`. A run resumed at version v starts its file with a
//! `SessionLog START` at step v + 1: TensorBoard's loader then drops the points of step v + 1
//! and later from the files before it (the steps the resumed run redoes), so each step shows
//! once.

use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

pub use ps_proto::tensorflow::event::What;
pub use ps_proto::tensorflow::session_log::SessionStatus;
pub use ps_proto::tensorflow::summary::Value as SummaryValue;
pub use ps_proto::tensorflow::summary::value::Value as Scalar;
pub use ps_proto::tensorflow::{Event, SessionLog, Summary};

/// TFRecord's CRC: CRC-32C, rotated right by 15 bits plus a constant.
pub fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// Wall-clock time in seconds since the Unix epoch, to the millisecond (the `time` of every
/// metrics line and event record).
pub fn unix_time() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| (d.as_secs_f64() * 1e3).round() / 1e3)
}

/// Appends events to one file.
#[derive(Debug)]
pub struct EventWriter {
    path: PathBuf,
    file: io::BufWriter<std::fs::File>,
}

impl EventWriter {
    /// Creates a new event file in `dir` (`events.out.tfevents.<unix seconds>.<host>`; a
    /// suffix keeps two files of one second apart) and writes its version record; `resumed_at`
    /// adds a `SessionLog START` at that step.
    pub fn create(dir: &Path, resumed_at: Option<u64>) -> io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let now = unix_time();
        let host = hostname();
        let mut path = dir.join(format!("events.out.tfevents.{}.{host}", now as u64));
        let mut n = 1;
        let file = loop {
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
            {
                Ok(f) => break f,
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists && n < 100 => {
                    path = dir.join(format!("events.out.tfevents.{}.{host}.{n}", now as u64));
                    n += 1;
                }
                Err(e) => return Err(e),
            }
        };
        let mut w = Self {
            path,
            file: io::BufWriter::new(file),
        };
        w.write(&Event {
            wall_time: now,
            step: 0,
            what: Some(What::FileVersion("brain.Event:2".into())),
        })?;
        if let Some(v) = resumed_at {
            // the first step the resumed run writes: TensorBoard purges it and later ones
            // from the earlier files
            w.write(&Event {
                wall_time: now,
                step: v as i64 + 1,
                what: Some(What::SessionLog(SessionLog {
                    status: SessionStatus::Start as i32,
                    checkpoint_path: String::new(),
                    msg: format!("resumed at version {v}"),
                })),
            })?;
        }
        w.file.flush()?;
        Ok(w)
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes the scalars `values` (tag, value) of step `step`, and flushes.
    pub fn scalars(&mut self, step: u64, wall_time: f64, values: &[(&str, f64)]) -> io::Result<()> {
        let value = values
            .iter()
            .map(|&(tag, v)| SummaryValue {
                node_name: String::new(),
                tag: tag.to_string(),
                value: Some(Scalar::SimpleValue(v as f32)),
            })
            .collect();
        self.write(&Event {
            wall_time,
            step: step as i64,
            what: Some(What::Summary(Summary { value })),
        })?;
        self.file.flush()
    }

    fn write(&mut self, ev: &Event) -> io::Result<()> {
        let data = prost::Message::encode_to_vec(ev);
        let len = (data.len() as u64).to_le_bytes();
        self.file.write_all(&len)?;
        self.file.write_all(&masked_crc(&len).to_le_bytes())?;
        self.file.write_all(&data)?;
        self.file.write_all(&masked_crc(&data).to_le_bytes())
    }
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname writes at most that many bytes.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let name = if rc == 0 {
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        String::from_utf8_lossy(&buf[..end]).into_owned()
    } else {
        String::new()
    };
    // the name goes into a file name
    let clean: String = name
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
        .collect();
    if clean.is_empty() {
        "localhost".into()
    } else {
        clean
    }
}

/// What is wrong with an event file.
#[derive(Debug)]
pub enum ReadError {
    /// The file could not be read.
    Io(io::Error),
    /// A record's length or data does not match its CRC, or the file ends inside a record.
    Corrupt {
        /// Byte offset of the record.
        offset: u64,
        /// What.
        what: &'static str,
    },
    /// A record is not an `Event`.
    Decode {
        /// Byte offset of the record.
        offset: u64,
        /// The decoder's message.
        why: String,
    },
}

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Io(e) => write!(f, "{e}"),
            Self::Corrupt { offset, what } => write!(f, "record at byte {offset}: {what}"),
            Self::Decode { offset, why } => {
                write!(f, "record at byte {offset} is not an Event: {why}")
            }
        }
    }
}

impl std::error::Error for ReadError {}

/// Reads every event of an event file, checking both CRCs of every record.
pub fn read_events(path: &Path) -> Result<Vec<Event>, ReadError> {
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|mut f| f.read_to_end(&mut bytes))
        .map_err(ReadError::Io)?;
    let mut out = Vec::new();
    let mut at = 0usize;
    while at < bytes.len() {
        let offset = at as u64;
        let corrupt = |what| ReadError::Corrupt { offset, what };
        let head = bytes.get(at..at + 12).ok_or(corrupt("truncated header"))?;
        let len_bytes: [u8; 8] = head[..8].try_into().expect("8 bytes");
        let len_crc = u32::from_le_bytes(head[8..12].try_into().expect("4 bytes"));
        if masked_crc(&len_bytes) != len_crc {
            return Err(corrupt("length CRC mismatch"));
        }
        let len = usize::try_from(u64::from_le_bytes(len_bytes))
            .map_err(|_| corrupt("length too large"))?;
        let start = at + 12;
        let end = start
            .checked_add(len)
            .filter(|&e| e + 4 <= bytes.len())
            .ok_or(corrupt("truncated data"))?;
        let data = &bytes[start..end];
        let data_crc = u32::from_le_bytes(bytes[end..end + 4].try_into().expect("4 bytes"));
        if masked_crc(data) != data_crc {
            return Err(corrupt("data CRC mismatch"));
        }
        let ev = <Event as prost::Message>::decode(data).map_err(|e| ReadError::Decode {
            offset,
            why: e.to_string(),
        })?;
        out.push(ev);
        at = end + 4;
    }
    Ok(out)
}

/// The scalars of `events` as (tag, step, value), in file order.
pub fn scalars(events: &[Event]) -> Vec<(String, u64, f32)> {
    events
        .iter()
        .filter_map(|e| match &e.what {
            Some(What::Summary(s)) => Some((e.step, s)),
            _ => None,
        })
        .flat_map(|(step, s)| {
            s.value.iter().filter_map(move |v| match v.value {
                Some(Scalar::SimpleValue(x)) => Some((v.tag.clone(), step as u64, x)),
                _ => None,
            })
        })
        .collect()
}

/// The event files (`*tfevents*`) in `dir`, oldest name first.
pub fn event_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("events.out.tfevents."))
        })
        .collect();
    files.sort();
    files
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CRC-32C of the RFC 3720 test vectors (32 zero bytes: 0x8a9136aa; "123456789":
    /// 0xe3069283), and TFRecord's mask of it.
    #[test]
    fn masked_crc_of_known_vectors() {
        assert_eq!(crc32c::crc32c(&[0u8; 32]), 0x8a91_36aa);
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        // TensorFlow's Mask(): ((crc >> 15) | (crc << 17)) + 0xa282ead8, worked out by hand
        assert_eq!(masked_crc(&[0u8; 32]), 0x0fd7_fffa);
    }

    /// The bytes TensorFlow's own encoder gives (`Event(step=8, session_log=SessionLog(
    /// status=START))`: field 2 varint 8, field 7 length-delimited holding field 1 varint 1):
    /// the restart marker TensorBoard honours is field 7, not 6 (`log_message`).
    #[test]
    fn the_restart_marker_is_tensorflows_session_log_field_7() {
        let ev = Event {
            wall_time: 0.0,
            step: 8,
            what: Some(What::SessionLog(SessionLog {
                status: SessionStatus::Start as i32,
                checkpoint_path: String::new(),
                msg: String::new(),
            })),
        };
        assert_eq!(
            prost::Message::encode_to_vec(&ev),
            [0x10, 0x08, 0x3a, 0x02, 0x08, 0x01]
        );
    }

    #[test]
    fn written_scalars_read_back_and_corruption_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path(), Some(7)).unwrap();
        w.scalars(8, 1.5, &[("train/loss", 0.25), ("train/lr", 0.1)])
            .unwrap();
        w.scalars(9, 2.5, &[("train/loss", 0.125)]).unwrap();
        let path = w.path().to_path_buf();
        drop(w);
        assert_eq!(event_files(dir.path()), vec![path.clone()]);
        let events = read_events(&path).unwrap();
        assert_eq!(events.len(), 4);
        assert_eq!(
            events[0].what,
            Some(What::FileVersion("brain.Event:2".into()))
        );
        assert!(
            matches!(&events[1].what, Some(What::SessionLog(s)) if s.status == SessionStatus::Start as i32)
        );
        assert_eq!(
            events[1].step, 8,
            "resumed at 7: the marker at the first redone step"
        );
        assert_eq!(
            scalars(&events),
            vec![
                ("train/loss".to_string(), 8, 0.25),
                ("train/lr".to_string(), 8, 0.1),
                ("train/loss".to_string(), 9, 0.125)
            ]
        );
        assert_eq!(events[2].wall_time, 1.5);
        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 6;
        bytes[last] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let err = read_events(&path).unwrap_err().to_string();
        assert!(err.contains("data CRC mismatch"), "{err}");
        bytes.truncate(bytes.len() - 3);
        std::fs::write(&path, &bytes).unwrap();
        let err = read_events(&path).unwrap_err().to_string();
        assert!(err.contains("truncated data"), "{err}");
    }
}
