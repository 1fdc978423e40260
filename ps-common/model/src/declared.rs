//! Models declared by the user: `[model] init = "init.safetensors"`, a `safetensors` file of
//! `f32` tensors (what PyTorch writes with `safetensors.torch.save_file`) whose metadata key
//! [`ORDER_KEY`] holds the flat order, a JSON list of the tensor names in PyTorch's
//! `named_parameters()` order (safetensors itself keeps no insertion order).
//!
//! [`Declared::open`] reads only the header (bounded) and checks it against the file's length;
//! [`Declared::read_range`] reads one range of the flat vector (a shard's) and nothing else.
//! Every error names the file and, where one is at fault, the tensor.
//!
//! Besides the trained parameters the file may hold the model's other `state_dict` entries,
//! each named in a metadata list and kept in its own dtype: [`BUFFER_KEY`] (buffers, e.g.
//! BatchNorm running statistics: shard 0 holds them through the run, [`Declared::buffers`]),
//! [`CONSTANT_KEY`] (frozen parameters, constant through the run) and [`ALIAS_KEY`] (a JSON
//! object naming, for each tied entry, the entry it shares storage with). The export
//! ([`write_full_model`]) writes them all, so PyTorch's `load_state_dict(strict=True)` restores
//! the whole model.

use crate::layout::{Init, ModelSpec};
use safetensors::tensor::{Dtype, Metadata};
use std::collections::HashSet;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// What is wrong with a declared model's init file, a buffers blob, or an export of the model.
#[derive(Debug, thiserror::Error)]
pub enum DeclaredError {
    /// The init file cannot be opened or read.
    #[error("[model] init = {path:?}: {doing}: {source}")]
    Unreadable {
        /// The file.
        path: String,
        /// What was being read ("cannot open", "cannot read tensor \"w\"").
        doing: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The init file is read but refused: its header, metadata or a tensor is not what is
    /// expected (the reason says what was expected).
    #[error("[model] init = {path:?}: {reason}")]
    Refused {
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// Buffers were given for a model that has none.
    #[error(
        "the run's model has no buffers (its init file names none in \"buffer_order\"): write it with ps.save_init(model, path) from the model that has them"
    )]
    NoBuffers,
    /// A buffers blob that is not a safetensors serialization.
    #[error("buffers: not a safetensors serialization: {0}")]
    BuffersNotSafetensors(safetensors::SafeTensorError),
    /// A buffer of the model is missing from the blob.
    #[error("buffers: {name:?} missing (the run's model has buffers {have:?})")]
    BufferMissing {
        /// The missing buffer.
        name: String,
        /// The model's buffers.
        have: Vec<String>,
    },
    /// A buffer of the blob has another dtype or shape than the model's.
    #[error(
        "buffers: {name:?} is {dtype:?} {shape:?}: the run's model has {want_dtype:?} {want_shape:?}"
    )]
    BufferDiffers {
        /// The buffer.
        name: String,
        /// Its dtype in the blob.
        dtype: Dtype,
        /// Its shape in the blob.
        shape: Vec<usize>,
        /// The model's dtype.
        want_dtype: Dtype,
        /// The model's shape.
        want_shape: Vec<usize>,
    },
    /// The blob holds an entry that is not a buffer of the model.
    #[error("buffers: {0:?} is not a buffer of the run's model")]
    NotABuffer(String),
    /// An export of a model with buffers was given none.
    #[error("{path}: the model has buffers ({count}) but the run wrote none")]
    ExportWithoutBuffers {
        /// The export file.
        path: String,
        /// How many buffers the model has.
        count: usize,
    },
    /// A tied alias names an entry the export does not hold.
    #[error("alias {alias:?}: no entry {target:?}")]
    AliasTarget {
        /// The alias.
        alias: String,
        /// The entry it names.
        target: String,
    },
    /// An entry whose bytes do not fit its dtype and shape.
    #[error("tensor {name:?}: {source}")]
    Tensor {
        /// The entry.
        name: String,
        /// What safetensors says.
        source: safetensors::SafeTensorError,
    },
    /// A serialization that safetensors refuses.
    #[error(transparent)]
    Safetensors(#[from] safetensors::SafeTensorError),
    /// The export cannot be written.
    #[error("{path}: cannot write: {source}")]
    Write {
        /// The export file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
}

impl DeclaredError {
    /// An I/O error reading the init file `path` while `doing`.
    fn unreadable(path: &Path, doing: impl Into<String>, source: std::io::Error) -> Self {
        Self::Unreadable {
            path: path.display().to_string(),
            doing: doing.into(),
            source,
        }
    }

    /// The init file `path` refused for `reason`.
    fn refused(path: &Path) -> impl Fn(String) -> Self + '_ {
        move |reason| Self::Refused {
            path: path.display().to_string(),
            reason,
        }
    }
}

