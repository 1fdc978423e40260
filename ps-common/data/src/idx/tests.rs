//! Tests of the IDX reader: real MNIST and Fashion-MNIST loads, raw and gzip files, and the precise error of each malformed file.

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
