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
mod tests {
    use super::*;
    use flate2::Compression;
    use flate2::write::GzEncoder;
    use std::io::Write;

    fn mnist_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/mnist")
    }

    /// Builds an unsigned-byte IDX file with the given dims and payload.
    fn idx_bytes(dims: &[u32], payload: &[u8]) -> Vec<u8> {
        let mut v = vec![0, 0, IDX_TYPE_U8, dims.len() as u8];
        for d in dims {
            v.extend_from_slice(&d.to_be_bytes());
        }
        v.extend_from_slice(payload);
        v
    }

    fn gz(data: &[u8]) -> Vec<u8> {
        let mut e = GzEncoder::new(Vec::new(), Compression::default());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    fn write(dir: &Path, name: &str, data: &[u8]) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, data).unwrap();
        p
    }

    /// 3 images of 2x3 with distinct pixels, and their labels.
    fn small_images() -> (Vec<u8>, Vec<u8>) {
        let pixels: Vec<u8> = (0..18u8).map(|i| i * 15).collect();
        (idx_bytes(&[3, 2, 3], &pixels), idx_bytes(&[3], &[2, 0, 1]))
    }

    fn err_text<T: std::fmt::Debug>(r: Result<T, IdxError>) -> (IdxError, String) {
        let e = r.expect_err("expected an error");
        let s = e.to_string();
        (e, s)
    }

    fn histogram(d: &Dataset) -> [usize; 10] {
        let mut h = [0usize; 10];
        for &l in &d.labels {
            h[usize::from(l)] += 1;
        }
        h
    }

    #[test]
    fn split_shape_reads_labels_and_header_only() {
        assert_eq!(
            split_shape(&mnist_dir(), Split::Train, 10).unwrap(),
            (60000, 784)
        );
        assert_eq!(
            split_shape(&mnist_dir(), Split::Test, 10).unwrap(),
            (10000, 784)
        );
        let e = split_shape(&mnist_dir(), Split::Train, 5)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("train-labels") && e.contains("expected 0..=4"),
            "{e}"
        );
    }

    #[test]
    fn loads_real_mnist_train_and_test() {
        let dir = mnist_dir();
        let train = load_split(&dir, Split::Train, 10).unwrap();
        assert_eq!(train.len(), 60000);
        assert!(!train.is_empty());
        assert_eq!((train.rows, train.cols, train.features()), (28, 28, 784));
        assert_eq!(train.images.len(), 60000 * 784);
        assert_eq!(train.labels[..6], [5, 0, 4, 1, 9, 2]);
        let h = histogram(&train);
        assert_eq!(
            h,
            [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
        );
        assert_eq!(h.iter().sum::<usize>(), 60000);
        // Pixel sums cross-checked with Python's gzip module.
        let sum0: u64 = train.image(0).iter().map(|&p| u64::from(p)).sum();
        assert_eq!(sum0, 27525);
        let total: u64 = train.images.iter().map(|&p| u64::from(p)).sum();
        assert_eq!(total, 1_567_298_545);

        let test = load_split(&dir, Split::Test, 10).unwrap();
        assert_eq!(test.len(), 10000);
        assert_eq!((test.rows, test.cols), (28, 28));
        assert_eq!(test.labels[..5], [7, 2, 1, 0, 4]);
        let h = histogram(&test);
        assert_eq!(h, [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]);
        assert_eq!(h.iter().sum::<usize>(), 10000);
        let sum0: u64 = test.image(0).iter().map(|&p| u64::from(p)).sum();
        assert_eq!(sum0, 18454);
    }

    #[test]
    fn loads_fashion_mnist() {
        // shipped in the repository (data/fashion-mnist), so a fresh clone needs nothing beside it
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/fashion-mnist");
        let dir = &dir;
        let train = load_split(dir, Split::Train, 10).unwrap();
        assert_eq!((train.len(), train.rows, train.cols), (60000, 28, 28));
        assert_eq!(train.labels[..6], [9, 0, 0, 3, 0, 2]);
        assert_eq!(histogram(&train), [6000; 10]);
        let test = load_split(dir, Split::Test, 10).unwrap();
        assert_eq!((test.len(), test.rows, test.cols), (10000, 28, 28));
        assert_eq!(test.labels[..5], [9, 2, 1, 1, 6]);
        assert_eq!(histogram(&test), [1000; 10]);
    }

    #[test]
    fn raw_and_gzip_files_give_same_bytes() {
        let tmp = tempfile::tempdir().unwrap();
        let (images, _) = small_images();
        let raw = write(tmp.path(), "images-raw", &images);
        let gzp = write(tmp.path(), "images.gz", &gz(&images));
        // Detection is by content, not by extension.
        let gz_no_ext = write(tmp.path(), "images-compressed", &gz(&images));
        let raw_gz_ext = write(tmp.path(), "images-plain.gz", &images);

        let (dims, payload) = read_idx(&raw, 3).unwrap();
        assert_eq!(dims, [3, 2, 3]);
        assert_eq!(payload.len(), 18);
        assert_eq!(payload, (0..18u8).map(|i| i * 15).collect::<Vec<_>>());
        for p in [&gzp, &gz_no_ext, &raw_gz_ext] {
            let (d, b) = read_idx(p, 3).unwrap();
            assert_eq!(d, dims, "{}", p.display());
            assert_eq!(b, payload, "{}", p.display());
        }
    }

    #[test]
    fn gzip_with_concatenated_members_is_read_whole() {
        let tmp = tempfile::tempdir().unwrap();
        let (images, _) = small_images();
        let mut two = gz(&images[..10]);
        two.extend_from_slice(&gz(&images[10..]));
        let p = write(tmp.path(), "multi.gz", &two);
        let (dims, payload) = read_idx(&p, 3).unwrap();
        assert_eq!(dims, [3, 2, 3]);
        assert_eq!(payload, images[16..]);
    }

    #[test]
    fn load_split_prefers_raw_and_accepts_gzip() {
        let tmp = tempfile::tempdir().unwrap();
        let (images, labels) = small_images();
        // Raw train images, gzip-only train labels; a different gzip image file that must be ignored.
        write(tmp.path(), "train-images-idx3-ubyte", &images);
        write(
            tmp.path(),
            "train-images-idx3-ubyte.gz",
            &gz(&idx_bytes(&[1, 1, 1], &[7])),
        );
        write(tmp.path(), "train-labels-idx1-ubyte.gz", &gz(&labels));
        let d = load_split(tmp.path(), Split::Train, 3).unwrap();
        assert_eq!((d.len(), d.rows, d.cols, d.features()), (3, 2, 3, 6));
        assert_eq!(d.labels, [2, 0, 1]);
        assert_eq!(d.image(1), &[90, 105, 120, 135, 150, 165]);
        // Test split uses the "t10k" prefix.
        write(tmp.path(), "t10k-images-idx3-ubyte.gz", &gz(&images));
        write(tmp.path(), "t10k-labels-idx1-ubyte", &labels);
        let t = load_split(tmp.path(), Split::Test, 3).unwrap();
        assert_eq!(t.images, d.images);
        assert_eq!(t.labels, d.labels);
    }

    #[test]
    fn truncated_image_payload_is_error() {
        let tmp = tempfile::tempdir().unwrap();
        let (images, _) = small_images();
        let cut = &images[..images.len() - 5]; // 13 of 18 pixel bytes
        for (name, data, word) in [
            ("short-raw", cut.to_vec(), "the file holds"),
            ("short.gz", gz(cut), "the decompressed file holds"),
        ] {
            let p = write(tmp.path(), name, &data);
            let (e, s) = err_text(read_idx(&p, 3));
            assert!(matches!(e, IdxError::Truncated { found: 13, .. }), "{s}");
            assert_eq!(
                s,
                format!(
                    "{}: truncated: header says 3 images of 2x3 (18 bytes of pixels) but {word} 13 bytes after the header",
                    p.display()
                )
            );
        }
        // The real MNIST header with only a few pixel bytes.
        let mut hdr = idx_bytes(&[60000, 28, 28], &[]);
        hdr.extend_from_slice(&[0u8; 1234]);
        let p = write(tmp.path(), "train-images-idx3-ubyte", &hdr);
        let (_, s) = err_text(read_idx(&p, 3));
        assert!(
            s.ends_with(
                "train-images-idx3-ubyte: truncated: header says 60000 images of 28x28 (47040000 bytes of pixels) but the file holds 1234 bytes after the header"
            ),
            "{s}"
        );
        // A labels file cut short.
        let p = write(tmp.path(), "labels", &idx_bytes(&[5], &[1, 2]));
        let (_, s) = err_text(read_idx(&p, 1));
        assert!(
            s.contains("labels: truncated: header says 5 labels (5 bytes) but the file holds 2 bytes after the header"),
            "{s}"
        );
    }

    #[test]
    fn truncated_header_is_error() {
        let tmp = tempfile::tempdir().unwrap();
        let p = write(tmp.path(), "empty", &[]);
        let (e, s) = err_text(read_idx(&p, 3));
        assert!(matches!(e, IdxError::TruncatedHeader { found: 0, .. }));
        assert!(
            s.contains("empty: truncated header: expected 16 bytes"),
            "{s}"
        );
        assert!(s.ends_with("but the file holds only 0 bytes"), "{s}");
        let p = write(tmp.path(), "half", &idx_bytes(&[3, 2, 3], &[])[..10]);
        let (_, s) = err_text(read_idx(&p, 3));
        assert!(
            s.contains("half: truncated header: expected 16 bytes (magic number and 3 dimension sizes) but the file holds only 10 bytes"),
            "{s}"
        );
    }

    #[test]
    fn truncated_gzip_stream_is_error() {
        let tmp = tempfile::tempdir().unwrap();
        // Enough incompressible-ish data that the deflate stream is long.
        let pixels: Vec<u8> = (0..30_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
            .collect();
        let full = gz(&idx_bytes(&[30, 1000, 1], &pixels));
        // Cut inside the deflate data, and cut only the 8-byte gzip trailer (CRC32 + size).
        for (name, keep) in [("mid.gz", full.len() / 2), ("notrailer.gz", full.len() - 8)] {
            let p = write(tmp.path(), name, &full[..keep]);
            let (e, s) = err_text(read_idx(&p, 3));
            assert!(matches!(e, IdxError::Gzip { .. }), "{s}");
            assert!(
                s.starts_with(&format!(
                    "{}: corrupt or truncated gzip stream",
                    p.display()
                )),
                "{s}"
            );
        }
        // Corrupted (not truncated) deflate data is reported the same way.
        let mut bad = full.clone();
        let n = bad.len();
        bad[n - 8] ^= 0xff; // CRC mismatch
        let p = write(tmp.path(), "badcrc.gz", &bad);
        let (e, s) = err_text(read_idx(&p, 3));
        assert!(matches!(e, IdxError::Gzip { .. }), "{s}");
        assert!(
            s.contains("badcrc.gz: corrupt or truncated gzip stream"),
            "{s}"
        );
    }

    #[test]
    fn bad_magic_is_error() {
        let tmp = tempfile::tempdir().unwrap();
        let mut f32_file = idx_bytes(&[1, 1, 1], &[0, 0, 0, 0]);
        f32_file[2] = 0x0d; // f32 type
        let p = write(tmp.path(), "floats", &f32_file);
        let (e, s) = err_text(read_idx(&p, 3));
        assert!(matches!(
            e,
            IdxError::BadMagic {
                found: 0x0d03,
                expected: 0x0803,
                ..
            }
        ));
        assert_eq!(
            s,
            format!(
                "{}: bad magic number 0x00000d03: expected 0x00000803 (IDX unsigned-byte (type 0x08), 3 dimensions), found IDX f32 (type 0x0d), 3 dimensions",
                p.display()
            )
        );
        let p = write(tmp.path(), "text.txt", b"hello world, not idx");
        let (_, s) = err_text(read_idx(&p, 1));
        assert!(
            s.contains("text.txt: bad magic number 0x68656c6c: expected 0x00000801 (IDX unsigned-byte (type 0x08), 1 dimension), found not an IDX file"),
            "{s}"
        );
    }

    #[test]
    fn wrong_dimension_count_is_error() {
        let tmp = tempfile::tempdir().unwrap();
        // A labels file (1 dim) given where images (3 dims) are expected.
        let (_, labels) = small_images();
        let p = write(tmp.path(), "labels-as-images", &labels);
        let (e, s) = err_text(read_idx(&p, 3));
        assert!(matches!(
            e,
            IdxError::WrongDimensions {
                expected_dims: 3,
                found_dims: 1,
                ..
            }
        ));
        assert_eq!(
            s,
            format!(
                "{}: bad magic number 0x00000801: expected 0x00000803 (IDX unsigned-byte (type 0x08), 3 dimensions), found 1 dimension",
                p.display()
            )
        );
        let p = write(
            tmp.path(),
            "two-dims.gz",
            &gz(&idx_bytes(&[2, 2], &[1, 2, 3, 4])),
        );
        let (_, s) = err_text(read_idx(&p, 3));
        assert!(
            s.contains("two-dims.gz: bad magic number 0x00000802: expected 0x00000803"),
            "{s}"
        );
        assert!(s.ends_with("found 2 dimensions"), "{s}");
    }

    #[test]
    fn trailing_bytes_is_error() {
        let tmp = tempfile::tempdir().unwrap();
        let (mut images, _) = small_images();
        images.extend_from_slice(&[9, 9, 9]);
        for (name, data, word) in [
            ("long-raw", images.clone(), "the file holds"),
            ("long.gz", gz(&images), "the decompressed file holds"),
        ] {
            let p = write(tmp.path(), name, &data);
            let (e, s) = err_text(read_idx(&p, 3));
            assert!(
                matches!(
                    e,
                    IdxError::TrailingData {
                        expected: 18,
                        found: 21,
                        ..
                    }
                ),
                "{s}"
            );
            assert_eq!(
                s,
                format!(
                    "{}: trailing data: header says 3 images of 2x3 (18 bytes of pixels) but {word} 21 bytes after the header (3 extra)",
                    p.display()
                )
            );
        }
    }

    #[test]
    fn huge_header_is_rejected_without_allocating() {
        let tmp = tempfile::tempdir().unwrap();
        let p = write(
            tmp.path(),
            "huge",
            &idx_bytes(&[u32::MAX, u32::MAX, u32::MAX], &[1, 2, 3]),
        );
        let (e, s) = err_text(read_idx(&p, 3));
        assert!(matches!(e, IdxError::TooLarge { total: None, .. }), "{s}");
        assert!(
            s.contains("huge: header dimensions 4294967295x4294967295x4294967295 describe more than 2^64 bytes: expected at most 17179869184 bytes"),
            "{s}"
        );
        // Does not overflow, but is over the 1<<34 limit.
        let p = write(
            tmp.path(),
            "big",
            &idx_bytes(&[1 << 20, 1 << 10, 1 << 5], &[]),
        );
        let (e, s) = err_text(read_idx(&p, 3));
        assert!(
            matches!(e, IdxError::TooLarge { total: Some(t), .. } if t == 1 << 35),
            "{s}"
        );
        assert!(
            s.contains("big: header dimensions 1048576x1024x32 describe 34359738368 bytes"),
            "{s}"
        );
        // Exactly at the limit is accepted by the size check and then fails as truncated.
        let p = write(
            tmp.path(),
            "limit",
            &idx_bytes(&[1 << 24, 1 << 5, 1 << 5], &[]),
        );
        let (e, _) = err_text(read_idx(&p, 3));
        assert!(matches!(e, IdxError::Truncated { found: 0, .. }));
    }

    #[test]
    fn count_mismatch_is_error() {
        let tmp = tempfile::tempdir().unwrap();
        let (images, _) = small_images();
        write(tmp.path(), "train-images-idx3-ubyte", &images);
        write(
            tmp.path(),
            "train-labels-idx1-ubyte",
            &idx_bytes(&[2], &[0, 1]),
        );
        let (e, s) = err_text(load_split(tmp.path(), Split::Train, 10));
        assert!(matches!(
            e,
            IdxError::CountMismatch {
                images: 3,
                labels: 2,
                ..
            }
        ));
        assert!(
            s.starts_with("images file has 3 items but labels file has 2: "),
            "{s}"
        );
        assert!(s.contains("train-images-idx3-ubyte vs "), "{s}");
        assert!(s.ends_with("train-labels-idx1-ubyte"), "{s}");
    }

    #[test]
    fn label_out_of_range_is_error() {
        let tmp = tempfile::tempdir().unwrap();
        let pixels = vec![0u8; 7 * 4];
        write(
            tmp.path(),
            "t10k-images-idx3-ubyte",
            &idx_bytes(&[7, 2, 2], &pixels),
        );
        write(
            tmp.path(),
            "t10k-labels-idx1-ubyte.gz",
            &gz(&idx_bytes(&[7], &[0, 9, 3, 4, 2, 11, 12])),
        );
        let (e, s) = err_text(load_split(tmp.path(), Split::Test, 10));
        assert!(matches!(
            e,
            IdxError::LabelOutOfRange {
                label: 11,
                index: 5,
                num_classes: 10,
                ..
            }
        ));
        assert!(
            s.ends_with(
                "t10k-labels-idx1-ubyte.gz: label 11 at index 5 is out of range: expected 0..=9"
            ),
            "{s}"
        );
        // With 13 classes everything is in range.
        let d = load_split(tmp.path(), Split::Test, 13).unwrap();
        assert_eq!(d.len(), 7);
        // With 0 classes even label 0 is out of range.
        let (_, s) = err_text(load_split(tmp.path(), Split::Test, 0));
        assert!(
            s.ends_with(
                "label 0 at index 0 is out of range: expected no labels at all (num_classes is 0)"
            ),
            "{s}"
        );
    }

    #[test]
    fn missing_files_are_errors() {
        let tmp = tempfile::tempdir().unwrap();
        let (e, s) = err_text(load_split(tmp.path(), Split::Train, 10));
        assert!(matches!(e, IdxError::MissingFile { .. }));
        assert_eq!(
            s,
            format!(
                "{}/: no train images: expected train-images-idx3-ubyte or train-images-idx3-ubyte.gz",
                tmp.path().display()
            )
        );
        let (images, _) = small_images();
        write(tmp.path(), "t10k-images-idx3-ubyte.gz", &gz(&images));
        let (_, s) = err_text(load_split(tmp.path(), Split::Test, 10));
        assert!(
            s.ends_with(
                "/: no test labels: expected t10k-labels-idx1-ubyte or t10k-labels-idx1-ubyte.gz"
            ),
            "{s}"
        );
        // read_idx on a missing path keeps the path and the io error.
        let p = tmp.path().join("nope");
        let (e, s) = err_text(read_idx(&p, 1));
        assert!(matches!(
            &e,
            IdxError::Io { action: "open", error, .. } if error.kind() == io::ErrorKind::NotFound
        ));
        assert!(
            s.starts_with(&format!("{}: cannot open: ", p.display())),
            "{s}"
        );
    }

    #[test]
    fn zero_sized_images_are_rejected() {
        let tmp = tempfile::tempdir().unwrap();
        write(
            tmp.path(),
            "train-images-idx3-ubyte",
            &idx_bytes(&[4, 0, 28], &[]),
        );
        write(
            tmp.path(),
            "train-labels-idx1-ubyte",
            &idx_bytes(&[4], &[0; 4]),
        );
        let (_, s) = err_text(load_split(tmp.path(), Split::Train, 10));
        assert!(
            s.ends_with("train-images-idx3-ubyte: images are 0x28: expected at least 1x1 pixels"),
            "{s}"
        );
    }

    #[test]
    fn gather_converts_to_unit_range_and_picks_rows() {
        let d = Dataset {
            images: (0..18u8).map(|i| i * 15).collect(),
            labels: vec![2, 0, 1],
            rows: 2,
            cols: 3,
        };
        let mut out = vec![123.0f32; 50]; // stale contents must go
        let mut labels = vec![7u8; 9];
        d.gather(&[2, 0, 2], &mut out, &mut labels);
        assert_eq!(out.len(), 3 * 6);
        assert_eq!(labels, [1, 2, 1]);
        let expect =
            |i: usize| -> Vec<f32> { (0..6).map(|j| ((i * 6 + j) * 15) as f32 / 255.0).collect() };
        assert_eq!(out[0..6], expect(2)[..]);
        assert_eq!(out[6..12], expect(0)[..]);
        assert_eq!(out[12..18], expect(2)[..]);
        assert_eq!(out[0], 180.0 / 255.0);
        assert_eq!(out[6], 0.0);
        assert_eq!(out[17], 1.0); // pixel 255
        d.gather(&[], &mut out, &mut labels);
        assert!(out.is_empty() && labels.is_empty());

        // On real data: the first MNIST test image, row 14 starts with zeros then ink.
        let test = load_split(&mnist_dir(), Split::Test, 10).unwrap();
        d.gather(&[], &mut out, &mut labels);
        test.gather(&[1, 0], &mut out, &mut labels);
        assert_eq!(labels, [2, 7]);
        assert_eq!(out.len(), 2 * 784);
        let first = &out[784..];
        let sum: f32 = first.iter().sum();
        assert!((sum - 18454.0 / 255.0).abs() < 1e-2, "{sum}");
        assert_eq!(first[14 * 28 + 16], 59.0 / 255.0); // 0x3b
        assert_eq!(first[14 * 28 + 17], 249.0 / 255.0); // 0xf9
        assert!(first.iter().all(|&x| (0.0..=1.0).contains(&x)));
    }
}
