//! IDX (MNIST-format) dataset loading: gzip or raw files, validated, with errors that name the file and what is wrong.
//!
//! An IDX file is a 4-byte big-endian magic number (two zero bytes, a type byte, and the number of
//! dimensions), then each dimension as a big-endian `u32`, then the data. Only the unsigned-byte
//! type (0x08) is accepted here: images files have 3 dimensions (n, rows, cols), labels files 1 (n).
//! Gzip is detected by the 0x1f 0x8b magic, not by the file name.

use std::fmt::Write as _;
use std::fs::File;
use std::io::{self, BufReader, Read};
use std::path::{Path, PathBuf};

use flate2::bufread::MultiGzDecoder;

/// IDX data-type byte for unsigned bytes, the only type accepted.
const IDX_TYPE_U8: u8 = 0x08;

/// Largest payload accepted (16 GiB); larger headers are rejected before any allocation.
pub const MAX_PAYLOAD_BYTES: u64 = 1 << 34;

/// Read buffer for the compressed (or raw) file.
const READ_BUF_BYTES: usize = 256 * 1024;

/// Errors from reading and validating IDX files. Every message names the file (or directory).
#[derive(Debug, thiserror::Error)]
pub enum IdxError {
    /// The file could not be opened or read.
    #[error("{}: cannot {action}: {error}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What was being done, e.g. "open" or "read".
        action: &'static str,
        /// The operating system's error.
        error: io::Error,
    },

    /// The gzip stream is corrupt or ends early.
    #[error("{}: corrupt or truncated gzip stream: {error}", path.display())]
    Gzip {
        /// The file.
        path: PathBuf,
        /// The decoder's error.
        error: io::Error,
    },

    /// The file ends inside the magic number or the dimension sizes.
    #[error(
        "{}: truncated header: expected {expected} bytes (magic number and {dims} dimension sizes) but the {} holds only {found} bytes",
        path.display(),
        file_word(*gzip),
    )]
    TruncatedHeader {
        /// The file.
        path: PathBuf,
        /// Whether it is gzip-compressed.
        gzip: bool,
        /// Dimensions its magic number declares.
        dims: usize,
        /// Header bytes expected.
        expected: usize,
        /// Bytes the file holds.
        found: usize,
    },

    /// The magic number is not an unsigned-byte IDX magic (first two bytes not zero, or wrong type).
    #[error(
        "{}: bad magic number 0x{found:08x}: expected 0x{expected:08x} ({}), found {}",
        path.display(),
        describe_magic(*expected),
        describe_magic(*found),
    )]
    BadMagic {
        /// The file.
        path: PathBuf,
        /// The magic number read.
        found: u32,
        /// The magic number expected.
        expected: u32,
    },

    /// A valid unsigned-byte IDX magic, but with a different number of dimensions than expected.
    #[error(
        "{}: bad magic number 0x{found:08x}: expected 0x{expected:08x} ({}), found {found_dims} dimension{}",
        path.display(),
        describe_magic(magic_for(*expected_dims)),
        plural(*found_dims),
        found = magic_for(*found_dims),
        expected = magic_for(*expected_dims),
    )]
    WrongDimensions {
        /// The file.
        path: PathBuf,
        /// Dimensions expected.
        expected_dims: usize,
        /// Dimensions its magic number declares.
        found_dims: usize,
    },

    /// The dimensions describe more than [`MAX_PAYLOAD_BYTES`] bytes (or overflow).
    #[error(
        "{}: header dimensions {} describe {} bytes: expected at most {MAX_PAYLOAD_BYTES} bytes (1<<34)",
        path.display(),
        join_dims(dims),
        total.map_or_else(|| "more than 2^64".to_string(), |t| t.to_string()),
    )]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// The header's dimension sizes.
        dims: Vec<usize>,
        /// Product of the dimensions, `None` if it overflows `u64`.
        total: Option<u64>,
    },

    /// Fewer payload bytes than the header promises.
    #[error(
        "{}: truncated: header says {} but the {} holds {found} bytes after the header",
        path.display(),
        describe_shape(dims),
        file_word(*gzip),
    )]
    Truncated {
        /// The file.
        path: PathBuf,
        /// Whether it is gzip-compressed.
        gzip: bool,
        /// The header's dimension sizes.
        dims: Vec<usize>,
        /// Payload bytes the file holds.
        found: u64,
    },

    /// More payload bytes than the header promises.
    #[error(
        "{}: trailing data: header says {} but the {} holds {found} bytes after the header ({} extra)",
        path.display(),
        describe_shape(dims),
        file_word(*gzip),
        found - expected,
    )]
    TrailingData {
        /// The file.
        path: PathBuf,
        /// Whether it is gzip-compressed.
        gzip: bool,
        /// The header's dimension sizes.
        dims: Vec<usize>,
        /// Payload bytes the header promises.
        expected: u64,
        /// Payload bytes the file holds.
        found: u64,
    },

    /// Images with zero rows or columns.
    #[error("{}: images are {rows}x{cols}: expected at least 1x1 pixels", path.display())]
    EmptyImages {
        /// The images file.
        path: PathBuf,
        /// Rows per image.
        rows: usize,
        /// Columns per image.
        cols: usize,
    },

    /// A label that is not below the number of classes.
    #[error(
        "{}: label {label} at index {index} is out of range: expected {}",
        path.display(),
        label_range(*num_classes),
    )]
    LabelOutOfRange {
        /// The labels file.
        path: PathBuf,
        /// The label.
        label: u8,
        /// Its index in the file.
        index: usize,
        /// The number of classes.
        num_classes: usize,
    },

    /// Neither the raw nor the gzip file exists.
    #[error("{}: no {what}: expected {expected}", dir.join("").display())]
    MissingFile {
        /// The directory searched.
        dir: PathBuf,
        /// e.g. "train images".
        what: String,
        /// e.g. "train-images-idx3-ubyte or train-images-idx3-ubyte.gz".
        expected: String,
    },

    /// The images and labels files disagree on the number of items.
    #[error(
        "images file has {images} items but labels file has {labels}: {} vs {}",
        images_path.display(),
        labels_path.display(),
    )]
    CountMismatch {
        /// The images file.
        images_path: PathBuf,
        /// The labels file.
        labels_path: PathBuf,
        /// Items in the images file.
        images: usize,
        /// Items in the labels file.
        labels: usize,
    },
}

