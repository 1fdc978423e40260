//! Models declared by the user: `[model] init = "init.safetensors"`, a `safetensors` file of
//! `f32` tensors (what PyTorch writes with `safetensors.torch.save_file`) whose metadata key
//! [`ORDER_KEY`] holds the flat order, a JSON list of the tensor names in PyTorch's
//! `named_parameters()` order (safetensors itself keeps no insertion order).
//!
//! [`Declared::open`] reads only the header (bounded) and checks it against the file's length;
//! [`Declared::read_range`] reads one range of the flat vector (a shard's) and nothing else.
//! Every error names the file and, where one is at fault, the tensor.

use crate::layout::{Init, ModelSpec};
use safetensors::tensor::{Dtype, Metadata};
use std::collections::HashSet;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// The metadata key of the flat order: a JSON array of tensor names.
pub const ORDER_KEY: &str = "parameter_order";
/// Largest header read (the JSON that names, shapes and places the tensors).
pub const MAX_HEADER_BYTES: u64 = 64 << 20;
/// Most tensors of a declared model.
pub const MAX_TENSORS: usize = 100_000;
/// Most dimensions of one tensor.
pub const MAX_DIMS: usize = 8;

/// A declared model: the file, and its tensors in flat order, each with [`Init::File`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Declared {
    /// The init file.
    pub path: PathBuf,
    /// Names, shapes and flat offsets; each tensor's init is its place in the file.
    pub spec: ModelSpec,
}

impl Declared {
    /// Reads and checks the header of `path`: every tensor F32, the order metadata naming each
    /// tensor of the file exactly once, and the data section exactly as long as the header says.
    pub fn open(path: &Path) -> Result<Self, String> {
        let e = |m: String| format!("[model] init = {:?}: {m}", path.display().to_string());
        let file = std::fs::File::open(path).map_err(|err| e(format!("cannot open: {err}")))?;
        let file_len = file
            .metadata()
            .map_err(|err| e(format!("cannot read: {err}")))?
            .len();
        let mut len8 = [0u8; 8];
        file.read_exact_at(&mut len8, 0).map_err(|_| {
            e(format!(
                "not a safetensors file: {file_len} bytes, expected at least an 8-byte header length"
            ))
        })?;
        let n = u64::from_le_bytes(len8);
        if n > MAX_HEADER_BYTES || n > file_len - 8 {
            return Err(e(format!(
                "not a safetensors file: header length {n} (the file has {} bytes after it; at most {MAX_HEADER_BYTES} accepted)",
                file_len - 8
            )));
        }
        let mut head = vec![0u8; n as usize];
        file.read_exact_at(&mut head, 8)
            .map_err(|err| e(format!("cannot read the header: {err}")))?;
        let meta: Metadata = serde_json::from_slice(&head)
            .map_err(|err| e(format!("malformed safetensors header: {err}")))?;
        let data_start = 8 + n;
        if data_start + meta.data_len() as u64 != file_len {
            return Err(e(format!(
                "malformed safetensors file: the header places {} bytes of data after byte {data_start}, but the file has {} (truncated or padded)",
                meta.data_len(),
                file_len - data_start
            )));
        }
        let tensors = meta.tensors();
        if tensors.is_empty() {
            return Err(e("holds no tensors".into()));
        }
        if tensors.len() > MAX_TENSORS {
            return Err(e(format!(
                "holds {} tensors: expected at most {MAX_TENSORS}",
                tensors.len()
            )));
        }
        let order_text = meta
            .metadata()
            .as_ref()
            .and_then(|m| m.get(ORDER_KEY))
            .ok_or_else(|| {
                e(format!(
                    "no \"{ORDER_KEY}\" in the file's metadata: safetensors keeps no order, so the file must say the flat order (PyTorch's named_parameters() order). Write it with ps.save_init(model, path), or save_file(tensors, path, metadata={{\"{ORDER_KEY}\": json.dumps([n for n, p in model.named_parameters()])}})"
                ))
            })?;
        let order: Vec<String> = serde_json::from_str(order_text).map_err(|err| {
            e(format!(
                "metadata \"{ORDER_KEY}\" is not a JSON list of tensor names: {err}"
            ))
        })?;
        let mut seen = HashSet::new();
        let mut specs = Vec::with_capacity(order.len());
        let mut total: u64 = 0;
        for name in &order {
            if !seen.insert(name.as_str()) {
                return Err(e(format!(
                    "metadata \"{ORDER_KEY}\" names tensor {name:?} twice"
                )));
            }
            let info = tensors.get(name).ok_or_else(|| {
                e(format!(
                    "metadata \"{ORDER_KEY}\" names tensor {name:?}, which the file does not hold"
                ))
            })?;
            if info.dtype != Dtype::F32 {
                return Err(e(format!(
                    "tensor {name:?} is {:?}: expected F32 (convert with model.float() before saving)",
                    info.dtype
                )));
            }
            if info.shape.len() > MAX_DIMS {
                return Err(e(format!(
                    "tensor {name:?} has {} dimensions: expected at most {MAX_DIMS}",
                    info.shape.len()
                )));
            }
            let numel: u64 = info.shape.iter().map(|&d| d as u64).product();
            total += numel;
            if total > crate::config::limits::MAX_PARAMS {
                return Err(e(format!(
                    "more than {} parameters",
                    crate::config::limits::MAX_PARAMS
                )));
            }
            specs.push((
                name.clone(),
                info.shape.clone(),
                Init::File {
                    byte_offset: data_start + info.data_offsets.0 as u64,
                },
            ));
        }
        if let Some(extra) = meta
            .offset_keys()
            .into_iter()
            .find(|k| !seen.contains(k.as_str()))
        {
            return Err(e(format!(
                "tensor {extra:?} is in the file but not in metadata \"{ORDER_KEY}\": every tensor of the file must be a parameter of the model (write only named_parameters(), not buffers)"
            )));
        }
        Ok(Self {
            path: path.to_path_buf(),
            spec: ModelSpec::new(specs),
        })
    }

