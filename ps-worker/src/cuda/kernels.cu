// The CUDA device's kernels, compiled by NVRTC at start-up (see cuda.rs). Plain CUDA C with no
// include directive. Matrices are row-major; every index into a [rows, cols] matrix is 64-bit.
#define NEG_INF __int_as_float(0xff800000)
#define NO_ARG 0x7fffffff
#define BIAS_GRAD_ROWS 8

// z[r, c] += b[c], then ReLU when relu != 0 (fmaxf maps NaN to 0 like Rust's f32::max).
// Grid-stride over the rows * cols elements; needs cols > 0.
extern "C" __global__ void bias_act_f32(float* __restrict__ z, const float* __restrict__ b,
                                        int rows, int cols, int relu) {
    const long long total = (long long)rows * cols;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    int c = (int)(i % cols);
    const int step = (int)(stride % cols);
    for (; i < total; i += stride) {
        const float v = z[i] + b[c];
        z[i] = relu ? fmaxf(v, 0.0f) : v;
        c += step;
        if (c >= cols) c -= cols;
    }
}

// d[i] = 0 where act[i] <= 0: the gradient through a ReLU whose output is act (a NaN
// activation keeps d, like the CPU device). Grid-stride over n elements.
extern "C" __global__ void relu_backward_f32(float* __restrict__ d, const float* __restrict__ act,
                                             long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        if (act[i] <= 0.0f) d[i] = 0.0f;
    }
}

// The largest value of row[0..cols) and its first index (NaN never wins; NO_ARG when no value
// is larger than -inf), the same in every lane of the calling warp, which must be whole.
__device__ __forceinline__ void warp_argmax(const float* row, int cols, int lane, float* max_out,
                                            int* arg_out) {
    float m = NEG_INF;
    int arg = NO_ARG;
    for (int j = lane; j < cols; j += 32) {
        const float v = row[j];
        if (v > m) { m = v; arg = j; }
    }
    for (int off = 16; off > 0; off >>= 1) {
        const float om = __shfl_xor_sync(0xffffffffu, m, off);
        const int oa = __shfl_xor_sync(0xffffffffu, arg, off);
        if (om > m || (om == m && oa < arg)) { m = om; arg = oa; }
    }
    *max_out = m;
    *arg_out = arg;
}

// One warp per row of the logits z [rows, cols] (blocks of whole warps, grid-stride over rows):
// replaces the row by scale * (softmax(z) - onehot(label)), writes the row's cross-entropy loss
// and whether its first largest logit is the label. Labels must be < cols.
extern "C" __global__ void softmax_xent_f32(float* __restrict__ z, const unsigned char* __restrict__ labels,
                                            float* __restrict__ row_loss, int* __restrict__ row_correct,
                                            int rows, int cols, float scale) {
    const int lane = threadIdx.x & 31;
    const int warps_per_block = blockDim.x >> 5;
    const int nwarps = gridDim.x * warps_per_block;
    for (int r = blockIdx.x * warps_per_block + (threadIdx.x >> 5); r < rows; r += nwarps) {
        float* row = z + (long long)r * cols;
        float m;
        int arg;
        warp_argmax(row, cols, lane, &m, &arg);
        if (arg == NO_ARG) arg = 0;
        float s = 0.0f;
        for (int j = lane; j < cols; j += 32) s += expf(row[j] - m);
        for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        const int y = labels[r];
        const float zy = row[y];
        __syncwarp(); // every lane has read row[y] before any lane overwrites the row
        if (lane == 0) {
            row_loss[r] = logf(s) - (zy - m);
            row_correct[r] = arg == y ? 1 : 0;
        }
        const float k = (1.0f / s) * scale;
        for (int j = lane; j < cols; j += 32) {
            float g = expf(row[j] - m) * k;
            if (j == y) g -= scale;
            row[j] = g;
        }
        __syncwarp();
    }
}

