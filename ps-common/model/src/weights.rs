//! Weights on disk in `safetensors` (8-byte little-endian header length, a JSON header, then
//! the raw little-endian data), written atomically (temporary file, then rename). A whole model
//! is stored with PyTorch names and shapes; a shard stores its flat range as one tensor `flat`
//! with its start and end in the metadata. Also the weight comparison the tests and the
//! reference command use.

use crate::layout::ModelSpec;
use serde_json::{Map, Value, json};
use std::collections::BTreeMap;
use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// A weights-file error, naming the file.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {message}")]
pub struct WeightsError {
    /// The file.
    pub path: PathBuf,
    /// What is wrong.
    pub message: String,
}

fn werr(path: &Path, message: impl Into<String>) -> WeightsError {
    WeightsError {
        path: path.into(),
        message: message.into(),
    }
}

/// One named tensor read from a file.
#[derive(Debug, Clone, PartialEq)]
pub struct NamedTensor {
    /// Name.
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Values.
    pub data: Vec<f32>,
}

/// Writes `tensors` (name, shape, values) and string metadata to `path` atomically.
pub fn write_safetensors(
    path: &Path,
    tensors: &[(&str, &[usize], &[f32])],
    metadata: &BTreeMap<String, String>,
) -> Result<(), WeightsError> {
    let mut header = Map::new();
    if !metadata.is_empty() {
        header.insert("__metadata__".into(), json!(metadata));
    }
    let mut offset = 0usize;
    for (name, shape, data) in tensors {
        let numel: usize = shape.iter().product();
        if numel != data.len() {
            return Err(werr(
                path,
                format!(
                    "tensor {name}: shape {shape:?} needs {numel} values, got {}",
                    data.len()
                ),
            ));
        }
        let end = offset + data.len() * 4;
        header.insert(
            (*name).into(),
            json!({"dtype": "F32", "shape": shape, "data_offsets": [offset, end]}),
        );
        offset = end;
    }
    let mut head =
        serde_json::to_vec(&Value::Object(header)).map_err(|e| werr(path, e.to_string()))?;
    while head.len() % 8 != 0 {
        head.push(b' ');
    }
    let tmp = path.with_extension("safetensors.tmp");
    let write = || -> std::io::Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let mut f = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
        f.write_all(&(head.len() as u64).to_le_bytes())?;
        f.write_all(&head)?;
        for (_, _, data) in tensors {
            for v in *data {
                f.write_all(&v.to_le_bytes())?;
            }
        }
        f.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        std::fs::rename(&tmp, path)
    };
    write().map_err(|e| {
        // a failed write (a full disk) leaves no partial temporary file behind
        let _ = std::fs::remove_file(&tmp);
        werr(path, format!("cannot write: {e}"))
    })
}

/// Reads every F32 tensor and the metadata of a safetensors file.
pub fn read_safetensors(
    path: &Path,
) -> Result<(Vec<NamedTensor>, BTreeMap<String, String>), WeightsError> {
    let bytes = std::fs::read(path).map_err(|e| werr(path, format!("cannot read: {e}")))?;
    if bytes.len() < 8 {
        return Err(werr(
            path,
            format!(
                "{} bytes: expected at least an 8-byte header length",
                bytes.len()
            ),
        ));
    }
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let body = bytes.len() - 8;
    if n > body {
        return Err(werr(
            path,
            format!("header length {n} exceeds the {body} bytes after it"),
        ));
    }
    let header: Map<String, Value> = serde_json::from_slice(&bytes[8..8 + n])
        .map_err(|e| werr(path, format!("bad JSON header: {e}")))?;
    let data = &bytes[8 + n..];
    let mut meta = BTreeMap::new();
    let mut tensors = Vec::new();
    for (name, v) in header {
        if name == "__metadata__" {
            if let Some(m) = v.as_object() {
                for (k, v) in m {
                    meta.insert(k.clone(), v.as_str().unwrap_or_default().to_string());
                }
            }
            continue;
        }
        let bad = |what: &str| werr(path, format!("tensor {name}: {what}"));
        if v["dtype"] != "F32" {
            return Err(bad(&format!("dtype {}: expected F32", v["dtype"])));
        }
        let shape: Vec<usize> =
            serde_json::from_value(v["shape"].clone()).map_err(|_| bad("bad shape"))?;
        let offs: [usize; 2] = serde_json::from_value(v["data_offsets"].clone())
            .map_err(|_| bad("bad data_offsets"))?;
        let numel: usize = shape.iter().product();
        if offs[1] < offs[0] || offs[1] > data.len() || offs[1] - offs[0] != numel * 4 {
            return Err(bad(&format!(
                "data_offsets {offs:?} do not hold {numel} f32 values within {} bytes",
                data.len()
            )));
        }
        let values = data[offs[0]..offs[1]]
            .chunks_exact(4)
            .map(|w| f32::from_le_bytes([w[0], w[1], w[2], w[3]]))
            .collect();
        tensors.push(NamedTensor {
            name,
            shape,
            data: values,
        });
    }
    Ok((tensors, meta))
}