/// The metadata key of the flat order: a JSON array of tensor names.
pub const ORDER_KEY: &str = "parameter_order";
/// The metadata key of the buffers: a JSON array of tensor names (any dtype).
pub const BUFFER_KEY: &str = "buffer_order";
/// The metadata key of the frozen parameters: a JSON array of tensor names (any dtype).
pub const CONSTANT_KEY: &str = "constant_order";
/// The metadata key of the modules that normalise by the batch's statistics and keep no
/// running ones (BatchNorm with `track_running_stats=False`): a JSON array of module names.
pub const BATCH_STAT_KEY: &str = "batch_statistics";
/// The metadata key of tied entries: a JSON object `{"alias": "entry it shares storage with"}`.
pub const ALIAS_KEY: &str = "aliases";
/// Most bytes of all buffers together: they travel in one gRPC message per step.
pub const MAX_BUFFER_BYTES: u64 = 32 << 20;
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
    /// The buffers ([`BUFFER_KEY`]), in the file's order.
    pub buffers: Vec<Extra>,
    /// The frozen parameters ([`CONSTANT_KEY`]).
    pub constants: Vec<Extra>,
    /// Tied entries ([`ALIAS_KEY`]): (alias, the entry it is a copy of).
    pub aliases: Vec<(String, String)>,
    /// The modules that normalise by each forward pass's own samples ([`BATCH_STAT_KEY`]).
    pub batch_statistics: Vec<String>,
}

/// A `state_dict` entry of a declared model that the shards do not train (a buffer, a frozen
/// parameter), in its own dtype.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Extra {
    /// PyTorch's name.
    pub name: String,
    /// Its dtype.
    pub dtype: Dtype,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Where its bytes start in the file.
    pub byte_offset: u64,
    /// How many bytes it has.
    pub byte_len: u64,
}

/// The dtypes a buffer or frozen entry may have (PyTorch's float, integer and bool types).
pub const EXTRA_DTYPES: [Dtype; 10] = [
    Dtype::F32,
    Dtype::F64,
    Dtype::F16,
    Dtype::BF16,
    Dtype::I64,
    Dtype::I32,
    Dtype::I16,
    Dtype::I8,
    Dtype::U8,
    Dtype::BOOL,
];

impl Declared {
    /// Reads and checks the header of `path`: every tensor F32, the order metadata naming each
    /// tensor of the file exactly once, and the data section exactly as long as the header says.
    pub fn open(path: &Path) -> Result<Self, DeclaredError> {
        let e = DeclaredError::refused(path);
        let (meta, data_start) = read_header(path, &e)?;
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
        let mut seen: HashSet<String> = HashSet::new();
        let specs = params_in_order(&meta, &tensors, data_start, &mut seen, &e)?;
        let buffers = extras(&meta, &tensors, data_start, &mut seen, BUFFER_KEY, &e)?;
        let constants = extras(&meta, &tensors, data_start, &mut seen, CONSTANT_KEY, &e)?;
        let buffer_bytes: u64 = buffers.iter().map(|b| b.byte_len).sum();
        if buffer_bytes > MAX_BUFFER_BYTES {
            return Err(e(format!(
                "the buffers ({BUFFER_KEY}) hold {buffer_bytes} bytes: at most {MAX_BUFFER_BYTES} (they travel in one message per step)"
            )));
        }
        let aliases = aliases(&meta, &seen, &e)?;
        if let Some(extra) = meta
            .offset_keys()
            .into_iter()
            .find(|k| !seen.contains(k.as_str()))
        {
            return Err(e(format!(
                "tensor {extra:?} is in the file but in none of the metadata lists \"{ORDER_KEY}\", \"{BUFFER_KEY}\", \"{CONSTANT_KEY}\": write the file with ps.save_init(model, path)"
            )));
        }
        Ok(Self {
            path: path.to_path_buf(),
            spec: ModelSpec::new(specs),
            buffers,
            constants,
            aliases,
            batch_statistics: batch_statistics(&meta, &e)?,
        })
    }

