//! [`MlpNet`]: the MLP's layers (linear, ReLU between them) over the [`Device`] operations;
//! also the CNN's head.

use super::{LayerReady, Net, WaitLayer};
use crate::error::BackendResult;
use crate::ops::{Device, Mat};
use ps_model::layout::MlpLayout;
use std::ops::Range;

/// The MLP's computation: linear layers with ReLU between them, over its input rows. Also the
/// CNN's head, over the flattened features, its parameters starting at `base`.
pub struct MlpNet<D: Device> {
    pub(super) layout: MlpLayout,
    /// Flat offset of `fc1.weight`: 0 in the MLP, after the convolutions' in the CNN.
    base: usize,
    /// Output of layer `l` (`[rows, dims[l + 1]]`): post-ReLU for hidden layers, logits last.
    acts: Vec<D::Buf>,
    /// `dL/dz` of hidden layer `l` (`[rows, dims[l + 1]]`).
    deltas: Vec<D::Buf>,
}

impl<D: Device> MlpNet<D> {
    /// The layers of `layout`, their parameters from flat index `base` on.
    pub fn new(layout: MlpLayout, base: usize) -> Self {
        Self {
            layout,
            base,
            acts: Vec::new(),
            deltas: Vec::new(),
        }
    }

    /// Flat ranges of the weight and the bias of layer `l`.
    fn layer(&self, l: usize) -> (Range<usize>, Range<usize>) {
        let (w, b) = self.layout.layer(l);
        let o = self.base;
        (w.start + o..w.end + o, b.start + o..b.end + o)
    }

    pub(super) fn gemms(
        &mut self,
        dev: &mut D,
        weights: &D::Buf,
        x: &D::Buf,
        n: usize,
        grad: &mut D::Buf,
    ) -> BackendResult<()> {
        let dims = &self.layout.dims;
        for l in 0..self.layout.num_layers() {
            let (wr, _) = self.layer(l);
            let (fan_in, fan_out) = (dims[l], dims[l + 1]);
            let (before, rest) = self.acts.split_at_mut(l);
            let input = if l == 0 { x } else { &before[l - 1] };
            let z = &mut rest[0];
            dev.gemm(
                Mat::new(D::view(input, 0..n * fan_in), n, fan_in),
                Mat::new(D::view(weights, wr.clone()), fan_out, fan_in).t(),
                D::view_mut(z, 0..n * fan_out),
            )?;
            dev.gemm(
                Mat::new(D::view(z, 0..n * fan_out), n, fan_out).t(),
                Mat::new(D::view(input, 0..n * fan_in), n, fan_in),
                D::view_mut(grad, wr.clone()),
            )?;
            if l > 0 {
                dev.gemm(
                    Mat::new(D::view(z, 0..n * fan_out), n, fan_out),
                    Mat::new(D::view(weights, wr), fan_out, fan_in),
                    D::view_mut(&mut self.deltas[l - 1], 0..n * fan_in),
                )?;
            }
        }
        Ok(())
    }

