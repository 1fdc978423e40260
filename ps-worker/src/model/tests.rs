//! Tests of the models on the CPU device: the path of a GPU (a CPU device that cannot write
//! host memory) bit for bit against the host path, for the MLP and the CNN; the gated pull's
//! piece-by-piece uploads; the split step; length checks; the CNN's gradient against finite
//! differences.

use super::*;
use crate::cpu::{CpuBackend, CpuDevice};
use crate::ops::{Mat, Strides};
use ps_model::layout::{CnnShape, ModelSpec};
use std::ops::Range;

/// The CPU device, but claiming it cannot write host memory: an [`Mlp`] on it takes the
/// path of a GPU (device gradient buffer, downloads layer by layer), so that path is
/// checked here, bit for bit against the host path, on a machine without a GPU.
#[derive(Debug)]
/// (The third field: the memory of [`Device::staging`], counted uploads from it.)
struct Hostless(
    CpuDevice,
    std::collections::HashMap<usize, Vec<f32>>,
    (Vec<f32>, usize),
);

fn hostless() -> Hostless {
    Hostless(CpuDevice::new(1), Default::default(), Default::default())
}

impl Device for Hostless {
    type Buf = Vec<f32>;
    type View<'a> = &'a [f32];
    type ViewMut<'a> = &'a mut [f32];

