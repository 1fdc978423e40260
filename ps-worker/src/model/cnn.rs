//! [`CnnNet`]: the CNN's convolution stages (im2col, the products of the whole batch as one
//! strided batch, per-channel bias and ReLU, 2x2 max-pooling) and its [`MlpNet`] head.

use super::{LayerReady, MlpNet, Net, WaitLayer};
use crate::error::BackendResult;
use crate::ops::{ConvGeom, Device, Mat, Strides};
use ps_model::layout::CnnLayout;
use std::ops::Range;

/// One `conv -> ReLU -> maxpool 2` stage of the CNN and its batch buffers.
struct Stage<D: Device> {
    /// The convolution's input geometry.
    geom: ConvGeom,
    /// Output channels.
    out: usize,
    /// The convolution's output height and width.
    conv_hw: (usize, usize),
    /// Positions per channel of the convolution's output and of the pooling's.
    plane: usize,
    pooled: usize,
    /// Column matrices of the input (`[rows, c * k * k, plane]`); in backward, once the
    /// weight gradient is queued, the gradient of the column matrices.
    cols: D::Buf,
    /// The convolution's output after bias and ReLU (`[rows, out, plane]`).
    z: D::Buf,
    /// `dL/dz` (`[rows, out, plane]`).
    dz: D::Buf,
    /// The pooled output (`[rows, out, pooled]`), its argmax and its gradient.
    y: D::Buf,
    arg: D::Buf,
    dy: D::Buf,
}

/// The CNN's computation: convolution stages (im2col, the products of every sample with the
/// weight `[out, c * k * k]` as one strided batch, per-channel bias and ReLU, 2x2 max-pooling), then the linear layers of
/// an [`MlpNet`] over the flattened pooled features (NCHW order, as `torch.flatten`).
pub struct CnnNet<D: Device> {
    layout: CnnLayout,
    stages: Vec<Stage<D>>,
    head: MlpNet<D>,
}

impl<D: Device> CnnNet<D> {
    /// The computation of `layout`.
    pub fn new(layout: CnnLayout) -> Self {
        let head = MlpNet::new(layout.head.clone(), layout.head_offset());
        Self {
            layout,
            stages: Vec::new(),
            head,
        }
    }

    /// Values per sample of the pooled output of the last stage (the head's input).
    fn features(&self) -> usize {
        self.layout.head.dims[0]
    }
}

impl<D: Device> Net<D> for CnnNet<D> {
    fn layers(&self) -> Vec<Range<usize>> {
        let mut v: Vec<Range<usize>> = (0..self.layout.stages.len())
            .map(|i| {
                let (w, b) = self.layout.conv(i);
                w.start..b.end
            })
            .collect();
        v.extend(self.head.layers());
        v
    }

    fn alloc_rows(&mut self, dev: &mut D, rows: usize) -> BackendResult<()> {
        self.stages.clear();
        self.head.alloc_rows(dev, 0)?;
        if rows == 0 {
            return Ok(());
        }
        let s = &self.layout.shape;
        for st in &self.layout.stages {
            let geom = ConvGeom {
                channels: st.input[0],
                height: st.input[1],
                width: st.input[2],
                kernel: s.kernel,
                stride: s.stride,
                padding: s.padding,
            };
            let plane = st.conv_hw[0] * st.conv_hw[1];
            let pooled = st.pool_hw[0] * st.pool_hw[1];
            let out = st.out_channels;
            self.stages.push(Stage {
                geom,
                out,
                conv_hw: (st.conv_hw[0], st.conv_hw[1]),
                plane,
                pooled,
                cols: dev.alloc(rows * geom.col_rows() * plane)?,
                z: dev.alloc(rows * out * plane)?,
                dz: dev.alloc(rows * out * plane)?,
                y: dev.alloc(rows * out * pooled)?,
                arg: dev.alloc(rows * out * pooled)?,
                dy: dev.alloc(rows * out * pooled)?,
            });
        }
        self.head.alloc_rows(dev, rows)
    }