fn file_word(gzip: bool) -> &'static str {
    if gzip { "decompressed file" } else { "file" }
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

fn magic_for(dims: usize) -> u32 {
    (u32::from(IDX_TYPE_U8) << 8) | (dims as u32 & 0xff)
}

fn describe_magic(magic: u32) -> String {
    let [z0, z1, ty, dims] = magic.to_be_bytes();
    if z0 != 0 || z1 != 0 {
        return "not an IDX file: the first two bytes are not zero".to_string();
    }
    let ty_name = match ty {
        0x08 => "unsigned-byte",
        0x09 => "signed-byte",
        0x0b => "i16",
        0x0c => "i32",
        0x0d => "f32",
        0x0e => "f64",
        _ => "unknown-type",
    };
    format!(
        "IDX {ty_name} (type 0x{ty:02x}), {dims} dimension{}",
        plural(usize::from(dims))
    )
}

fn join_dims(dims: &[usize]) -> String {
    let mut s = String::new();
    for (i, d) in dims.iter().enumerate() {
        if i > 0 {
            s.push('x');
        }
        let _ = write!(s, "{d}");
    }
    s
}

fn payload_len(dims: &[usize]) -> u64 {
    dims.iter().map(|&d| d as u64).product()
}

fn describe_shape(dims: &[usize]) -> String {
    let bytes = payload_len(dims);
    match dims {
        [n, rows, cols] => format!("{n} images of {rows}x{cols} ({bytes} bytes of pixels)"),
        [n] => format!("{n} labels ({bytes} bytes)"),
        _ => format!("dimensions {} ({bytes} bytes of data)", join_dims(dims)),
    }
}