    fn name(&self) -> String {
        format!("hostless {}", self.0.name())
    }
    fn alloc(&mut self, len: usize) -> BackendResult<Vec<f32>> {
        // garbage rather than zeros, so that a value read before it is written shows up
        Ok(vec![f32::NAN; len])
    }
    fn view(buf: &Vec<f32>, r: Range<usize>) -> &[f32] {
        &buf[r]
    }
    fn view_mut(buf: &mut Vec<f32>, r: Range<usize>) -> &mut [f32] {
        &mut buf[r]
    }
    fn sub_mut<'a, 'b: 'a>(v: &'a mut &'b mut [f32], r: Range<usize>) -> &'a mut [f32] {
        &mut v[r]
    }
    fn sub<'a, 'b: 'a>(v: &'a &'b mut [f32], r: Range<usize>) -> &'a [f32] {
        &v[r]
    }
    fn start_download(&mut self, src: &[f32], slot: usize) -> BackendResult<()> {
        self.1.insert(slot, src.to_vec());
        Ok(())
    }
    fn finish_download(&mut self, slot: usize, dst: &mut [f32]) -> BackendResult<()> {
        let src = self
            .1
            .get(&slot)
            .expect("a download was started in this slot");
        dst.copy_from_slice(src);
        Ok(())
    }
    fn im2col(
        &mut self,
        x: &[f32],
        cols: &mut [f32],
        n: usize,
        g: crate::ops::ConvGeom,
    ) -> BackendResult<()> {
        self.0.im2col(x, cols, n, g)
    }
    fn col2im(
        &mut self,
        cols: &[f32],
        dx: &mut [f32],
        n: usize,
        g: crate::ops::ConvGeom,
    ) -> BackendResult<()> {
        self.0.col2im(cols, dx, n, g)
    }
    fn maxpool2(
        &mut self,
        x: &[f32],
        y: &mut [f32],
        arg: &mut [f32],
        planes: usize,
        h: usize,
        w: usize,
    ) -> BackendResult<()> {
        self.0.maxpool2(x, y, arg, planes, h, w)
    }
    fn maxpool2_backward(
        &mut self,
        dy: &[f32],
        arg: &[f32],
        dx: &mut [f32],
        planes: usize,
        h: usize,
        w: usize,
    ) -> BackendResult<()> {
        self.0.maxpool2_backward(dy, arg, dx, planes, h, w)
    }
    fn host_view_mut(_: &mut [f32]) -> Option<&mut [f32]> {
        None
    }
    fn host_of<'a>(_: &'a &mut [f32]) -> Option<&'a [f32]> {
        None
    }
    fn host_buf(_: &mut Vec<f32>) -> Option<&mut [f32]> {
        None
    }
    fn staging(&mut self, len: usize) -> BackendResult<Option<*mut f32>> {
        // garbage, like `alloc`, so that an upload of unpublished values shows up
        self.2.0 = vec![f32::NAN; len];
        Ok(Some(self.2.0.as_mut_ptr()))
    }
    fn upload(&mut self, src: &[f32], dst: &mut [f32]) -> BackendResult<()> {
        let s = self.2.0.as_ptr_range();
        if s.contains(&src.as_ptr()) {
            self.2.1 += 1;
        }
        self.0.upload(src, dst)
    }
    fn download(&mut self, src: &[f32], dst: &mut [f32]) -> BackendResult<()> {
        self.0.download(src, dst)
    }
    fn fill_zero(&mut self, v: &mut [f32]) -> BackendResult<()> {
        self.0.fill_zero(v)
    }
    fn sync(&mut self) -> BackendResult<()> {
        self.0.sync()
    }
    fn gemm(&mut self, a: Mat<&[f32]>, b: Mat<&[f32]>, c: &mut [f32]) -> BackendResult<()> {
        self.0.gemm(a, b, c)
    }
    fn bias_act(
        &mut self,
        z: &mut [f32],
        bias: &[f32],
        rows: usize,
        cols: usize,
        relu: bool,
    ) -> BackendResult<()> {
        self.0.bias_act(z, bias, rows, cols, relu)
    }
    fn gemm_acc(&mut self, a: Mat<&[f32]>, b: Mat<&[f32]>, c: &mut [f32]) -> BackendResult<()> {
        self.0.gemm_acc(a, b, c)
    }
    fn gemm_batched(
        &mut self,
        a: Mat<&[f32]>,
        b: Mat<&[f32]>,
        c: &mut [f32],
        s: Strides,
    ) -> BackendResult<()> {
        self.0.gemm_batched(a, b, c, s)
    }
    fn gemm_batched_sum(
        &mut self,
        a: Mat<&[f32]>,
        b: Mat<&[f32]>,
        c: &mut [f32],
        s: Strides,
    ) -> BackendResult<()> {
        self.0.gemm_batched_sum(a, b, c, s)
    }
    fn channel_bias_act(
        &mut self,
        z: &mut [f32],
        bias: &[f32],
        n: usize,
        channels: usize,
        plane: usize,
        relu: bool,
    ) -> BackendResult<()> {
        self.0.channel_bias_act(z, bias, n, channels, plane, relu)
    }
    fn channel_bias_grad(
        &mut self,
        dz: &[f32],
        n: usize,
        channels: usize,
        plane: usize,
        out: &mut [f32],
    ) -> BackendResult<()> {
        self.0.channel_bias_grad(dz, n, channels, plane, out)
    }
    fn relu_backward(&mut self, d: &mut [f32], act: &[f32]) -> BackendResult<()> {
        self.0.relu_backward(d, act)
    }
    fn softmax_xent(
        &mut self,
        logits: &mut [f32],
        labels: &[u8],
        cols: usize,
        scale: f32,
    ) -> BackendResult<()> {
        self.0.softmax_xent(logits, labels, cols, scale)
    }
    fn stats(&mut self) -> BackendResult<StepStats> {
        self.0.stats()
    }
    fn bias_grad(
        &mut self,
        dz: &[f32],
        rows: usize,
        cols: usize,
        out: &mut [f32],
    ) -> BackendResult<()> {
        self.0.bias_grad(dz, rows, cols, out)
    }
    fn count_correct(&mut self, logits: &[f32], labels: &[u8], cols: usize) -> BackendResult<u64> {
        self.0.count_correct(logits, labels, cols)
    }
    fn eval_rows(&self) -> usize {
        7 // several chunks even for small test sets
    }
}