    /// The initial values of `range` of the flat vector, read from the file (only that range).
    pub fn read_range(&self, range: Range<usize>) -> Result<Vec<f32>, String> {
        let e = |m: String| format!("[model] init = {:?}: {m}", self.path.display().to_string());
        let file =
            std::fs::File::open(&self.path).map_err(|err| e(format!("cannot open: {err}")))?;
        let mut out = vec![0f32; range.len()];
        let mut bytes = Vec::new();
        for t in &self.spec.tensors {
            let r = t.range();
            let (lo, hi) = (r.start.max(range.start), r.end.min(range.end));
            if lo >= hi {
                continue;
            }
            let Init::File { byte_offset } = t.init else {
                return Err(e(format!("tensor {:?} has no place in the file", t.name)));
            };
            bytes.resize((hi - lo) * 4, 0);
            file.read_exact_at(&mut bytes, byte_offset + ((lo - r.start) * 4) as u64)
                .map_err(|err| e(format!("cannot read tensor {:?}: {err}", t.name)))?;
            for (dst, src) in out[lo - range.start..hi - range.start]
                .iter_mut()
                .zip(bytes.chunks_exact(4))
            {
                *dst = f32::from_le_bytes(src.try_into().expect("4 bytes"));
            }
        }
        Ok(out)
    }
}