fn label_range(num_classes: usize) -> String {
    match num_classes {
        0 => "no labels at all (num_classes is 0)".to_string(),
        n => format!("0..={}", n - 1),
    }
}

/// Which half of the dataset to load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// The training images (`train-*`).
    Train,
    /// The test images (`t10k-*`).
    Test,
}

impl Split {
    /// File-name prefix: "train" or "t10k".
    pub fn prefix(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Test => "t10k",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Test => "test",
        }
    }
}

/// Images kept as raw u8 pixels (row-major, one image after another); converted to f32 per batch by the caller.
#[derive(Debug, Clone)]
pub struct Dataset {
    /// `len() * rows * cols` bytes.
    pub images: Vec<u8>,
    /// One label per image.
    pub labels: Vec<u8>,
    /// Rows per image.
    pub rows: usize,
    /// Columns per image.
    pub cols: usize,
}

impl Dataset {
    /// Number of items.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether it holds no item.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Pixels per image: `rows * cols`.
    pub fn features(&self) -> usize {
        self.rows * self.cols
    }

    /// Pixels of image i as a slice of `features()` bytes. Panics if `i >= len()`.
    pub fn image(&self, i: usize) -> &[u8] {
        let f = self.features();
        &self.images[i * f..(i + 1) * f]
    }

    /// Writes the listed images into `out` (row-major [indices.len(), features]) as f32 = pixel / 255.0,
    /// and their labels into `labels_out` (cleared first). `out` is cleared and resized.
    /// Panics if an index is `>= len()`.
    pub fn gather(&self, indices: &[u32], out: &mut Vec<f32>, labels_out: &mut Vec<u8>) {
        out.clear();
        out.reserve(indices.len() * self.features());
        labels_out.clear();
        labels_out.reserve(indices.len());
        for &i in indices {
            let i = i as usize;
            out.extend(self.image(i).iter().map(|&p| f32::from(p) / 255.0));
            labels_out.push(self.labels[i]);
        }
    }
}

/// Finds `<dir>/<stem>` or `<dir>/<stem>.gz`, preferring the raw file.
fn find_file(dir: &Path, stem: &str, what: String) -> Result<PathBuf, IdxError> {
    let raw = dir.join(stem);
    if raw.is_file() {
        return Ok(raw);
    }
    let gz = dir.join(format!("{stem}.gz"));
    if gz.is_file() {
        return Ok(gz);
    }
    Err(IdxError::MissingFile {
        dir: dir.to_path_buf(),
        what,
        expected: format!("{stem} or {stem}.gz"),
    })
}

/// Loads `<dir>/<prefix>-images-idx3-ubyte[.gz]` and `<dir>/<prefix>-labels-idx1-ubyte[.gz]` (prefer the raw file if both exist), validates them, and checks every label < num_classes.
pub fn load_split(dir: &Path, split: Split, num_classes: usize) -> Result<Dataset, IdxError> {
    let (images_path, labels_path) = split_files(dir, split)?;
    let (idims, images) = read_idx(&images_path, 3)?;
    let (ldims, labels) = read_idx(&labels_path, 1)?;
    check_split(
        images_path,
        labels_path,
        &idims,
        &ldims,
        &labels,
        num_classes,
    )?;
    Ok(Dataset {
        images,
        labels,
        rows: idims[1],
        cols: idims[2],
    })
}

/// The images and labels files of a split.
fn split_files(dir: &Path, split: Split) -> Result<(PathBuf, PathBuf), IdxError> {
    let prefix = split.prefix();
    let images = find_file(
        dir,
        &format!("{prefix}-images-idx3-ubyte"),
        format!("{} images", split.name()),
    )?;
    let labels = find_file(
        dir,
        &format!("{prefix}-labels-idx1-ubyte"),
        format!("{} labels", split.name()),
    )?;
    Ok((images, labels))
}