// One warp per row of z [rows, cols] (launched like softmax_xent_f32), read only: row_correct[r]
// = whether the row's first largest value is its label; row_loss[r] = 0.
extern "C" __global__ void argmax_correct_f32(const float* __restrict__ z,
                                              const unsigned char* __restrict__ labels,
                                              float* __restrict__ row_loss, int* __restrict__ row_correct,
                                              int rows, int cols) {
    const int lane = threadIdx.x & 31;
    const int warps_per_block = blockDim.x >> 5;
    const int nwarps = gridDim.x * warps_per_block;
    for (int r = blockIdx.x * warps_per_block + (threadIdx.x >> 5); r < rows; r += nwarps) {
        float m;
        int arg;
        warp_argmax(z + (long long)r * cols, cols, lane, &m, &arg);
        if (arg == NO_ARG) arg = 0;
        if (lane == 0) {
            row_loss[r] = 0.0f;
            row_correct[r] = arg == (int)labels[r] ? 1 : 0;
        }
    }
}

// db[c] = sum over rows of dz[r, c]. Block (32, BIAS_GRAD_ROWS): x picks the column of a
// 32-column tile, y strides over the rows; the partial sums are added in a fixed order. The
// tile loop depends on blockIdx only, so every thread of a block reaches each __syncthreads.
extern "C" __global__ void bias_grad_f32(const float* __restrict__ dz, float* __restrict__ db,
                                         int rows, int cols) {
    __shared__ float part[BIAS_GRAD_ROWS][33];
    for (int c0 = blockIdx.x * 32; c0 < cols; c0 += gridDim.x * 32) {
        const int c = c0 + threadIdx.x;
        float s = 0.0f;
        if (c < cols) {
            for (int r = threadIdx.y; r < rows; r += BIAS_GRAD_ROWS) s += dz[(long long)r * cols + c];
        }
        part[threadIdx.y][threadIdx.x] = s;
        __syncthreads();
        if (threadIdx.y == 0 && c < cols) {
            float t = 0.0f;
            for (int k = 0; k < BIAS_GRAD_ROWS; ++k) t += part[k][threadIdx.x];
            db[c] = t;
        }
        __syncthreads();
    }
}

// One block of 256 threads: out[0] = sum of row_loss (in double), out[1] = sum of row_correct.
extern "C" __global__ void reduce_stats_f32(const float* __restrict__ row_loss,
                                            const int* __restrict__ row_correct, int rows,
                                            double* __restrict__ out) {
    __shared__ double sl[256];
    __shared__ double sc[256];
    double l = 0.0, c = 0.0;
    for (int i = threadIdx.x; i < rows; i += blockDim.x) {
        l += (double)row_loss[i];
        c += (double)row_correct[i];
    }
    sl[threadIdx.x] = l;
    sc[threadIdx.x] = c;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            sl[threadIdx.x] += sl[threadIdx.x + s];
            sc[threadIdx.x] += sc[threadIdx.x + s];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        out[0] = sl[0];
        out[1] = sc[0];
    }
}

// The column matrices of a convolution (NCHW): cols [n, c*k*k, oh*ow] with
// cols[b, (ci*k + ki)*k + kj, oy*ow + ox] = x[b, ci, oy*s + ki - p, ox*s + kj - p], 0 outside.
// Grid-stride, one thread per element of cols.
extern "C" __global__ void im2col_f32(const float* __restrict__ x, float* __restrict__ cols, int n,
                                      int c, int h, int w, int k, int s, int p, int oh, int ow) {
    const long long total = (long long)n * c * k * k * oh * ow;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const int ox = (int)(i % ow);
        const int oy = (int)((i / ow) % oh);
        const long long row = i / ((long long)ow * oh); // b * c*k*k + (ci*k + ki)*k + kj
        const int kj = (int)(row % k);
        const int ki = (int)((row / k) % k);
        const long long bc = row / ((long long)k * k); // b * c + ci
        const int y = oy * s + ki - p;
        const int xx = ox * s + kj - p;
        cols[i] = (y >= 0 && y < h && xx >= 0 && xx < w) ? x[(bc * h + y) * w + xx] : 0.0f;
    }
}

// The adjoint of im2col_f32: dx[b, ci, y, x] = the sum over (ki, kj) of the cols entry im2col
// copies from (y, x), in (ki, kj) order (the CPU device's order). One thread per element of
// dx, no atomics.
extern "C" __global__ void col2im_f32(const float* __restrict__ cols, float* __restrict__ dx, int n,
                                      int c, int h, int w, int k, int s, int p, int oh, int ow) {
    const long long total = (long long)n * c * h * w;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const int xx = (int)(i % w);
        const int y = (int)((i / w) % h);
        const long long bc = i / ((long long)w * h);
        float acc = 0.0f;
        for (int ki = 0; ki < k; ++ki) {
            const int ty = y + p - ki;
            if (ty < 0 || ty % s != 0 || ty / s >= oh) continue;
            for (int kj = 0; kj < k; ++kj) {
                const int tx = xx + p - kj;
                if (tx < 0 || tx % s != 0 || tx / s >= ow) continue;
                const long long row = (bc * k + ki) * k + kj;
                acc += cols[(row * oh + ty / s) * ow + tx / s];
            }
        }
        dx[i] = acc;
    }
}

