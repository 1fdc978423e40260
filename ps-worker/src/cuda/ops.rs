//! [`Device`] for [`CudaDevice`]: each operation of the model as cuBLAS products and NVRTC
//! kernel launches on the device's stream, with its length checks.

use super::{
    CudaDevice, EVAL_ROWS, cfg_channels, cfg_cols, cfg_elems, cfg_rows, check_i32, conv_args,
    copy_out, cuda_err, dma, pool_args,
};
use crate::backend::{BackendError, BackendResult, StepStats};
use crate::cpu::{check_len, check_rows};
use crate::ops::{ConvGeom, CopyTimes, Device, Mat, Strides, check_pool};
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, PushKernelArg};
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

impl Device for CudaDevice {
    type Buf = CudaSlice<f32>;
    type View<'a> = CudaView<'a, f32>;
    type ViewMut<'a> = CudaViewMut<'a, f32>;

    fn name(&self) -> String {
        format!("cuda:{} ({})", self.ordinal, self.device_name)
    }

    fn alloc(&mut self, len: usize) -> BackendResult<CudaSlice<f32>> {
        self.bind()?;
        // cuMemAlloc refuses 0 bytes: an empty buffer holds one unused value
        self.stream
            .alloc_zeros::<f32>(len.max(1))
            .map_err(cuda_err(format_args!("allocating {len} floats")))
    }