fn batch(layout: &ModelLayout, n: usize, seed: usize) -> (Vec<f32>, Vec<u8>) {
    let x = (0..n * layout.inputs())
        .map(|i| (((i * 37 + seed * 11) % 23) as f32 - 11.0) / 7.0)
        .collect();
    let classes = layout.classes();
    let y = (0..n).map(|i| ((i * 5 + seed) % classes) as u8).collect();
    (x, y)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

/// A range handed on by the overlapped step: its start and its values then.
type Handed = (usize, Vec<f32>);

/// Runs a step with the overlapped API and checks each handed-on range is final.
fn step(
    b: &mut dyn Backend,
    layout: &ModelSpec,
    x: &[f32],
    y: &[u8],
    reduction: LossReduction,
) -> (StepStats, Vec<f32>, Vec<Handed>) {
    let mut g = vec![f32::NAN; layout.num_params()];
    let mut seen = Vec::new();
    let s = b
        .forward_backward_overlapped(x, y, reduction, &mut g, &mut |start, tail, st| {
            seen.push((start, tail.to_vec()));
            assert!(st.loss_sum > 0.0 || y.is_empty());
        })
        .unwrap();
    for (start, tail) in &seen {
        assert_eq!(
            bits(tail),
            bits(&g[*start..]),
            "range from {start} not final"
        );
    }
    (s, g, seen)
}

/// On a device with its own memory a gated pull writes the device's staging memory, and
/// the forward pass uploads each piece as soon as it is published (a big layer in several
/// pieces, none across a layer's end): with the last shard arriving slowly, the gradient
/// is that of `set_weights`, bit for bit, step after step; a pull that fails midway stops
/// the step before anything is handed on.
#[test]
fn a_gated_pull_on_a_device_uploads_each_piece_as_it_arrives() {
    use crate::gate::GateError;
    use ps_net::sink::PullSink;
    use std::time::Duration;
    // fc1 holds 1,101,000 values: more than one upload piece
    let layout = MlpLayout::new(&[1100, 1000, 3]);
    let p = layout.num_params();
    let w = layout.init_range(5, 0..p);
    let (x, y) = batch(&layout.clone().into(), 2, 1);
    let mut want = vec![0f32; p];
    let mut host = CpuBackend::new(layout.clone(), 1);
    host.set_weights(&w).unwrap();
    host.forward_backward(&x, &y, LossReduction::Mean, &mut want)
        .unwrap();

    let mut dev = Mlp::on(layout.clone(), hostless()).unwrap();
    // the previous version's weights on the device: all different
    let old: Vec<f32> = w.iter().map(|v| v * 3.0 + 1.0).collect();
    dev.set_weights(&old).unwrap();
    let shards = vec![0..p / 3, p / 3..p];
    let pieces: usize = dev
        .layers()
        .iter()
        .map(|l| l.len().div_ceil(UPLOAD_PIECE))
        .sum();
    assert!(pieces > dev.layers().len(), "no layer split into pieces");
    for step in 1..=3u64 {
        let gate = dev
            .open_gate(step, shards.clone(), Duration::from_secs(30))
            .expect("a device with staging memory opens a gate");
        let mut got = vec![0f32; p];
        let mut handed = 0;
        let result = std::thread::scope(|s| {
            for (i, pause) in [(0, 0), (1, 200)] {
                let (g, w, at) = (&gate, &w, shards[i].start);
                s.spawn(move || {
                    if step == 3 && i == 1 {
                        // one piece, then the pull breaks
                        let mut wr = g.writer(i);
                        wr.next(50_000).copy_from_slice(&w[at..at + 50_000]);
                        wr.publish(50_000);
                        g.fail(1, "shard 1: connection reset".into());
                    } else {
                        g.deliver(i, w, 50_000, Duration::from_micros(pause));
                    }
                });
            }
            dev.forward_backward_overlapped(
                &x,
                &y,
                LossReduction::Mean,
                &mut got,
                &mut |_, _, _| handed += 1,
            )
        });
        dev.close_gate();
        if step < 3 {
            result.unwrap();
            assert_eq!(bits(&got), bits(&want), "step {step}");
            assert_eq!(dev.device().2.1, pieces * step as usize, "step {step}");
        } else {
            let err = result.unwrap_err();
            assert!(
                matches!(
                    &err,
                    BackendError::Gate(GateError::PullFailed { shard: 1, .. })
                ),
                "{err}"
            );
            assert_eq!(handed, 0, "a gradient was handed on after a failed pull");
        }
    }
}

/// The device path (gradient buffer on the device, downloaded layer by layer) gives the
/// same bits as the host path, over growing and shrinking batches, both reductions, with
/// the same ranges handed on in the same order; evaluation in chunks agrees too.
#[test]
fn device_path_equals_host_path() {
    let layout = MlpLayout::new(&[6, 9, 5, 4]);
    let w = layout.init_range(3, 0..layout.num_params());
    let mut host = CpuBackend::new(layout.clone(), 1);
    let mut dev = Mlp::on(layout.clone(), hostless()).unwrap();
    assert!(dev.host_weights().is_none() && host.host_weights().is_some());
    host.set_weights(&w).unwrap();
    dev.set_weights(&w).unwrap();
    let starts: Vec<usize> = (0..3).rev().map(|l| layout.layer(l).0.start).collect();
    for (i, n) in [5usize, 40, 1, 17, 0, 3].into_iter().enumerate() {
        let (x, y) = batch(&layout.clone().into(), n, i);
        for reduction in [LossReduction::Mean, LossReduction::Sum] {
            let (sh, gh, seen_h) = step(&mut host, &layout, &x, &y, reduction);
            let (sd, gd, seen_d) = step(&mut dev, &layout, &x, &y, reduction);
            assert_eq!(sh, sd, "batch {n} {reduction}");
            assert_eq!(bits(&gh), bits(&gd), "batch {n} {reduction}");
            let s: Vec<usize> = seen_d.iter().map(|(s, _)| *s).collect();
            if n == 0 {
                assert_eq!(s, [0]);
                assert!(gd.iter().all(|&v| v == 0.0));
            } else {
                assert_eq!(s, starts, "device path hands on one range per layer");
                assert_eq!(seen_h.len(), 3);
            }
        }
        assert_eq!(dev.capacity_rows(), if i == 0 { 5 } else { 40 });
    }
    let (x, y) = batch(&layout.clone().into(), 30, 9);
    let want = host.evaluate(&x, &y).unwrap();
    assert_eq!(dev.evaluate(&x, &y).unwrap(), want);
    assert!(want > 0);
    assert_eq!(dev.logits(&x).unwrap(), host.logits(&x).unwrap());
}

/// `upload_batch` + `compute_uploaded` + `download_gradient` is `forward_backward`, on both
/// paths; `gemm_only` runs; misuse is a typed error.
#[test]
fn split_step_equals_forward_backward() {
    let layout = MlpLayout::new(&[6, 9, 4]);
    let w = layout.init_range(5, 0..layout.num_params());
    let (x, y) = batch(&layout.clone().into(), 12, 1);
    let p = layout.num_params();
    let mut want = vec![0.0; p];
    let mut host = CpuBackend::new(layout.clone(), 1);
    host.set_weights(&w).unwrap();
    let s = host
        .forward_backward(&x, &y, LossReduction::Mean, &mut want)
        .unwrap();
    let mut dev = Mlp::on(layout.clone(), hostless()).unwrap();
    dev.set_weights(&w).unwrap();
    let mut g = vec![0.0; p];
    let e = dev.download_gradient(&mut g).unwrap_err();
    assert!(e.to_string().contains("compute_uploaded first"), "{e}");
    for b in [&mut host as &mut dyn SplitStep, &mut dev] {
        b.upload(&x, &y).unwrap();
        assert_eq!(b.compute(LossReduction::Mean).unwrap(), s);
        let mut g = vec![f32::NAN; p];
        b.download(&mut g).unwrap();
        assert_eq!(bits(&g), bits(&want));
        b.gemms(12).unwrap();
        b.gemms(3).unwrap();
        // the staged batch is still there after the products
        assert_eq!(b.compute(LossReduction::Mean).unwrap(), s);
        b.download(&mut g).unwrap();
        assert_eq!(bits(&g), bits(&want));
        // an empty batch zeroes the gradient
        b.upload(&[], &[]).unwrap();
        assert_eq!(b.compute(LossReduction::Sum).unwrap(), StepStats::default());
        b.download(&mut g).unwrap();
        assert!(g.iter().all(|&v| v == 0.0));
        assert!(matches!(
            b.download(&mut [0.0; 3]).unwrap_err(),
            BackendError::Shape(_)
        ));
        assert!(matches!(
            b.upload(&x[1..], &y).unwrap_err(),
            BackendError::Shape(_)
        ));
    }
}

/// The split API of both devices, as one object type.
trait SplitStep {
    fn upload(&mut self, x: &[f32], y: &[u8]) -> BackendResult<()>;
    fn compute(&mut self, r: LossReduction) -> BackendResult<StepStats>;
    fn download(&mut self, g: &mut [f32]) -> BackendResult<()>;
    fn gemms(&mut self, rows: usize) -> BackendResult<()>;
}

impl<D: Device> SplitStep for Mlp<D> {
    fn upload(&mut self, x: &[f32], y: &[u8]) -> BackendResult<()> {
        self.upload_batch(x, y)
    }
    fn compute(&mut self, r: LossReduction) -> BackendResult<StepStats> {
        self.compute_uploaded(r)
    }
    fn download(&mut self, g: &mut [f32]) -> BackendResult<()> {
        self.download_gradient(g)
    }
    fn gemms(&mut self, rows: usize) -> BackendResult<()> {
        self.gemm_only(rows)?;
        self.sync()
    }
}

/// A device operation given views of the wrong length refuses them.
#[test]
fn device_operations_check_lengths() {
    let mut d = CpuDevice::new(1);
    let mut z = vec![0.0; 6];
    assert!(d.bias_act(&mut z, &[0.0; 3], 2, 3, true).is_ok());
    assert!(d.bias_act(&mut z, &[0.0; 2], 2, 3, true).is_err());
    assert!(d.bias_act(&mut z, &[0.0; 3], 3, 3, true).is_err());
    assert!(d.relu_backward(&mut z, &[0.0; 5]).is_err());
    let e = d.softmax_xent(&mut z, &[0, 3], 3, 1.0).unwrap_err();
    assert_eq!(e.to_string(), "shape: label 3: expected < 3");
    assert!(d.softmax_xent(&mut z, &[0], 3, 1.0).is_err());
    assert!(d.bias_grad(&z, 2, 3, &mut [0.0; 2]).is_err());
    assert!(d.count_correct(&z, &[0, 1, 2], 3).is_err());
    assert!(d.upload(&[1.0; 2], &mut z).is_err());
    assert!(d.download(&z, &mut [0.0; 2]).is_err());
    // the statistics are those of the last softmax cross-entropy, not of a count
    let mut logits = vec![0.0, 1.0, 0.0, 2.0, 0.0, 0.0];
    d.softmax_xent(&mut logits, &[1, 1], 3, 1.0).unwrap();
    let s = d.stats().unwrap();
    assert_eq!(s.correct, 1);
    assert_eq!(d.count_correct(&[5.0, 0.0, 0.0], &[0], 3).unwrap(), 1);
    assert_eq!(d.stats().unwrap(), s);
}

/// A CNN small enough for finite differences: 2 x 8 x 8 images, 3 x 3 kernels with padding
/// 1, channels 3 and 4, a hidden linear layer of 5, 3 classes.
fn small_cnn() -> CnnLayout {
    CnnLayout::new(CnnShape {
        image: [2, 8, 8],
        channels: vec![3, 4],
        kernel: 3,
        stride: 1,
        padding: 1,
        hidden: vec![5],
        classes: 3,
    })
    .unwrap()
}

/// Loss of the whole batch in f64 from the model's logits, for finite differences.
fn loss_f64(b: &mut dyn Logits, x: &[f32], labels: &[u8], classes: usize) -> f64 {
    let logits = b.logits_of(x);
    let mut total = 0.0;
    for (row, &y) in logits.chunks(classes).zip(labels) {
        let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        let lse = row.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln() + m;
        total += lse - row[usize::from(y)] as f64;
    }
    total
}

trait Logits: Backend {
    fn logits_of(&mut self, x: &[f32]) -> Vec<f32>;
}
impl<D: Device, N: Net<D>> Logits for Model<D, N> {
    fn logits_of(&mut self, x: &[f32]) -> Vec<f32> {
        self.logits(x).unwrap()
    }
}

/// The CNN's gradient (convolutions, per-channel bias, pooling, head) is the derivative of
/// its loss: central differences of every parameter agree, for a stride-1 padded geometry
/// and for a stride-2 one.
#[test]
fn cnn_gradient_matches_finite_differences() {
    let strided = CnnLayout::new(CnnShape {
        image: [1, 15, 15],
        channels: vec![2],
        kernel: 3,
        stride: 2,
        padding: 1,
        hidden: vec![],
        classes: 3,
    })
    .unwrap();
    for layout in [small_cnn(), strided] {
        let ml: ModelLayout = layout.clone().into();
        let mut b = Cnn::on(layout.clone(), CpuDevice::new(1)).unwrap();
        let p = layout.num_params();
        let w = layout.init_range(17, 0..p);
        b.set_weights(&w).unwrap();
        let (x, labels) = batch(&ml, 4, 2);
        let mut g = vec![0.0; p];
        let stats = b
            .forward_backward(&x, &labels, LossReduction::Sum, &mut g)
            .unwrap();
        let classes = ml.classes();
        assert!((stats.loss_sum - loss_f64(&mut b, &x, &labels, classes)).abs() < 1e-4);
        let eps = 1e-3f32;
        let mut worst = (0.0f64, 0);
        for i in 0..p {
            let mut wp = w.clone();
            wp[i] += eps;
            b.set_weights(&wp).unwrap();
            let lp = loss_f64(&mut b, &x, &labels, classes);
            wp[i] -= 2.0 * eps;
            b.set_weights(&wp).unwrap();
            let lm = loss_f64(&mut b, &x, &labels, classes);
            let fd = (lp - lm) / (2.0 * eps as f64);
            let e = (fd - g[i] as f64).abs();
            if e > worst.0 {
                worst = (e, i);
            }
        }
        assert!(
            worst.0 < 2e-3,
            "{}: largest |finite difference - gradient| = {} at {}",
            layout.describe(),
            worst.0,
            worst.1
        );
        assert!(g.iter().filter(|v| **v != 0.0).count() > p / 2);
    }
}

/// The CNN's device path (gradient buffer on the device, downloaded layer by layer) gives
/// the same bits as its host path, over growing and shrinking batches and both reductions,
/// handing on one range per layer, last layer first; evaluation in chunks agrees too.
#[test]
fn cnn_device_path_equals_host_path() {
    let layout = small_cnn();
    let ml: ModelLayout = layout.clone().into();
    let p = layout.num_params();
    let w = layout.init_range(3, 0..p);
    let mut host = crate::cpu::cpu_model(&ml, 1);
    let mut dev = Cnn::on(layout.clone(), hostless()).unwrap();
    host.set_weights(&w).unwrap();
    dev.set_weights(&w).unwrap();
    let starts: Vec<usize> = ["fc2.weight", "fc1.weight", "conv2.weight", "conv1.weight"]
        .iter()
        .map(|n| layout.tensor(n).unwrap().offset)
        .collect();
    for (i, n) in [5usize, 9, 1, 0, 3].into_iter().enumerate() {
        let (x, y) = batch(&ml, n, i);
        for reduction in [LossReduction::Mean, LossReduction::Sum] {
            let (sh, gh, seen_h) = step(host.as_mut(), &layout, &x, &y, reduction);
            let (sd, gd, seen_d) = step(&mut dev, &layout, &x, &y, reduction);
            assert_eq!(sh, sd, "batch {n} {reduction}");
            assert_eq!(bits(&gh), bits(&gd), "batch {n} {reduction}");
            let s: Vec<usize> = seen_d.iter().map(|(s, _)| *s).collect();
            let sh: Vec<usize> = seen_h.iter().map(|(s, _)| *s).collect();
            if n > 0 {
                assert_eq!(s, starts);
                assert_eq!(sh, starts);
            }
        }
    }
    let (x, y) = batch(&ml, 30, 9);
    let want = host.evaluate(&x, &y).unwrap();
    assert_eq!(dev.evaluate(&x, &y).unwrap(), want);
    // a wrong shape is a typed error, not a panic
    assert!(matches!(
        dev.forward_backward(&x[1..], &y, LossReduction::Mean, &mut vec![0.0; p]),
        Err(BackendError::Shape(_))
    ));
}

/// The per-channel bias and its gradient, and the accumulating product, on the CPU.
#[test]
fn channel_bias_and_accumulating_product() {
    let mut d = CpuDevice::new(1);
    // [n 2, channels 3, plane 2]
    let mut z: Vec<f32> = (0..12).map(|i| i as f32 - 6.0).collect();
    d.channel_bias_act(&mut z, &[1.0, 10.0, 100.0], 2, 3, 2, false)
        .unwrap();
    assert_eq!(
        z,
        [-5., -4., 6., 7., 98., 99., 1., 2., 12., 13., 104., 105.]
    );
    let mut r = z.clone();
    d.channel_bias_act(&mut r, &[0.0; 3], 2, 3, 2, true)
        .unwrap();
    assert_eq!(r[..2], [0.0, 0.0]);
    let mut gb = [0.0; 3];
    d.channel_bias_grad(&z, 2, 3, 2, &mut gb).unwrap();
    assert_eq!(gb, [-6.0, 38.0, 406.0]);
    assert!(d.channel_bias_grad(&z, 2, 3, 3, &mut gb).is_err());
    assert!(
        d.channel_bias_act(&mut z, &[0.0; 2], 2, 3, 2, true)
            .is_err()
    );
    let mut c = vec![1.0f32; 4];
    let a = [1.0f32, 2.0, 3.0, 4.0];
    d.gemm_acc(Mat::new(&a[..], 2, 2), Mat::new(&a[..], 2, 2), &mut c)
        .unwrap();
    assert_eq!(c, [8.0, 11.0, 16.0, 23.0]);
}