    fn forward(
        &mut self,
        dev: &mut D,
        w: &D::Buf,
        x: D::View<'_>,
        n: usize,
        wait: &WaitLayer<'_>,
    ) -> BackendResult<()> {
        let mut x = Some(x);
        for s in 0..self.stages.len() {
            let (wr, br) = self.layout.conv(s);
            wait(wr.start..br.end)?;
            let (before, rest) = self.stages.split_at_mut(s);
            let st = &mut rest[0];
            let (g, out, plane, pooled) = (st.geom, st.out, st.plane, st.pooled);
            let ckk = g.col_rows();
            let cols = D::view_mut(&mut st.cols, 0..n * ckk * plane);
            if s == 0 {
                let x = x.take().expect("stage 0 is reached once");
                dev.im2col(x, cols, n, g)?;
            } else {
                let y = D::view(&before[s - 1].y, 0..n * g.input_len());
                dev.im2col(y, cols, n, g)?;
            }
            // z[b] [out, plane] = W [out, c k k] · cols[b] [c k k, plane], for every b at once
            dev.gemm_batched(
                Mat::new(D::view(w, wr.clone()), out, ckk),
                Mat::new(D::view(&st.cols, 0..n * ckk * plane), ckk, plane),
                D::view_mut(&mut st.z, 0..n * out * plane),
                Strides {
                    count: n,
                    a: 0,
                    b: ckk * plane,
                    c: out * plane,
                },
            )?;
            dev.channel_bias_act(
                D::view_mut(&mut st.z, 0..n * out * plane),
                D::view(w, br),
                n,
                out,
                plane,
                true,
            )?;
            dev.maxpool2(
                D::view(&st.z, 0..n * out * plane),
                D::view_mut(&mut st.y, 0..n * out * pooled),
                D::view_mut(&mut st.arg, 0..n * out * pooled),
                n * out,
                st.conv_hw.0,
                st.conv_hw.1,
            )?;
        }
        let f = self.features();
        let last = self.stages.last().expect("a CNN has a convolution");
        self.head
            .forward(dev, w, D::view(&last.y, 0..n * f), n, wait)
    }

    fn logits(&self) -> &D::Buf {
        self.head.logits()
    }

    fn logits_mut(&mut self) -> &mut D::Buf {
        self.head.logits_mut()
    }

    fn backward(
        &mut self,
        dev: &mut D,
        w: &D::Buf,
        _x: D::View<'_>,
        n: usize,
        grad: &mut D::ViewMut<'_>,
        ready: &mut LayerReady<'_, D>,
    ) -> BackendResult<()> {
        let f = self.features();
        {
            let last = self.stages.last_mut().expect("a CNN has a convolution");
            let d_input = D::view_mut(&mut last.dy, 0..n * f);
            self.head.backward_into(
                dev,
                w,
                D::view(&last.y, 0..n * f),
                n,
                grad,
                Some(d_input),
                ready,
            )?;
        }
        for s in (0..self.stages.len()).rev() {
            let (wr, br) = self.layout.conv(s);
            let (before, rest) = self.stages.split_at_mut(s);
            let st = &mut rest[0];
            let (g, out, plane, pooled) = (st.geom, st.out, st.plane, st.pooled);
            let ckk = g.col_rows();
            dev.maxpool2_backward(
                D::view(&st.dy, 0..n * out * pooled),
                D::view(&st.arg, 0..n * out * pooled),
                D::view_mut(&mut st.dz, 0..n * out * plane),
                n * out,
                st.conv_hw.0,
                st.conv_hw.1,
            )?;
            dev.relu_backward(
                D::view_mut(&mut st.dz, 0..n * out * plane),
                D::view(&st.z, 0..n * out * plane),
            )?;
            dev.channel_bias_grad(
                D::view(&st.dz, 0..n * out * plane),
                n,
                out,
                plane,
                D::sub_mut(grad, br.clone()),
            )?;
            // dW [out, c k k] = sum over b of dz[b] [out, plane] · cols[b]ᵀ [plane, c k k]
            dev.gemm_batched_sum(
                Mat::new(D::view(&st.dz, 0..n * out * plane), out, plane),
                Mat::new(D::view(&st.cols, 0..n * ckk * plane), ckk, plane).t(),
                D::sub_mut(grad, wr.clone()),
                Strides {
                    count: n,
                    a: out * plane,
                    b: ckk * plane,
                    c: 0,
                },
            )?;
            ready(dev, wr.start..br.end, grad)?;
            if s > 0 {
                // d cols[b] [c k k, plane] = Wᵀ · dz[b], into the column buffer, then summed
                // back onto the previous stage's pooled output
                dev.gemm_batched(
                    Mat::new(D::view(w, wr.clone()), out, ckk).t(),
                    Mat::new(D::view(&st.dz, 0..n * out * plane), out, plane),
                    D::view_mut(&mut st.cols, 0..n * ckk * plane),
                    Strides {
                        count: n,
                        a: 0,
                        b: out * plane,
                        c: ckk * plane,
                    },
                )?;
                dev.col2im(
                    D::view(&st.cols, 0..n * ckk * plane),
                    D::view_mut(&mut before[s - 1].dy, 0..n * g.input_len()),
                    n,
                    g,
                )?;
            }
        }
        Ok(())
    }
}