/// Checks that a split's images are non-empty, that both files hold as many items, and that
/// every label is below `num_classes`.
fn check_split(
    images_path: PathBuf,
    labels_path: PathBuf,
    idims: &[usize],
    ldims: &[usize],
    labels: &[u8],
    num_classes: usize,
) -> Result<(), IdxError> {
    let (n, rows, cols) = (idims[0], idims[1], idims[2]);
    if rows == 0 || cols == 0 {
        return Err(IdxError::EmptyImages {
            path: images_path,
            rows,
            cols,
        });
    }
    if n != ldims[0] {
        return Err(IdxError::CountMismatch {
            images_path,
            labels_path,
            images: n,
            labels: ldims[0],
        });
    }
    if let Some((index, &label)) = labels
        .iter()
        .enumerate()
        .find(|&(_, &l)| usize::from(l) >= num_classes)
    {
        return Err(IdxError::LabelOutOfRange {
            path: labels_path,
            label,
            index,
            num_classes,
        });
    }
    Ok(())
}

/// Reads into `buf` until it is full or the stream ends; returns the bytes read.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// Lower level: read one IDX file (gzip detected by the 0x1f 0x8b magic, not by the extension) and return (dims, payload bytes) after checking the magic (must be unsigned byte type 0x08), that the dimension count matches `expected_dims`, and that the payload is exactly prod(dims) bytes (truncated or trailing data is an error saying which).
pub fn read_idx(path: &Path, expected_dims: usize) -> Result<(Vec<usize>, Vec<u8>), IdxError> {
    open_idx(path, expected_dims, false)
}

/// The dimensions in an IDX file's header, checked like [`read_idx`] does, without reading the
/// payload (whose length is therefore not verified).
pub fn read_idx_dims(path: &Path, expected_dims: usize) -> Result<Vec<usize>, IdxError> {
    open_idx(path, expected_dims, true).map(|(dims, _)| dims)
}

/// The number of samples and of features per sample of a split, reading the labels (small,
/// validated like [`load_split`]) and only the header of the images file: for processes that
/// need the data order but not the images (the shards).
pub fn split_shape(
    dir: &Path,
    split: Split,
    num_classes: usize,
) -> Result<(usize, usize), IdxError> {
    let (images_path, labels_path) = split_files(dir, split)?;
    let idims = read_idx_dims(&images_path, 3)?;
    let (ldims, labels) = read_idx(&labels_path, 1)?;
    check_split(
        images_path,
        labels_path,
        &idims,
        &ldims,
        &labels,
        num_classes,
    )?;
    Ok((idims[0], idims[1] * idims[2]))
}

fn open_idx(
    path: &Path,
    expected_dims: usize,
    header_only: bool,
) -> Result<(Vec<usize>, Vec<u8>), IdxError> {
    let file = File::open(path).map_err(|error| IdxError::Io {
        path: path.to_path_buf(),
        action: "open",
        error,
    })?;
    let mut reader = BufReader::with_capacity(READ_BUF_BYTES, file);
    let gzip = {
        let head = io::BufRead::fill_buf(&mut reader).map_err(|error| IdxError::Io {
            path: path.to_path_buf(),
            action: "read",
            error,
        })?;
        // A one-byte file cannot be gzip; it is reported as a truncated header below.
        head.starts_with(&[0x1f, 0x8b])
    };
    if gzip {
        read_idx_from(
            MultiGzDecoder::new(reader),
            path,
            true,
            expected_dims,
            header_only,
        )
    } else {
        read_idx_from(reader, path, false, expected_dims, header_only)
    }
}

fn read_idx_from(
    mut r: impl Read,
    path: &Path,
    gzip: bool,
    expected_dims: usize,
    header_only: bool,
) -> Result<(Vec<usize>, Vec<u8>), IdxError> {
    let (dims, expected) = read_header(&mut r, path, gzip, expected_dims)?;
    if header_only {
        return Ok((dims, Vec::new()));
    }
    let payload = read_payload(&mut r, path, gzip, &dims, expected)?;
    Ok((dims, payload))
}