    fn view(buf: &CudaSlice<f32>, r: Range<usize>) -> CudaView<'_, f32> {
        buf.slice(r)
    }

    fn view_mut(buf: &mut CudaSlice<f32>, r: Range<usize>) -> CudaViewMut<'_, f32> {
        buf.slice_mut(r)
    }

    fn sub_mut<'a, 'b: 'a>(
        v: &'a mut CudaViewMut<'b, f32>,
        r: Range<usize>,
    ) -> CudaViewMut<'a, f32> {
        v.slice_mut(r)
    }

    fn sub<'a, 'b: 'a>(v: &'a CudaViewMut<'b, f32>, r: Range<usize>) -> CudaView<'a, f32> {
        v.slice(r)
    }

    fn host_view_mut(_: &mut [f32]) -> Option<CudaViewMut<'_, f32>> {
        None
    }

    fn host_of<'a>(_: &'a CudaViewMut<'_, f32>) -> Option<&'a [f32]> {
        None
    }

    fn host_buf(_: &mut CudaSlice<f32>) -> Option<&mut [f32]> {
        None
    }

    fn staging(&mut self, len: usize) -> BackendResult<Option<*mut f32>> {
        // no upload queued from the memory may still be reading it
        self.sync()?;
        if self
            .weight_staging
            .as_ref()
            .is_none_or(|p| p.len() != len.max(1))
        {
            self.weight_staging = None;
            // SAFETY: its values are read (by uploads) only after a pull wrote them (the
            // gate's contract); flags 0: cached host memory, fast for the pull's writes
            let p = unsafe { self.ctx.alloc_pinned_with_flags::<f32>(len.max(1), 0) }.map_err(
                cuda_err(format_args!(
                    "allocating {len} floats of pinned host memory for the weights"
                )),
            )?;
            self.weight_staging = Some(p);
        }
        let p = self.weight_staging.as_mut().expect("allocated above");
        let host = p
            .as_mut_slice()
            .map_err(cuda_err("reaching the pinned weights"))?;
        Ok(Some(host.as_mut_ptr()))
    }

    fn upload(&mut self, src: &[f32], mut dst: CudaViewMut<'_, f32>) -> BackendResult<()> {
        check_len("the upload destination", dst.len(), src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        let span = self.span_begin()?;
        self.stream
            .memcpy_htod(src, &mut dst)
            .map_err(cuda_err(format_args!(
                "copying {} floats to the device",
                src.len()
            )))?;
        self.span_end(true, src.len(), span)
    }

    fn download(&mut self, src: CudaView<'_, f32>, dst: &mut [f32]) -> BackendResult<()> {
        check_len("the download destination", dst.len(), src.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        self.bind()?;
        let span = self.span_begin()?;
        self.stream
            .memcpy_dtoh(&src, dst)
            .map_err(cuda_err(format_args!(
                "copying {} floats to the host",
                dst.len()
            )))?;
        self.span_end(false, dst.len(), span)?;
        self.stream
            .synchronize()
            .map_err(cuda_err("synchronising after a download"))
    }

    fn start_download(&mut self, src: CudaView<'_, f32>, slot: usize) -> BackendResult<()> {
        self.bind()?;
        self.direct.remove(&slot);
        let len = src.len();
        if self
            .staging
            .get(&slot)
            .is_none_or(|p| p.0.len() != len.max(1))
        {
            self.staging.remove(&slot);
            // SAFETY: written by the copy below before finish_download reads it; flags 0:
            // cached, readable host memory (write-combined memory is slow to read)
            let p = unsafe { self.ctx.alloc_pinned_with_flags::<f32>(len.max(1), 0) }.map_err(
                cuda_err(format_args!(
                    "allocating {len} floats of pinned host memory"
                )),
            )?;
            let e = self
                .ctx
                .new_event(None)
                .map_err(cuda_err("creating an event"))?;
            self.staging.insert(slot, (p, e));
        }
        let span = self.span_begin()?;
        let (dst, done) = self.staging.get_mut(&slot).expect("inserted above");
        if len > 0 {
            self.stream
                .memcpy_dtoh(&src, dst)
                .map_err(cuda_err(format_args!(
                    "queueing a copy of {len} floats to the host"
                )))?;
        }
        // waited for by finish_download: only this copy and what was queued before it
        done.record(&self.stream)
            .map_err(cuda_err("recording a download's event"))?;
        self.span_end(false, len, span)
    }

    fn finish_download(&mut self, slot: usize, dst: &mut [f32]) -> BackendResult<()> {
        self.bind()?;
        if let Some((at, len, done)) = self.direct.remove(&slot) {
            if (at, len) != (dst.as_ptr() as usize, dst.len()) {
                return Err(BackendError::Shape(format!(
                    "slot {slot} was downloaded into {len} values at {at:#x}, not into the {} at {:p}",
                    dst.len(),
                    dst.as_ptr()
                )));
            }
            return done.synchronize().map_err(cuda_err(format_args!(
                "waiting for the copy of slot {slot}"
            )));
        }
        let Some((p, done)) = self.staging.get(&slot) else {
            return Err(BackendError::Shape(format!(
                "no download was started in slot {slot}"
            )));
        };
        let len = if dst.is_empty() { 0 } else { p.len() };
        check_len("the download destination", dst.len(), len)?;
        done.synchronize().map_err(cuda_err(format_args!(
            "waiting for the copy of slot {slot}"
        )))?;
        let host = p
            .as_slice()
            .map_err(cuda_err(format_args!("reading the copy of slot {slot}")))?;
        let t = Instant::now();
        copy_out(dst, &host[..len]);
        ps_net::copied::count(ps_net::copied::Side::Push, 4 * len);
        self.copy_times.copy_out += t.elapsed();
        Ok(())
    }

    fn registrar(&self) -> Option<Arc<dyn ps_net::shm::Registrar>> {
        Some(Arc::new(dma::CudaRegistrar {
            ctx: self.ctx.clone(),
            ranges: self.registered.clone(),
        }))
    }

    fn is_registered(&self, ptr: *const f32, len: usize) -> bool {
        dma::covers(&self.registered, ptr as usize, 4 * len)
    }

    unsafe fn start_download_registered(
        &mut self,
        src: CudaView<'_, f32>,
        dst: *mut f32,
        slot: usize,
    ) -> BackendResult<()> {
        let len = src.len();
        if !self.is_registered(dst, len) {
            return Err(BackendError::Shape(format!(
                "a download into {len} values at {dst:p}: not host memory registered with this device"
            )));
        }
        self.bind()?;
        self.staging.remove(&slot);
        let done = match self.direct.remove(&slot) {
            Some((_, _, e)) => e,
            None => self
                .ctx
                .new_event(None)
                .map_err(cuda_err("creating an event"))?,
        };
        let span = self.span_begin()?;
        if len > 0 {
            // SAFETY: registered memory of `len` values that the caller leaves alone until
            // finish_download or sync (the contract); the copy writes it by DMA
            let host = unsafe { std::slice::from_raw_parts_mut(dst, len) };
            self.stream
                .memcpy_dtoh(&src, host)
                .map_err(cuda_err(format_args!(
                    "queueing a copy of {len} floats into registered host memory"
                )))?;
        }
        done.record(&self.stream)
            .map_err(cuda_err("recording a download's event"))?;
        self.direct.insert(slot, (dst as usize, len, done));
        self.span_end(false, len, span)
    }

    fn fill_zero(&mut self, mut v: CudaViewMut<'_, f32>) -> BackendResult<()> {
        if v.is_empty() {
            return Ok(());
        }
        self.bind()?;
        self.stream
            .memset_zeros(&mut v)
            .map_err(cuda_err("zeroing a buffer"))
    }

    fn take_copy_times(&mut self) -> BackendResult<Option<CopyTimes>> {
        self.bind()?;
        self.fold_spans(true)?;
        Ok(Some(std::mem::take(&mut self.copy_times)))
    }

    fn sync(&mut self) -> BackendResult<()> {
        self.bind()?;
        self.stream
            .synchronize()
            .map_err(cuda_err("synchronising the stream"))
    }

    fn gemm(
        &mut self,
        a: Mat<CudaView<'_, f32>>,
        b: Mat<CudaView<'_, f32>>,
        c: CudaViewMut<'_, f32>,
    ) -> BackendResult<()> {
        self.gemm_beta(a, b, c, 0.0)
    }

    fn gemm_acc(
        &mut self,
        a: Mat<CudaView<'_, f32>>,
        b: Mat<CudaView<'_, f32>>,
        c: CudaViewMut<'_, f32>,
    ) -> BackendResult<()> {
        self.gemm_beta(a, b, c, 1.0)
    }

    fn gemm_batched(
        &mut self,
        a: Mat<CudaView<'_, f32>>,
        b: Mat<CudaView<'_, f32>>,
        c: CudaViewMut<'_, f32>,
        s: Strides,
    ) -> BackendResult<()> {
        self.strided_products(a, b, c, s)
    }

    fn gemm_batched_sum(
        &mut self,
        a: Mat<CudaView<'_, f32>>,
        b: Mat<CudaView<'_, f32>>,
        c: CudaViewMut<'_, f32>,
        s: Strides,
    ) -> BackendResult<()> {
        self.strided_sum(a, b, c, s)
    }

    fn channel_bias_act(
        &mut self,
        mut z: CudaViewMut<'_, f32>,
        bias: CudaView<'_, f32>,
        n: usize,
        channels: usize,
        plane: usize,
        relu: bool,
    ) -> BackendResult<()> {
        check_len("the convolution's output", z.len(), n * channels * plane)?;
        check_len("the channel bias", bias.len(), channels)?;
        if z.is_empty() {
            return Ok(());
        }
        let len = z.len();
        let total = len as i64;
        let (c_i, p_i) = (
            check_i32("channels", channels)?,
            check_i32("a plane", plane)?,
        );
        let relu = i32::from(relu);
        self.bind()?;
        // SAFETY: channel_bias_act_f32(float* z, const float* b, long long total, int channels,
        // int plane, int relu): `z` holds exactly total = n*channels*plane floats and `bias`
        // channels (checked above, all > 0 as z is not empty); the kernel reads b[c] for
        // c < channels only.
        unsafe {
            self.stream
                .launch_builder(&self.k.channel_bias_act)
                .arg(&mut z)
                .arg(&bias)
                .arg(&total)
                .arg(&c_i)
                .arg(&p_i)
                .arg(&relu)
                .launch(cfg_elems(len))
        }
        .map(|_| ())
        .map_err(cuda_err("launching channel_bias_act_f32"))
    }

    fn channel_bias_grad(
        &mut self,
        dz: CudaView<'_, f32>,
        n: usize,
        channels: usize,
        plane: usize,
        mut out: CudaViewMut<'_, f32>,
    ) -> BackendResult<()> {
        check_len("dL/dz", dz.len(), n * channels * plane)?;
        check_len("the channel bias gradient", out.len(), channels)?;
        if channels == 0 {
            return Ok(());
        }
        if dz.is_empty() {
            return self.fill_zero(out);
        }
        let (n_i, c_i, p_i) = (
            check_i32("a batch", n)?,
            check_i32("channels", channels)?,
            check_i32("a plane", plane)?,
        );
        self.bind()?;
        // SAFETY: channel_bias_grad_f32(const float* dz, float* db, int n, int channels,
        // int plane): `dz` holds exactly n*channels*plane floats and `out` channels (checked
        // above); blocks of 256 threads, the size of the kernel's shared array.
        unsafe {
            self.stream
                .launch_builder(&self.k.channel_bias_grad)
                .arg(&dz)
                .arg(&mut out)
                .arg(&n_i)
                .arg(&c_i)
                .arg(&p_i)
                .launch(cfg_channels(channels))
        }
        .map(|_| ())
        .map_err(cuda_err("launching channel_bias_grad_f32"))
    }

    fn bias_act(
        &mut self,
        mut z: CudaViewMut<'_, f32>,
        bias: CudaView<'_, f32>,
        rows: usize,
        cols: usize,
        relu: bool,
    ) -> BackendResult<()> {
        check_len("the pre-activations", z.len(), rows * cols)?;
        check_len("the bias", bias.len(), cols)?;
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        let (rows_i, cols_i) = (check_i32("rows", rows)?, check_i32("columns", cols)?);
        let relu = i32::from(relu);
        self.bind()?;
        // SAFETY: bias_act_f32(float* z, const float* b, int rows, int cols, int relu): `z`
        // holds exactly rows*cols floats and `bias` cols (checked above, cols > 0); the kernel
        // touches z[i] for i < rows*cols and b[c] for c < cols only.
        unsafe {
            self.stream
                .launch_builder(&self.k.bias_act)
                .arg(&mut z)
                .arg(&bias)
                .arg(&rows_i)
                .arg(&cols_i)
                .arg(&relu)
                .launch(cfg_elems(rows * cols))
        }
        .map(|_| ())
        .map_err(cuda_err("launching bias_act_f32"))
    }

    fn relu_backward(
        &mut self,
        mut d: CudaViewMut<'_, f32>,
        act: CudaView<'_, f32>,
    ) -> BackendResult<()> {
        check_len("the gradient through the ReLU", d.len(), act.len())?;
        if d.is_empty() {
            return Ok(());
        }
        let len = d.len();
        let total = len as i64;
        self.bind()?;
        // SAFETY: relu_backward_f32(float* d, const float* act, long long n): both hold
        // exactly n floats (checked above).
        unsafe {
            self.stream
                .launch_builder(&self.k.relu_backward)
                .arg(&mut d)
                .arg(&act)
                .arg(&total)
                .launch(cfg_elems(len))
        }
        .map(|_| ())
        .map_err(cuda_err("launching relu_backward_f32"))
    }

    fn softmax_xent(
        &mut self,
        mut logits: CudaViewMut<'_, f32>,
        labels: &[u8],
        cols: usize,
        scale: f32,
    ) -> BackendResult<()> {
        check_rows(logits.len(), labels, cols)?;
        let n = labels.len();
        self.bind()?;
        if n == 0 || cols == 0 {
            let mut out = self.stats.slice_mut(0..2);
            return self
                .stream
                .memset_zeros(&mut out)
                .map_err(cuda_err("zeroing the statistics"));
        }
        let (rows_i, cols_i) = (check_i32("rows", n)?, check_i32("columns", cols)?);
        self.upload_labels(labels)?;
        // SAFETY: softmax_xent_f32(float* z, const unsigned char* labels, float* row_loss,
        // int* row_correct, int rows, int cols, float scale): `logits` holds exactly n*cols
        // floats, the label and per-row buffers at least n entries (ensured by upload_labels),
        // every label is < cols (checked above); blocks of 256 threads are whole warps.
        unsafe {
            self.stream
                .launch_builder(&self.k.softmax_xent)
                .arg(&mut logits)
                .arg(&self.labels)
                .arg(&mut self.row_loss)
                .arg(&mut self.row_correct)
                .arg(&rows_i)
                .arg(&cols_i)
                .arg(&scale)
                .launch(cfg_rows(n))
        }
        .map_err(cuda_err("launching softmax_xent_f32"))?;
        self.reduce_rows(rows_i, 0)?;
        let (host, done) = &mut self.stats_host;
        self.stream
            .memcpy_dtoh(&self.stats.slice(0..2), host)
            .map_err(cuda_err("copying the loss and accuracy to the host"))?;
        done.record(&self.stream)
            .map_err(cuda_err("recording the statistics' event"))
    }

    fn stats(&mut self) -> BackendResult<StepStats> {
        self.bind()?;
        // waits for the copy queued behind the last loss only
        let (host, done) = &self.stats_host;
        done.synchronize()
            .map_err(cuda_err("waiting for the loss and accuracy"))?;
        let host = host
            .as_slice()
            .map_err(cuda_err("reading the loss and accuracy"))?;
        Ok(StepStats {
            loss_sum: host[0],
            correct: host[1] as u64,
        })
    }

    fn bias_grad(
        &mut self,
        dz: CudaView<'_, f32>,
        rows: usize,
        cols: usize,
        mut out: CudaViewMut<'_, f32>,
    ) -> BackendResult<()> {
        check_len("dL/dz", dz.len(), rows * cols)?;
        check_len("the bias gradient", out.len(), cols)?;
        if cols == 0 {
            return Ok(());
        }
        if rows == 0 {
            return self.fill_zero(out);
        }
        let (rows_i, cols_i) = (check_i32("rows", rows)?, check_i32("columns", cols)?);
        self.bind()?;
        // SAFETY: bias_grad_f32(const float* dz, float* db, int rows, int cols): `dz` holds
        // exactly rows*cols floats and `out` cols (checked above); the block is
        // (32, BIAS_GRAD_ROWS), the shape of the kernel's shared array.
        unsafe {
            self.stream
                .launch_builder(&self.k.bias_grad)
                .arg(&dz)
                .arg(&mut out)
                .arg(&rows_i)
                .arg(&cols_i)
                .launch(cfg_cols(cols))
        }
        .map(|_| ())
        .map_err(cuda_err("launching bias_grad_f32"))
    }

    fn count_correct(
        &mut self,
        logits: CudaView<'_, f32>,
        labels: &[u8],
        cols: usize,
    ) -> BackendResult<u64> {
        check_rows(logits.len(), labels, cols)?;
        let n = labels.len();
        if n == 0 || cols == 0 {
            return Ok(0);
        }
        let (rows_i, cols_i) = (check_i32("rows", n)?, check_i32("columns", cols)?);
        self.bind()?;
        self.upload_labels(labels)?;
        // SAFETY: argmax_correct_f32(const float* z, const unsigned char* labels,
        // float* row_loss, int* row_correct, int rows, int cols): as softmax_xent_f32 above,
        // reading the logits only.
        unsafe {
            self.stream
                .launch_builder(&self.k.argmax_correct)
                .arg(&logits)
                .arg(&self.labels)
                .arg(&mut self.row_loss)
                .arg(&mut self.row_correct)
                .arg(&rows_i)
                .arg(&cols_i)
                .launch(cfg_rows(n))
        }
        .map_err(cuda_err("launching argmax_correct_f32"))?;
        self.reduce_rows(rows_i, 2)?;
        Ok(self.read_stats(2)?[1] as u64)
    }

    fn eval_rows(&self) -> usize {
        EVAL_ROWS
    }

    fn im2col(
        &mut self,
        x: CudaView<'_, f32>,
        mut cols: CudaViewMut<'_, f32>,
        n: usize,
        g: ConvGeom,
    ) -> BackendResult<()> {
        let (oh, ow) = g.check(n, x.len(), cols.len())?;
        let a = conv_args(n, g, oh, ow)?;
        // SAFETY: x holds n*c*h*w floats and cols n*c*k*k*oh*ow (checked above); every read
        // index is inside x (the kernel skips positions outside the input).
        unsafe { self.launch_conv("im2col_f32", &x, &mut cols, a) }
    }

    fn col2im(
        &mut self,
        cols: CudaView<'_, f32>,
        mut dx: CudaViewMut<'_, f32>,
        n: usize,
        g: ConvGeom,
    ) -> BackendResult<()> {
        let (oh, ow) = g.check(n, dx.len(), cols.len())?;
        let a = conv_args(n, g, oh, ow)?;
        // SAFETY: lengths checked above; the kernel reads only cols entries of in-range
        // (oy, ox).
        unsafe { self.launch_conv("col2im_f32", &cols, &mut dx, a) }
    }

    fn maxpool2(
        &mut self,
        x: CudaView<'_, f32>,
        mut y: CudaViewMut<'_, f32>,
        mut arg: CudaViewMut<'_, f32>,
        planes: usize,
        h: usize,
        w: usize,
    ) -> BackendResult<()> {
        check_pool(planes, h, w, x.len(), y.len(), arg.len())?;
        if y.is_empty() {
            return Ok(());
        }
        let (pl, hh, ww) = pool_args(planes, h, w)?;
        let cfg = cfg_elems(y.len());
        self.bind()?;
        // SAFETY: maxpool2_f32(const float* x, float* y, float* arg, long long planes, int h,
        // int w): x holds planes*h*w, y and arg planes*(h/2)*(w/2) floats (checked above).
        unsafe {
            self.stream
                .launch_builder(&self.k.maxpool2)
                .arg(&x)
                .arg(&mut y)
                .arg(&mut arg)
                .arg(&pl)
                .arg(&hh)
                .arg(&ww)
                .launch(cfg)
        }
        .map(|_| ())
        .map_err(cuda_err("launching maxpool2_f32"))
    }

    fn maxpool2_backward(
        &mut self,
        dy: CudaView<'_, f32>,
        arg: CudaView<'_, f32>,
        mut dx: CudaViewMut<'_, f32>,
        planes: usize,
        h: usize,
        w: usize,
    ) -> BackendResult<()> {
        check_pool(planes, h, w, dx.len(), dy.len(), arg.len())?;
        if dx.is_empty() {
            return Ok(());
        }
        let (pl, hh, ww) = pool_args(planes, h, w)?;
        let cfg = cfg_elems(dx.len());
        self.bind()?;
        // SAFETY: maxpool2_backward_f32(const float* dy, const float* arg, float* dx,
        // long long planes, int h, int w): lengths checked above.
        unsafe {
            self.stream
                .launch_builder(&self.k.maxpool2_backward)
                .arg(&dy)
                .arg(&arg)
                .arg(&mut dx)
                .arg(&pl)
                .arg(&hh)
                .arg(&ww)
                .launch(cfg)
        }
        .map(|_| ())
        .map_err(cuda_err("launching maxpool2_backward_f32"))
    }
}
