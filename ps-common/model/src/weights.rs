//! Weights on disk in `safetensors`, read and written by the `safetensors` crate (8-byte
//! little-endian header length, a JSON header, then the raw little-endian data), written
//! atomically (temporary file, then rename). A whole model
//! is stored with PyTorch names and shapes; a shard stores its flat range as one tensor `flat`
//! with its start and end in the metadata. Also the weight comparison the tests and the
//! reference command use.

use crate::layout::ModelSpec;
use safetensors::SafeTensors;
use safetensors::tensor::Dtype;
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
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

/// One tensor's f32 values as the `safetensors` crate writes them (little-endian bytes, made
/// when the file is written, one tensor at a time).
struct F32View<'a> {
    shape: &'a [usize],
    data: &'a [f32],
}

impl safetensors::View for F32View<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Owned(self.data.iter().flat_map(|v| v.to_le_bytes()).collect())
    }
    fn data_len(&self) -> usize {
        self.data.len() * 4
    }
}

/// Writes `tensors` (name, shape, values) and string metadata to `path` atomically (the
/// `safetensors` crate's format and checks, into a temporary file synced, then renamed).
pub fn write_safetensors(
    path: &Path,
    tensors: &[(&str, &[usize], &[f32])],
    metadata: &BTreeMap<String, String>,
) -> Result<(), WeightsError> {
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
    }
    let views = tensors
        .iter()
        .map(|(name, shape, data)| (*name, F32View { shape, data }));
    let info: HashMap<String, String> = metadata.clone().into_iter().collect();
    let tmp = path.with_extension("safetensors.tmp");
    let write = || -> std::io::Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        safetensors::serialize_to_file(views, (!info.is_empty()).then_some(info), &tmp)
            .map_err(std::io::Error::other)?;
        std::fs::File::open(&tmp)
            .and_then(|f| f.sync_all())
            .and_then(|()| std::fs::rename(&tmp, path))
    };
    write().map_err(|e| {
        // a failed write (a full disk) leaves no partial temporary file behind
        let _ = std::fs::remove_file(&tmp);
        werr(path, format!("cannot write: {e}"))
    })
}

/// Reads every F32 tensor (in name order) and the metadata of a safetensors file, checked by
/// the `safetensors` crate (header, offsets covering the data exactly, shapes).
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
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| werr(path, format!("not a valid safetensors file: {e}")))?;
    let (_, header) = SafeTensors::read_metadata(&bytes)
        .map_err(|e| werr(path, format!("not a valid safetensors file: {e}")))?;
    let meta: BTreeMap<String, String> = header
        .metadata()
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect();
    let mut tensors = Vec::new();
    for (name, view) in st.tensors() {
        if view.dtype() != Dtype::F32 {
            return Err(werr(
                path,
                format!("tensor {name}: dtype {:?}: expected F32", view.dtype()),
            ));
        }
        let data = view
            .data()
            .chunks_exact(4)
            .map(|w| f32::from_le_bytes([w[0], w[1], w[2], w[3]]))
            .collect();
        tensors.push(NamedTensor {
            name,
            shape: view.shape().to_vec(),
            data,
        });
    }
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
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
                .contains("not a valid safetensors file")
        );
    }

    /// Files written here are what the `safetensors` crate reads, and files the crate writes
    /// (another tool's: other tensor order, other padding) are read here, values bit for bit;
    /// a tensor whose offsets leave bytes over is refused (the crate's check).
    #[test]
    fn files_are_the_safetensors_crates_both_ways() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.safetensors");
        let a = [1.5f32, -0.0, f32::MIN_POSITIVE, 3.25e-39, 7.0, 8.0];
        let b = [f32::MAX, 2.0];
        let meta = BTreeMap::from([("start".to_string(), "5".to_string())]);
        write_safetensors(&p, &[("w", &[2, 3], &a), ("b", &[2], &b)], &meta).unwrap();
        let bytes = std::fs::read(&p).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let w = st.tensor("w").unwrap();
        assert_eq!((w.dtype(), w.shape()), (Dtype::F32, &[2usize, 3][..]));
        let got: Vec<u32> = w
            .data()
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(got, a.map(f32::to_bits));
        let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(header.metadata().as_ref().unwrap()["start"], "5");
        // the crate's own file, read here
        let q = dir.path().join("y.safetensors");
        let raw: Vec<u8> = b.iter().flat_map(|v| v.to_le_bytes()).collect();
        let view = safetensors::tensor::TensorView::new(Dtype::F32, vec![2], &raw).unwrap();
        safetensors::serialize_to_file([("z", view)], None, &q).unwrap();
        let (tensors, meta) = read_safetensors(&q).unwrap();
        assert!(meta.is_empty());
        assert_eq!(tensors.len(), 1);
        assert_eq!(tensors[0].name, "z");
        assert_eq!(
            tensors[0]
                .data
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<_>>(),
            b.map(f32::to_bits)
        );
        // one value more than the shape says: refused, naming the file
        let mut extra = std::fs::read(&q).unwrap();
        extra.extend_from_slice(&1f32.to_le_bytes());
        std::fs::write(&q, &extra).unwrap();
        let e = read_safetensors(&q).unwrap_err().to_string();
        assert!(
            e.contains("y.safetensors: not a valid safetensors file"),
            "{e}"
        );
    }
}