/// File name of shard `i`'s final weights inside the output directory.
pub fn shard_file(out_dir: &Path, shard: usize) -> PathBuf {
    out_dir.join(format!("shard-{shard}.safetensors"))
}

/// File name of the model's final buffers inside the output directory (shard 0 writes it for
/// a declared model with buffers: their safetensors serialization).
pub fn buffers_file(out_dir: &Path) -> PathBuf {
    out_dir.join("buffers.safetensors")
}

/// Writes one shard's flat range.
pub fn write_shard(
    out_dir: &Path,
    shard: usize,
    range: Range<usize>,
    version: u64,
    values: &[f32],
) -> Result<PathBuf, WeightsError> {
    let path = shard_file(out_dir, shard);
    let meta: BTreeMap<String, String> = [
        ("shard".to_string(), shard.to_string()),
        ("start".to_string(), range.start.to_string()),
        ("end".to_string(), range.end.to_string()),
        ("version".to_string(), version.to_string()),
    ]
    .into();
    write_safetensors(&path, &[("flat", &[values.len()], values)], &meta)?;
    Ok(path)
}

/// Reassembles the flat parameter vector from the shard files of `out_dir`, checking that the
/// ranges tile `0..num_params` and that every shard is at the same version. Returns it and the version.
pub fn read_shards(
    out_dir: &Path,
    num_shards: usize,
    num_params: usize,
) -> Result<(Vec<f32>, u64), WeightsError> {
    let mut flat = vec![0f32; num_params];
    let mut next = 0usize;
    let mut version = None;
    for s in 0..num_shards {
        let path = shard_file(out_dir, s);
        let (tensors, meta) = read_safetensors(&path)?;
        let field = |k: &str| -> Result<u64, WeightsError> {
            meta.get(k)
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| werr(&path, format!("metadata {k} missing")))
        };
        let (start, end, v) = (
            field("start")? as usize,
            field("end")? as usize,
            field("version")?,
        );
        let t = tensors
            .iter()
            .find(|t| t.name == "flat")
            .ok_or_else(|| werr(&path, "no tensor `flat`"))?;
        if start != next || end > num_params || t.data.len() != end - start {
            return Err(werr(
                &path,
                format!(
                    "range {start}..{end}: expected to start at {next} and end by {num_params}"
                ),
            ));
        }
        if *version.get_or_insert(v) != v {
            return Err(werr(
                &path,
                format!(
                    "version {v}: other shards are at version {}",
                    version.unwrap_or(0)
                ),
            ));
        }
        flat[start..end].copy_from_slice(&t.data);
        next = end;
    }
    if next != num_params {
        return Err(werr(
            out_dir,
            format!("shards cover 0..{next}: expected 0..{num_params}"),
        ));
    }
    Ok((flat, version.unwrap_or(0)))
}