// 2x2 max-pooling, stride 2 (odd edges dropped): y[pl, oy, ox] = the window's first largest
// value (a NaN wins), arg = its index 0..3 in the window (row-major) as a float. One thread
// per output element.
extern "C" __global__ void maxpool2_f32(const float* __restrict__ x, float* __restrict__ y,
                                        float* __restrict__ arg, long long planes, int h, int w) {
    const int oh = h / 2, ow = w / 2;
    const long long total = planes * oh * ow;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const int ox = (int)(i % ow);
        const int oy = (int)((i / ow) % oh);
        const long long pl = i / ((long long)ow * oh);
        const float* win = x + (pl * h + 2 * oy) * w + 2 * ox;
        float best = win[0];
        int at = 0;
        for (int j = 1; j < 4; ++j) {
            const float v = win[(j / 2) * w + (j % 2)];
            if (v > best || (v != v && best == best)) { best = v; at = j; } // v != v: NaN
        }
        y[i] = best;
        arg[i] = (float)at;
    }
}

// The gradient of maxpool2_f32: dx[pl, y, x] = dy of its window when (y, x) is the window's
// maximum, else 0 (also outside every window). One thread per element of dx.
extern "C" __global__ void maxpool2_backward_f32(const float* __restrict__ dy,
                                                 const float* __restrict__ arg,
                                                 float* __restrict__ dx, long long planes, int h,
                                                 int w) {
    const int oh = h / 2, ow = w / 2;
    const long long total = planes * h * w;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const int xx = (int)(i % w);
        const int y = (int)((i / w) % h);
        const long long pl = i / ((long long)w * h);
        const int oy = y / 2, ox = xx / 2;
        float v = 0.0f;
        if (oy < oh && ox < ow) {
            const long long o = (pl * oh + oy) * ow + ox;
            if ((int)arg[o] == (y % 2) * 2 + (xx % 2)) v = dy[o];
        }
        dx[i] = v;
    }
}

// z[(b * channels + c) * plane + i] += bias[c] over the n * channels * plane elements of a
// convolution's output, then ReLU when relu != 0 (fmaxf maps NaN to 0 like Rust's f32::max).
// Grid-stride; needs plane > 0 and channels > 0.
extern "C" __global__ void channel_bias_act_f32(float* __restrict__ z, const float* __restrict__ b,
                                                long long total, int channels, int plane, int relu) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const int c = (int)((i / plane) % channels);
        const float v = z[i] + b[c];
        z[i] = relu ? fmaxf(v, 0.0f) : v;
    }
}

// db[c] = sum over b < n and i < plane of dz[(b * channels + c) * plane + i]. One block of
// CHANNEL_GRAD_THREADS threads per channel (grid-stride over the channels): each thread sums a
// fixed strided subset, then a tree in shared memory adds the partial sums in a fixed order.
// The channel loop depends on blockIdx only, so every thread reaches each __syncthreads.
#define CHANNEL_GRAD_THREADS 256
extern "C" __global__ void channel_bias_grad_f32(const float* __restrict__ dz, float* __restrict__ db,
                                                 int n, int channels, int plane) {
    __shared__ float part[CHANNEL_GRAD_THREADS];
    const long long per = (long long)n * plane;
    for (int c = blockIdx.x; c < channels; c += gridDim.x) {
        float s = 0.0f;
        for (long long j = threadIdx.x; j < per; j += CHANNEL_GRAD_THREADS) {
            const long long b = j / plane, i = j % plane;
            s += dz[(b * channels + c) * plane + i];
        }
        part[threadIdx.x] = s;
        __syncthreads();
        for (int off = CHANNEL_GRAD_THREADS / 2; off > 0; off >>= 1) {
            if (threadIdx.x < off) part[threadIdx.x] += part[threadIdx.x + off];
            __syncthreads();
        }
        if (threadIdx.x == 0) db[c] = part[0];
        __syncthreads();
    }
}
