// The CUDA backend's kernels, compiled by NVRTC at start-up (see cuda.rs).
#define NEG_INF __int_as_float(0xff800000)
#define BIAS_GRAD_ROWS 8

// z[r, c] += b[c], then ReLU when relu != 0 (fmaxf maps NaN to 0 like Rust's f32::max).
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

// act_dz[i] = act_dz[i] <= 0 ? 0 : da[i]: turns the post-ReLU activation into dL/dz in place.
extern "C" __global__ void relu_backward_f32(const float* __restrict__ da, float* __restrict__ act_dz,
                                             long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        act_dz[i] = act_dz[i] <= 0.0f ? 0.0f : da[i];
    }
}

// One warp per row of the logits z [rows, cols]: replaces the row by
// scale * (softmax(z) - onehot(label)), writes the row's cross-entropy loss and whether its
// first largest logit is the label. Row-wise max for stability, like the CPU backend.
extern "C" __global__ void softmax_xent_f32(float* __restrict__ z, const unsigned char* __restrict__ labels,
                                            float* __restrict__ row_loss, int* __restrict__ row_correct,
                                            int rows, int cols, float scale) {
    const int lane = threadIdx.x & 31;
    const int warps_per_block = blockDim.x >> 5;
    const int nwarps = gridDim.x * warps_per_block;
    for (int r = blockIdx.x * warps_per_block + (threadIdx.x >> 5); r < rows; r += nwarps) {
        float* row = z + (long long)r * cols;
        float m = NEG_INF;
        int arg = 0x7fffffff;
        for (int j = lane; j < cols; j += 32) {
            const float v = row[j];
            if (v > m) { m = v; arg = j; }
        }
        for (int off = 16; off > 0; off >>= 1) {
            const float om = __shfl_xor_sync(0xffffffffu, m, off);
            const int oa = __shfl_xor_sync(0xffffffffu, arg, off);
            if (om > m || (om == m && oa < arg)) { m = om; arg = oa; }
        }
        if (arg == 0x7fffffff) arg = 0;
        float s = 0.0f;
        for (int j = lane; j < cols; j += 32) s += expf(row[j] - m);
        for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        const int y = labels[r];
        const float zy = row[y];
        __syncwarp();
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

// db[c] = sum over rows of dz[r, c]. Block (32, BIAS_GRAD_ROWS): x picks the column of a
// 32-column tile, y strides over the rows; the partial sums are added in a fixed order.
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