/// Writes a whole model with PyTorch names and shapes.
pub fn write_model(
    path: &Path,
    spec: &ModelSpec,
    flat: &[f32],
    meta: &BTreeMap<String, String>,
) -> Result<(), WeightsError> {
    let tensors: Vec<(&str, &[usize], &[f32])> = spec
        .tensors
        .iter()
        .map(|t| (t.name.as_str(), t.shape.as_slice(), &flat[t.range()]))
        .collect();
    write_safetensors(path, &tensors, meta)
}

/// Reads a whole model written by [`write_model`] (or PyTorch) into the flat layout.
pub fn read_model(path: &Path, layout: &ModelSpec) -> Result<Vec<f32>, WeightsError> {
    let (tensors, _) = read_safetensors(path)?;
    let mut flat = vec![0f32; layout.num_params()];
    for t in &layout.tensors {
        let found = tensors
            .iter()
            .find(|x| x.name == t.name)
            .ok_or_else(|| werr(path, format!("no tensor {}", t.name)))?;
        if found.shape != t.shape {
            return Err(werr(
                path,
                format!(
                    "tensor {}: shape {:?}, expected {:?}",
                    t.name, found.shape, t.shape
                ),
            ));
        }
        flat[t.range()].copy_from_slice(&found.data);
    }
    Ok(flat)
}

/// The largest relative difference between two weight vectors, per tensor:
/// `max_i |a_i - b_i| / max_i |b_i|` (the largest deviation relative to the tensor's largest
/// weight), and the tensor where it occurs.
pub fn max_rel_diff(layout: &ModelSpec, a: &[f32], b: &[f32]) -> (f64, String) {
    let mut worst = (0.0f64, String::new());
    for t in &layout.tensors {
        let r = t.range();
        let scale = b[r.clone()]
            .iter()
            .fold(0f64, |m, v| m.max(f64::from(v.abs())))
            .max(f64::MIN_POSITIVE);
        let dev = a[r.clone()].iter().zip(&b[r]).fold(0f64, |m, (x, y)| {
            m.max((f64::from(*x) - f64::from(*y)).abs())
        });
        if dev / scale > worst.0 || worst.1.is_empty() {
            worst = (dev / scale, t.name.clone());
        }
    }
    worst
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{MlpLayout, shard_ranges};

    #[test]
    fn model_and_shards_roundtrip() {
        let dir = tempfile::tempdir().unwrap();
        let layout = MlpLayout::new(&[5, 4, 3]);
        let flat = layout.init_range(1, 0..layout.num_params());
        let p = dir.path().join("model.safetensors");
        write_model(&p, &layout, &flat, &BTreeMap::new()).unwrap();
        assert_eq!(read_model(&p, &layout).unwrap(), flat);
        for (i, r) in shard_ranges(flat.len(), 3).into_iter().enumerate() {
            write_shard(dir.path(), i, r.clone(), 7, &flat[r]).unwrap();
        }
        assert_eq!(
            read_shards(dir.path(), 3, flat.len()).unwrap(),
            (flat.clone(), 7)
        );
        let mut other = flat.clone();
        other[2] += 0.001;
        let (d, name) = max_rel_diff(&layout, &other, &flat);
        assert_eq!(name, "fc1.weight");
        assert!(d > 1e-4 && d < 1e-2, "{d}");
        assert_eq!(max_rel_diff(&layout, &flat, &flat).0, 0.0);
    }

    #[test]
    fn corrupt_files_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.safetensors");
        std::fs::write(&p, [1, 0, 0]).unwrap();
        assert!(
            read_safetensors(&p)
                .unwrap_err()
                .to_string()
                .contains("expected at least an 8-byte")
        );
        std::fs::write(&p, 100u64.to_le_bytes()).unwrap();
        assert!(
            read_safetensors(&p)
                .unwrap_err()
                .to_string()
                .contains("exceeds")
        );
    }
}