    /// The backward pass, writing the gradient of the input rows into `d_input` when given
    /// (the CNN's head: the gradient of the pooled features).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn backward_into(
        &mut self,
        dev: &mut D,
        w: &D::Buf,
        input: D::View<'_>,
        n: usize,
        grad: &mut D::ViewMut<'_>,
        mut d_input: Option<D::ViewMut<'_>>,
        ready: &mut LayerReady<'_, D>,
    ) -> BackendResult<()> {
        let layers = self.layout.num_layers();
        let mut input = Some(input);
        for l in (0..layers).rev() {
            let (wr, br) = self.layer(l);
            let (fan_in, fan_out) = (self.layout.dims[l], self.layout.dims[l + 1]);
            let (start, br_end) = (wr.start, br.end);
            let split = l.min(self.deltas.len());
            let (lower, upper) = self.deltas.split_at_mut(split);
            let acts = &self.acts;
            // dL/dz of layer l: the loss's gradient in the logits for the last layer
            macro_rules! dz {
                () => {
                    if l + 1 == layers {
                        D::view(&acts[l], 0..n * fan_out)
                    } else {
                        D::view(&upper[0], 0..n * fan_out)
                    }
                };
            }
            // dW [out, in] = dzᵀ · input
            let dz_t = Mat::new(dz!(), n, fan_out).t();
            let dw = D::sub_mut(grad, wr.clone());
            if l == 0 {
                let x = input.take().expect("layer 0 is reached once");
                dev.gemm(dz_t, Mat::new(x, n, fan_in), dw)?;
            } else {
                let a = D::view(&acts[l - 1], 0..n * fan_in);
                dev.gemm(dz_t, Mat::new(a, n, fan_in), dw)?;
            }
            dev.bias_grad(dz!(), n, fan_out, D::sub_mut(grad, br))?;
            ready(dev, start..br_end, grad)?;
            // d(input) [n, in] = dz · W
            let wm = Mat::new(D::view(w, wr), fan_out, fan_in);
            if l > 0 {
                let da = &mut lower[l - 1];
                dev.gemm(
                    Mat::new(dz!(), n, fan_out),
                    wm,
                    D::view_mut(da, 0..n * fan_in),
                )?;
                // through the ReLU of layer l - 1
                dev.relu_backward(
                    D::view_mut(da, 0..n * fan_in),
                    D::view(&acts[l - 1], 0..n * fan_in),
                )?;
            } else if let Some(da) = d_input.take() {
                dev.gemm(Mat::new(dz!(), n, fan_out), wm, da)?;
            }
        }
        Ok(())
    }
}

impl<D: Device> Net<D> for MlpNet<D> {
    fn layers(&self) -> Vec<Range<usize>> {
        (0..self.layout.num_layers())
            .map(|l| {
                let (w, b) = self.layer(l);
                w.start..b.end
            })
            .collect()
    }

    fn alloc_rows(&mut self, dev: &mut D, rows: usize) -> BackendResult<()> {
        self.acts.clear();
        self.deltas.clear();
        if rows == 0 {
            return Ok(());
        }
        let dims = &self.layout.dims;
        for l in 0..self.layout.num_layers() {
            self.acts.push(dev.alloc(rows * dims[l + 1])?);
            if l + 1 < self.layout.num_layers() {
                self.deltas.push(dev.alloc(rows * dims[l + 1])?);
            }
        }
        Ok(())
    }

    fn forward(
        &mut self,
        dev: &mut D,
        w: &D::Buf,
        x: D::View<'_>,
        n: usize,
        wait: &WaitLayer<'_>,
    ) -> BackendResult<()> {
        let dims = &self.layout.dims;
        let layers = self.layout.num_layers();
        let mut x = Some(x);
        for l in 0..layers {
            let (wr, br) = self.layer(l);
            wait(wr.start..br.end)?;
            let (fan_in, fan_out) = (dims[l], dims[l + 1]);
            let (before, rest) = self.acts.split_at_mut(l);
            let z = &mut rest[0];
            let wt = Mat::new(D::view(w, wr), fan_out, fan_in).t();
            let out = D::view_mut(z, 0..n * fan_out);
            if l == 0 {
                let x = x.take().expect("layer 0 is reached once");
                dev.gemm(Mat::new(x, n, fan_in), wt, out)?;
            } else {
                let a = D::view(&before[l - 1], 0..n * fan_in);
                dev.gemm(Mat::new(a, n, fan_in), wt, out)?;
            }
            dev.bias_act(
                D::view_mut(z, 0..n * fan_out),
                D::view(w, br),
                n,
                fan_out,
                l + 1 < layers,
            )?;
        }
        Ok(())
    }

    fn logits(&self) -> &D::Buf {
        self.acts
            .last()
            .expect("buffers allocated before the forward pass")
    }

    fn logits_mut(&mut self) -> &mut D::Buf {
        self.acts
            .last_mut()
            .expect("buffers allocated before the forward pass")
    }

    fn backward(
        &mut self,
        dev: &mut D,
        w: &D::Buf,
        x: D::View<'_>,
        n: usize,
        grad: &mut D::ViewMut<'_>,
        ready: &mut LayerReady<'_, D>,
    ) -> BackendResult<()> {
        self.backward_into(dev, w, x, n, grad, None, ready)
    }
}