/// The reading error of `path` (the gzip stream's, when `gzip`).
fn read_error(path: &Path, gzip: bool) -> impl Fn(io::Error) -> IdxError + '_ {
    move |error| {
        if gzip {
            IdxError::Gzip {
                path: path.to_path_buf(),
                error,
            }
        } else {
            IdxError::Io {
                path: path.to_path_buf(),
                action: "read",
                error,
            }
        }
    }
}

/// The header: the magic word (unsigned bytes, `expected_dims` dimensions), the dimensions,
/// and the payload's size in bytes, at most `MAX_PAYLOAD_BYTES`.
fn read_header(
    r: &mut impl Read,
    path: &Path,
    gzip: bool,
    expected_dims: usize,
) -> Result<(Vec<usize>, u64), IdxError> {
    let read_err = read_error(path, gzip);
    let header_len = 4 + 4 * expected_dims;
    let mut magic = [0u8; 4];
    let got = read_full(r, &mut magic).map_err(&read_err)?;
    if got < 4 {
        return Err(IdxError::TruncatedHeader {
            path: path.to_path_buf(),
            gzip,
            dims: expected_dims,
            expected: header_len,
            found: got,
        });
    }
    let magic_word = u32::from_be_bytes(magic);
    if magic[0] != 0 || magic[1] != 0 || magic[2] != IDX_TYPE_U8 {
        return Err(IdxError::BadMagic {
            path: path.to_path_buf(),
            found: magic_word,
            expected: magic_for(expected_dims),
        });
    }
    let found_dims = usize::from(magic[3]);
    if found_dims != expected_dims {
        return Err(IdxError::WrongDimensions {
            path: path.to_path_buf(),
            expected_dims,
            found_dims,
        });
    }
    let mut dim_bytes = vec![0u8; 4 * expected_dims];
    let got = read_full(r, &mut dim_bytes).map_err(&read_err)?;
    if got < dim_bytes.len() {
        return Err(IdxError::TruncatedHeader {
            path: path.to_path_buf(),
            gzip,
            dims: expected_dims,
            expected: header_len,
            found: 4 + got,
        });
    }
    let dims: Vec<usize> = dim_bytes
        .chunks_exact(4)
        .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]) as usize)
        .collect();
    let total = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64));
    match total {
        Some(t) if t <= MAX_PAYLOAD_BYTES => Ok((dims, t)),
        _ => Err(IdxError::TooLarge {
            path: path.to_path_buf(),
            dims,
            total,
        }),
    }
}

/// The payload of `expected` bytes after the header, and nothing after it.
fn read_payload(
    r: &mut impl Read,
    path: &Path,
    gzip: bool,
    dims: &[usize],
    expected: u64,
) -> Result<Vec<u8>, IdxError> {
    let read_err = read_error(path, gzip);
    let expected_usize = usize::try_from(expected).map_err(|_| IdxError::TooLarge {
        path: path.to_path_buf(),
        dims: dims.to_vec(),
        total: Some(expected),
    })?;
    let mut payload = Vec::new();
    payload
        .try_reserve_exact(expected_usize)
        .map_err(|e| IdxError::Io {
            path: path.to_path_buf(),
            action: "allocate the payload",
            error: io::Error::new(io::ErrorKind::OutOfMemory, e),
        })?;
    let got = r
        .by_ref()
        .take(expected)
        .read_to_end(&mut payload)
        .map_err(&read_err)? as u64;
    if got < expected {
        return Err(IdxError::Truncated {
            path: path.to_path_buf(),
            gzip,
            dims: dims.to_vec(),
            found: got,
        });
    }
    let extra = io::copy(r, &mut io::sink()).map_err(&read_err)?;
    if extra > 0 {
        return Err(IdxError::TrailingData {
            path: path.to_path_buf(),
            gzip,
            dims: dims.to_vec(),
            expected,
            found: expected + extra,
        });
    }
    Ok(payload)
}

#[cfg(test)]
mod tests;