/// The first difference between the model a shard holds and one a worker describes (names and
/// shapes in flat order), in words; None when they are the same.
pub fn first_difference(ours: &ModelSpec, theirs: &[(String, Vec<usize>)]) -> Option<String> {
    for (i, t) in ours.tensors.iter().enumerate() {
        match theirs.get(i) {
            None => {
                return Some(format!(
                    "the worker's model has {} tensors and lacks tensor {i} {:?} {:?}",
                    theirs.len(),
                    t.name,
                    t.shape
                ));
            }
            Some((name, shape)) if *name != t.name || *shape != t.shape => {
                return Some(format!(
                    "tensor {i} differs: the worker has {name:?} {shape:?}, the run's model {:?} {:?}",
                    t.name, t.shape
                ));
            }
            Some(_) => {}
        }
    }
    theirs.get(ours.tensors.len()).map(|(name, shape)| {
        format!(
            "the worker's model has {} tensors, the run's {}: the first extra is {name:?} {shape:?}",
            theirs.len(),
            ours.tensors.len()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn write(dir: &Path, tensors: &[(&str, &[usize], &[f32])], order: Option<&str>) -> PathBuf {
        let p = dir.join("init.safetensors");
        let mut meta = BTreeMap::new();
        if let Some(o) = order {
            meta.insert(ORDER_KEY.to_string(), o.to_string());
        }
        crate::weights::write_safetensors(&p, tensors, &meta).unwrap();
        p
    }

    #[test]
    fn order_from_metadata_and_ranges_read_alone() {
        let d = tempfile::tempdir().unwrap();
        // the file holds a before b (alphabetical); the order says b first
        let p = write(
            d.path(),
            &[
                ("a", &[2, 2], &[1., 2., 3., 4.]),
                ("b", &[3], &[5., 6., 7.]),
            ],
            Some(r#"["b", "a"]"#),
        );
        let m = Declared::open(&p).unwrap();
        let names: Vec<_> = m.spec.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["b", "a"]);
        assert_eq!(m.spec.num_params(), 7);
        assert_eq!(m.read_range(0..7).unwrap(), [5., 6., 7., 1., 2., 3., 4.]);
        assert_eq!(m.read_range(2..5).unwrap(), [7., 1., 2.]);
        assert_eq!(m.read_range(5..5).unwrap(), Vec::<f32>::new());
        let theirs = vec![("b".to_string(), vec![3]), ("a".to_string(), vec![2, 2])];
        assert_eq!(first_difference(&m.spec, &theirs), None);
        let other = vec![("b".to_string(), vec![3]), ("a".to_string(), vec![4])];
        let msg = first_difference(&m.spec, &other).unwrap();
        assert!(
            msg.contains("tensor 1") && msg.contains("\"a\" [4]"),
            "{msg}"
        );
        let msg = first_difference(&m.spec, &theirs[..1]).unwrap();
        assert!(msg.contains("lacks tensor 1 \"a\""), "{msg}");
    }

    #[test]
    fn bad_files_are_refused_naming_what_is_wrong() {
        let d = tempfile::tempdir().unwrap();
        let t: &[(&str, &[usize], &[f32])] = &[("w", &[2], &[1., 2.]), ("v", &[1], &[3.])];
        let err = |order: Option<&str>| {
            let p = write(d.path(), t, order);
            Declared::open(&p).unwrap_err()
        };
        assert!(err(None).contains("no \"parameter_order\""));
        assert!(err(Some("nope")).contains("not a JSON list"));
        assert!(err(Some(r#"["w"]"#)).contains("tensor \"v\" is in the file but not"));
        assert!(err(Some(r#"["w","v","x"]"#)).contains("\"x\", which the file does not hold"));
        assert!(err(Some(r#"["w","w","v"]"#)).contains("twice"));
        let missing = Declared::open(&d.path().join("none.safetensors")).unwrap_err();
        assert!(missing.contains("cannot open"), "{missing}");
        // truncated
        let p = write(d.path(), t, Some(r#"["w","v"]"#));
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..bytes.len() - 2]).unwrap();
        assert!(Declared::open(&p).unwrap_err().contains("truncated"));
        std::fs::write(&p, b"abc").unwrap();
        assert!(
            Declared::open(&p)
                .unwrap_err()
                .contains("not a safetensors file")
        );
        std::fs::write(&p, [8u8, 0, 0, 0, 0, 0, 0, 0, b'{', b'x', 0, 0, 0, 0, 0, 0]).unwrap();
        assert!(Declared::open(&p).unwrap_err().contains("malformed"));
        // a non-f32 tensor
        let head = br#"{"__metadata__":{"parameter_order":"[\"h\"]"},"h":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}}"#;
        let mut f = (head.len() as u64).to_le_bytes().to_vec();
        f.extend_from_slice(head);
        f.extend_from_slice(&[0; 4]);
        std::fs::write(&p, f).unwrap();
        let msg = Declared::open(&p).unwrap_err();
        assert!(msg.contains("tensor \"h\" is F16: expected F32"), "{msg}");
    }
}