    /// The initial values of `range` of the flat vector, read from the file (only that range).
    pub fn read_range(&self, range: Range<usize>) -> Result<Vec<f32>, DeclaredError> {
        let e = DeclaredError::refused(&self.path);
        let file = std::fs::File::open(&self.path)
            .map_err(|err| DeclaredError::unreadable(&self.path, "cannot open", err))?;
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
                .map_err(|err| {
                    DeclaredError::unreadable(
                        &self.path,
                        format!("cannot read tensor {:?}", t.name),
                        err,
                    )
                })?;
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

impl Declared {
    /// The entries `which` read from the file, as one safetensors serialization (names,
    /// dtypes, shapes, bytes): what [`Declared::check_buffers`] accepts for the buffers.
    pub fn read_extras(&self, which: &[Extra]) -> Result<Vec<u8>, DeclaredError> {
        let e = DeclaredError::refused(&self.path);
        let file = std::fs::File::open(&self.path)
            .map_err(|err| DeclaredError::unreadable(&self.path, "cannot open", err))?;
        let mut raw = Vec::with_capacity(which.len());
        for x in which {
            let mut bytes = vec![0u8; x.byte_len as usize];
            file.read_exact_at(&mut bytes, x.byte_offset)
                .map_err(|err| {
                    DeclaredError::unreadable(
                        &self.path,
                        format!("cannot read tensor {:?}", x.name),
                        err,
                    )
                })?;
            raw.push(bytes);
        }
        let views = which
            .iter()
            .zip(&raw)
            .map(|(x, b)| {
                safetensors::tensor::TensorView::new(x.dtype, x.shape.clone(), b)
                    .map(|v| (x.name.clone(), v))
                    .map_err(|err| e(format!("tensor {:?}: {err}", x.name)))
            })
            .collect::<Result<Vec<_>, _>>()?;
        safetensors::serialize(views, None).map_err(|err| e(err.to_string()))
    }

    /// The buffers' initial values (None when the model has none).
    pub fn initial_buffers(&self) -> Result<Option<Vec<u8>>, DeclaredError> {
        if self.buffers.is_empty() {
            return Ok(None);
        }
        self.read_extras(&self.buffers).map(Some)
    }

    /// Checks that `blob` (a safetensors serialization) holds exactly the model's buffers:
    /// the same names, dtypes and shapes, nothing else; the error names the first difference.
    pub fn check_buffers(&self, blob: &[u8]) -> Result<(), DeclaredError> {
        if self.buffers.is_empty() {
            return Err(DeclaredError::NoBuffers);
        }
        let st = safetensors::SafeTensors::deserialize(blob)
            .map_err(DeclaredError::BuffersNotSafetensors)?;
        for x in &self.buffers {
            let t = st
                .tensor(&x.name)
                .map_err(|_| DeclaredError::BufferMissing {
                    name: x.name.clone(),
                    have: self.buffers.iter().map(|b| b.name.clone()).collect(),
                })?;
            if t.dtype() != x.dtype || t.shape() != x.shape.as_slice() {
                return Err(DeclaredError::BufferDiffers {
                    name: x.name.clone(),
                    dtype: t.dtype(),
                    shape: t.shape().to_vec(),
                    want_dtype: x.dtype,
                    want_shape: x.shape.clone(),
                });
            }
        }
        if st.len() != self.buffers.len() {
            let extra = st
                .names()
                .into_iter()
                .find(|n| !self.buffers.iter().any(|b| b.name == *n))
                .unwrap_or_default()
                .to_string();
            return Err(DeclaredError::NotABuffer(extra));
        }
        Ok(())
    }
}

/// Writes a declared model's whole `state_dict` to `path` (safetensors): the parameters from
/// `flat` (float32, the flat order), the buffers from `buffers` (a serialization
/// [`Declared::check_buffers`] accepts; required when the model has buffers), the frozen
/// parameters from the init file, and each tied alias as a copy of its entry; `meta` as the
/// file's metadata. `torch`'s `load_state_dict(strict=True)` restores the model from it.
pub fn write_full_model(
    path: &Path,
    d: &Declared,
    flat: &[f32],
    buffers: Option<&[u8]>,
    meta: &std::collections::BTreeMap<String, String>,
) -> Result<(), DeclaredError> {
    let mut entries: Vec<Entry> = Vec::new();
    for t in &d.spec.tensors {
        let bytes = flat[t.range()]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        entries.push((t.name.clone(), Dtype::F32, t.shape.clone(), bytes));
    }
    if !d.buffers.is_empty() {
        let blob = buffers.ok_or_else(|| DeclaredError::ExportWithoutBuffers {
            path: path.display().to_string(),
            count: d.buffers.len(),
        })?;
        d.check_buffers(blob)?;
        let st = safetensors::SafeTensors::deserialize(blob)?;
        for x in &d.buffers {
            let t = st.tensor(&x.name)?;
            entries.push((x.name.clone(), x.dtype, x.shape.clone(), t.data().to_vec()));
        }
    }
    let constants = safetensors_blob_entries(&d.read_extras(&d.constants)?)?;
    entries.extend(constants);
    for (alias, target) in &d.aliases {
        let (_, dtype, shape, bytes) = entries
            .iter()
            .find(|(n, ..)| n == target)
            .cloned()
            .ok_or_else(|| DeclaredError::AliasTarget {
                alias: alias.clone(),
                target: target.clone(),
            })?;
        entries.push((alias.clone(), dtype, shape, bytes));
    }
    let views = entries
        .iter()
        .map(|(n, dt, shape, b)| {
            safetensors::tensor::TensorView::new(*dt, shape.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|source| DeclaredError::Tensor {
                    name: n.clone(),
                    source,
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let info: std::collections::HashMap<String, String> =
        meta.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    let bytes = safetensors::serialize(views, Some(info))?;
    let tmp = path.with_extension("safetensors.tmp");
    std::fs::write(&tmp, &bytes)
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|source| {
            let _ = std::fs::remove_file(&tmp);
            DeclaredError::Write {
                path: path.display().to_string(),
                source,
            }
        })
}

/// One entry of an export: (name, dtype, shape, bytes).
type Entry = (String, Dtype, Vec<usize>, Vec<u8>);

/// The tensors of a safetensors serialization.
fn safetensors_blob_entries(blob: &[u8]) -> Result<Vec<Entry>, DeclaredError> {
    if blob.is_empty() {
        return Ok(Vec::new());
    }
    let st = safetensors::SafeTensors::deserialize(blob)?;
    Ok(st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec()))
        .collect())
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

/// The error text of [`Declared::open`]: the file named before `m`.
type Prefix<'a> = &'a dyn Fn(String) -> DeclaredError;

/// The tensors of a safetensors header, by name.
type Tensors<'a> = std::collections::HashMap<String, &'a safetensors::tensor::TensorInfo>;

/// Reads the safetensors header of `path`: the metadata and where the data section starts,
/// checked to end exactly at the end of the file.
fn read_header(path: &Path, e: Prefix) -> Result<(Metadata, u64), DeclaredError> {
    let file = std::fs::File::open(path)
        .map_err(|err| DeclaredError::unreadable(path, "cannot open", err))?;
    let file_len = file
        .metadata()
        .map_err(|err| DeclaredError::unreadable(path, "cannot read", err))?
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
        .map_err(|err| DeclaredError::unreadable(path, "cannot read the header", err))?;
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
    Ok((meta, data_start))
}

/// The parameters in the flat order the metadata's `ORDER_KEY` list names (each once, F32,
/// at most `MAX_DIMS` dimensions, at most `MAX_PARAMS` values in all), added to `seen`.
fn params_in_order(
    meta: &Metadata,
    tensors: &Tensors,
    data_start: u64,
    seen: &mut HashSet<String>,
    e: Prefix,
) -> Result<Vec<(String, Vec<usize>, Init)>, DeclaredError> {
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
    let mut specs = Vec::with_capacity(order.len());
    let mut total: u64 = 0;
    for name in &order {
        if !seen.insert(name.clone()) {
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
        if total > crate::MAX_PARAMS {
            return Err(e(format!("more than {} parameters", crate::MAX_PARAMS)));
        }
        specs.push((
            name.clone(),
            info.shape.clone(),
            Init::File {
                byte_offset: data_start + info.data_offsets.0 as u64,
            },
        ));
    }
    Ok(specs)
}

/// The module names of the metadata's [`BATCH_STAT_KEY`] list (none when absent).
fn batch_statistics(meta: &Metadata, e: Prefix) -> Result<Vec<String>, DeclaredError> {
    match meta.metadata().as_ref().and_then(|m| m.get(BATCH_STAT_KEY)) {
        None => Ok(Vec::new()),
        Some(text) => serde_json::from_str(text).map_err(|err| {
            e(format!(
                "metadata \"{BATCH_STAT_KEY}\" is not a JSON list of module names: {err}"
            ))
        }),
    }
}

/// The entries the metadata's `key` list names (buffers or constants): each held by the file,
/// named by no other list (added to `seen`), of one of [`EXTRA_DTYPES`].
fn extras(
    meta: &Metadata,
    tensors: &Tensors,
    data_start: u64,
    seen: &mut HashSet<String>,
    key: &str,
    e: Prefix,
) -> Result<Vec<Extra>, DeclaredError> {
    let list = |key: &str| -> Result<Vec<String>, DeclaredError> {
        match meta.metadata().as_ref().and_then(|m| m.get(key)) {
            None => Ok(Vec::new()),
            Some(text) => serde_json::from_str(text).map_err(|err| {
                e(format!(
                    "metadata \"{key}\" is not a JSON list of tensor names: {err}"
                ))
            }),
        }
    };
    let mut out = Vec::new();
    for name in list(key)? {
        if !seen.insert(name.clone()) {
            return Err(e(format!(
                "metadata \"{key}\" names tensor {name:?}, which another list (or this one) names too"
            )));
        }
        let info = tensors.get(&name).ok_or_else(|| {
            e(format!(
                "metadata \"{key}\" names tensor {name:?}, which the file does not hold"
            ))
        })?;
        if !EXTRA_DTYPES.contains(&info.dtype) {
            return Err(e(format!(
                "tensor {name:?} is {:?}: a buffer or frozen entry must be one of {EXTRA_DTYPES:?}",
                info.dtype
            )));
        }
        out.push(Extra {
            name,
            dtype: info.dtype,
            shape: info.shape.clone(),
            byte_offset: data_start + info.data_offsets.0 as u64,
            byte_len: (info.data_offsets.1 - info.data_offsets.0) as u64,
        });
    }
    Ok(out)
}

/// The metadata's `ALIAS_KEY` map (alias -> the entry it is tied to): each alias an entry the
/// file does not hold (not in `seen`), tied to one it holds.
fn aliases(
    meta: &Metadata,
    seen: &HashSet<String>,
    e: Prefix,
) -> Result<Vec<(String, String)>, DeclaredError> {
    Ok(
        match meta.metadata().as_ref().and_then(|m| m.get(ALIAS_KEY)) {
            None => Vec::new(),
            Some(text) => {
                let map: std::collections::BTreeMap<String, String> = serde_json::from_str(text)
                    .map_err(|err| {
                        e(format!(
                            "metadata \"{ALIAS_KEY}\" is not a JSON object of names: {err}"
                        ))
                    })?;
                for (alias, target) in &map {
                    if seen.contains(alias.as_str()) || !seen.contains(target.as_str()) {
                        return Err(e(format!(
                            "metadata \"{ALIAS_KEY}\": {alias:?} -> {target:?}: an alias must name an entry the file does not hold, tied to one it holds"
                        )));
                    }
                }
                map.into_iter().collect()
            }
        },
    )
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

    /// A file with a buffer (int64), a frozen entry and an alias: the buffers' blob is checked
    /// exactly, and the full export holds every entry in its dtype.
    #[test]
    fn buffers_constants_and_aliases() {
        use safetensors::tensor::TensorView;
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("init.safetensors");
        let w: Vec<u8> = [1f32, 2.].iter().flat_map(|v| v.to_le_bytes()).collect();
        let n: Vec<u8> = 7i64.to_le_bytes().to_vec();
        let f: Vec<u8> = [3f64].iter().flat_map(|v| v.to_le_bytes()).collect();
        let meta: std::collections::HashMap<String, String> = [
            (ORDER_KEY, r#"["w"]"#),
            (BUFFER_KEY, r#"["n"]"#),
            (CONSTANT_KEY, r#"["f"]"#),
            (ALIAS_KEY, r#"{"w2": "w"}"#),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let views = vec![
            ("w", TensorView::new(Dtype::F32, vec![2], &w).unwrap()),
            ("n", TensorView::new(Dtype::I64, vec![], &n).unwrap()),
            ("f", TensorView::new(Dtype::F64, vec![1], &f).unwrap()),
        ];
        std::fs::write(&p, safetensors::serialize(views, Some(meta)).unwrap()).unwrap();
        let m = Declared::open(&p).unwrap();
        assert_eq!(m.spec.num_params(), 2);
        assert_eq!((m.buffers.len(), m.constants.len()), (1, 1));
        let blob = m.initial_buffers().unwrap().unwrap();
        m.check_buffers(&blob).unwrap();
        let other = safetensors::serialize(
            vec![("n", TensorView::new(Dtype::I32, vec![], &n[..4]).unwrap())],
            None,
        )
        .unwrap();
        let e = m.check_buffers(&other).unwrap_err().to_string();
        assert!(
            e.contains("\"n\" is I32 []: the run's model has I64 []"),
            "{e}"
        );
        assert!(
            m.check_buffers(b"junk")
                .unwrap_err()
                .to_string()
                .contains("not a safetensors")
        );
        let out = d.path().join("model.safetensors");
        write_full_model(&out, &m, &[5., 6.], Some(&blob), &Default::default()).unwrap();
        let bytes = std::fs::read(&out).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut names = st.names();
        names.sort();
        assert_eq!(names, ["f", "n", "w", "w2"]);
        assert_eq!(st.tensor("n").unwrap().data(), &n[..]);
        assert_eq!(
            st.tensor("w2").unwrap().data(),
            st.tensor("w").unwrap().data()
        );
        assert_eq!(st.tensor("f").unwrap().dtype(), Dtype::F64);
        // no buffers given for a model that has them
        assert!(write_full_model(&out, &m, &[5., 6.], None, &Default::default()).is_err());
    }

    /// The modules that normalise by their batch's statistics: read from the metadata, none
    /// when the key is absent, a value that is not a list of names refused naming the key.
    #[test]
    fn batch_statistics_modules_are_read_from_the_metadata() {
        let d = tempfile::tempdir().unwrap();
        let t: &[(&str, &[usize], &[f32])] = &[("w", &[2], &[1., 2.])];
        let with = |v: Option<&str>| {
            let p = d.path().join("init.safetensors");
            let mut meta = BTreeMap::new();
            meta.insert(ORDER_KEY.to_string(), r#"["w"]"#.to_string());
            if let Some(v) = v {
                meta.insert(BATCH_STAT_KEY.to_string(), v.to_string());
            }
            crate::weights::write_safetensors(&p, t, &meta).unwrap();
            Declared::open(&p)
        };
        assert!(with(None).unwrap().batch_statistics.is_empty());
        assert_eq!(
            with(Some(r#"["bn", "blocks.0.bn"]"#))
                .unwrap()
                .batch_statistics,
            ["bn", "blocks.0.bn"]
        );
        let e = with(Some("{}")).unwrap_err().to_string();
        assert!(
            e.contains("metadata \"batch_statistics\" is not a JSON list of module names"),
            "{e}"
        );
    }

    #[test]
    fn bad_files_are_refused_naming_what_is_wrong() {
        let d = tempfile::tempdir().unwrap();
        let t: &[(&str, &[usize], &[f32])] = &[("w", &[2], &[1., 2.]), ("v", &[1], &[3.])];
        let err = |order: Option<&str>| {
            let p = write(d.path(), t, order);
            Declared::open(&p).unwrap_err().to_string()
        };
        assert!(err(None).contains("no \"parameter_order\""));
        assert!(err(Some("nope")).contains("not a JSON list"));
        assert!(err(Some(r#"["w"]"#)).contains("tensor \"v\" is in the file but in none"));
        assert!(err(Some(r#"["w","v","x"]"#)).contains("\"x\", which the file does not hold"));
        assert!(err(Some(r#"["w","w","v"]"#)).contains("twice"));
        let missing = Declared::open(&d.path().join("none.safetensors"))
            .unwrap_err()
            .to_string();
        assert!(missing.contains("cannot open"), "{missing}");
        // truncated
        let p = write(d.path(), t, Some(r#"["w","v"]"#));
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..bytes.len() - 2]).unwrap();
        assert!(
            Declared::open(&p)
                .unwrap_err()
                .to_string()
                .contains("truncated")
        );
        std::fs::write(&p, b"abc").unwrap();
        assert!(
            Declared::open(&p)
                .unwrap_err()
                .to_string()
                .contains("not a safetensors file")
        );
        std::fs::write(&p, [8u8, 0, 0, 0, 0, 0, 0, 0, b'{', b'x', 0, 0, 0, 0, 0, 0]).unwrap();
        assert!(
            Declared::open(&p)
                .unwrap_err()
                .to_string()
                .contains("malformed")
        );
        // a non-f32 tensor
        let head = br#"{"__metadata__":{"parameter_order":"[\"h\"]"},"h":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}}"#;
        let mut f = (head.len() as u64).to_le_bytes().to_vec();
        f.extend_from_slice(head);
        f.extend_from_slice(&[0; 4]);
        std::fs::write(&p, f).unwrap();
        let msg = Declared::open(&p).unwrap_err().to_string();
        assert!(msg.contains("tensor \"h\" is F16: expected F32"), "{msg}");
    }
}
