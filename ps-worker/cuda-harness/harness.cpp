// cuda-harness: a CPU EMULATION of the part of the CUDA driver (libcuda) and cuBLAS (libcublas)
// that ps-worker's CUDA device calls through cudarc 0.19. It is not a GPU and says so: the
// device it reports is named "cuda-harness CPU emulation (not a GPU)" and every process prints
// a summary line "CUDA-HARNESS: ..." at exit. The real Rust host code (cuda.rs, model.rs,
// cudarc's argument marshalling) and the real NVRTC run against it; kernels run as the real
// ps-worker/src/cuda/kernels.cu source compiled here for the CPU (simt.h: one fiber per CUDA
// thread, barriers and warp shuffles emulated), sgemm (single and strided-batched) as a reference
// column-major loop.
//
// Checks (each failure prints "CUDA-HARNESS-ERROR: ..." and makes the process exit with 86):
//  - every device buffer is its own mmap with a PROT_NONE page right after its last byte (and
//    one before it): a kernel or sgemm that reads or writes past a buffer faults; freed
//    buffers stay PROT_NONE (use after free faults too);
//  - copies, memsets, kernel pointer arguments and sgemm operands lie inside one live
//    allocation; sgemm arguments follow BLAS's rules (lda >= rows of op(A), ...);
//  - every call that needs a context finds the primary context current on the calling thread;
//  - launch shapes: whole warps, the block shapes each kernel is written for;
//  - coverage: every kernel in a loaded module (PTX `.entry` or cubin function symbol) must be
//    one this harness emulates (KERNELS below), so a kernel added to kernels.cu without its
//    emulation fails the first module load instead of going untested.
// Streams are emulated in order but LAZILY: a copy, memset, kernel, sgemm or stream-ordered free
// is queued on its stream and runs only when the host has to see its effect (a stream or context
// synchronisation, an event synchronisation up to that event, a copy to pageable host memory,
// which the real driver finishes before returning). So host code that reads a result without
// the synchronisation the real driver needs reads stale memory here too, and how much work a
// host callback overlaps is visible (cuda_harness_ops below). A copy from pageable host memory
// snapshots its source at the call, as the real driver stages it; one from pinned memory
// (cuMemHostAlloc) reads it when it runs, as DMA does. Concurrency between streams and the
// speed of a GPU cannot show here.
// Registered host memory (cuMemHostRegister_v2 / cuMemHostUnregister): ranges are refused as
// the driver refuses them (overlapping a registered or cuMemHostAlloc'd range: 712
// HOST_MEMORY_ALREADY_REGISTERED; unregistering what is not a registered range's start: 713
// HOST_MEMORY_NOT_REGISTERED); a copy from or to registered memory is DMA like pinned memory's
// (read or written when it runs). Copies from and to pageable memory are counted
// (cuda_harness_pageable_bytes), so a test can assert that a path moves nothing through it.
// Lifetime checks (errors): a registered range must still be mapped when a copy runs on it and
// when it is unregistered (unregister before unmap); one unmapped while registered is reported
// at exit. cuda_harness_before_registered_read sets a hook run once, right before the next
// queued copy from registered memory runs (to write the memory between the queueing and the
// DMA, as a shard may). CUDA_HARNESS_REGISTER_RESULT=N refuses every registration with N.
#include "simt.h"
#include KERNELS_CU
#include <algorithm>
#include <chrono>
#include <vector>
#include <cstdarg>
#include <elf.h>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <sys/mman.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
enum { OK = 0, INVALID_VALUE = 1, NOT_INITIALIZED = 3, INVALID_IMAGE = 200, INVALID_CONTEXT = 201,
       INVALID_HANDLE = 400, NOT_FOUND = 500, LAUNCH_FAILED = 719 };
static const int EXIT_ON_ERRORS = 86;
static const int DEVICE_SM = 90; // the compute capability reported: 9.0

static std::recursive_mutex mu;
static bool inited = false;
static int primary_ctx_obj;
static void *const PRIMARY = &primary_ctx_obj;
static thread_local void *current_ctx = nullptr;
// A stream: the operations queued on it, not yet run. `queued` counts every operation ever
// queued, `done` those run, so an event is "done >= its position".
static double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
// finished[i]: when the (i+1)-th operation queued on the stream ran (for cuEventElapsedTime)
struct Stream { std::deque<std::function<void()>> q; long queued = 0, done = 0; double created = now_ms(); std::vector<double> finished; };
static std::map<void *, Stream *> streams;
struct Event { Stream *stream = nullptr; long at = 0; unsigned flags = 0; bool recorded = false; double when = 0; };
static std::set<void *> events;
static std::map<const char *, size_t> pinned; // cuMemHostAlloc'd blocks and their sizes
static std::map<const char *, size_t> registered; // cuMemHostRegister'd ranges and their sizes
static long long pageable_h2d = 0, pageable_d2h = 0, registered_copies = 0;
static void (*before_registered_read)(void *) = nullptr;
static void *before_registered_arg = nullptr;
static long ops_queued = 0, ops_run = 0;
static long errors = 0, launches = 0, sgemms = 0, modules = 0;
static std::map<std::string, long> launch_count;
static std::string last_image_kind = "none";

static void err(const char *fmt, ...) {
  va_list ap; va_start(ap, fmt);
  std::fprintf(stderr, "CUDA-HARNESS-ERROR: "); std::vfprintf(stderr, fmt, ap); std::fprintf(stderr, "\n");
  va_end(ap); ++errors;
}
static void need_ctx(const char *fn) {
  if (current_ctx != PRIMARY) err("%s called on a thread with no current context", fn);
}
static Stream *need_stream(void *s, const char *fn) {
  auto it = streams.find(s);
  if (it == streams.end()) { err("%s on stream %p, which is not a live stream of the context", fn, s); return nullptr; }
  return it->second;
}
static void enqueue(Stream *st, std::function<void()> op) {
  ++ops_queued;
  if (!st) { op(); ++ops_run; return; }
  st->q.push_back(std::move(op)); ++st->queued;
}
// Runs the operations of `st` up to its `upto`-th (all with -1).
static void run_until(Stream *st, long upto = -1) {
  if (!st) return;
  while (!st->q.empty() && (upto < 0 || st->done < upto)) {
    auto op = std::move(st->q.front()); st->q.pop_front();
    op(); ++st->done; ++ops_run;
    st->finished.push_back(now_ms());
  }
}
static void run_all() { for (auto &kv : streams) run_until(kv.second); }

struct Alloc { char *region; size_t region_len; size_t bytes; bool live; };
static std::map<uintptr_t, Alloc> allocs; // key: user pointer
static const size_t PAGE = 4096;

static bool in_live(const void *ptr, size_t bytes, const char *what) {
  uintptr_t p = (uintptr_t)ptr;
  auto it = allocs.upper_bound(p);
  if (it == allocs.begin()) { err("%s: pointer %#lx is in no allocation", what, (unsigned long)p); return false; }
  --it;
  const Alloc &a = it->second;
  if (p + bytes > it->first + a.bytes) { err("%s: [%#lx, +%zu) is past its allocation of %zu bytes", what, (unsigned long)p, bytes, a.bytes); return false; }
  if (!a.live) { err("%s: pointer %#lx into a freed allocation", what, (unsigned long)p); return false; }
  return true;
}

static bool is_mapped(const void *p, size_t n) {
  uintptr_t a = (uintptr_t)p & ~(uintptr_t)(PAGE - 1);
  size_t len = (uintptr_t)p + n - a;
  return msync((void *)a, len ? len : 1, MS_ASYNC) == 0;
}

static void at_exit_report() {
  long still = 0;
  for (auto &kv : registered) {
    ++still;
    if (!is_mapped(kv.first, kv.second)) err("host range %p (+%zu) was unmapped while registered (cuMemHostUnregister must come first)", kv.first, kv.second);
  }
  std::fprintf(stderr, "CUDA-HARNESS: %lld bytes copied from pageable host memory, %lld to it, %lld copies by DMA on registered memory, %ld ranges registered at exit\n",
               pageable_h2d, pageable_d2h, registered_copies, still);
  std::fprintf(stderr, "CUDA-HARNESS: CPU emulation, not a GPU: %ld module loads (last: %s), %ld kernel launches, %ld sgemm calls, %ld of %ld queued operations run, %ld errors\n",
               modules, last_image_kind.c_str(), launches, sgemms, ops_run, ops_queued, errors);
  for (auto &kv : launch_count) std::fprintf(stderr, "CUDA-HARNESS:   %s x%ld\n", kv.first.c_str(), kv.second);
  if (errors) { std::fflush(stderr); _exit(EXIT_ON_ERRORS); }
}

// ---------------- kernels: one entry per __global__ function of kernels.cu ----------------
template <class T> static T arg(void **p, int i) { T v; std::memcpy(&v, p[i], sizeof(T)); return v; }
#define PTR(T, i) ((T)arg<uintptr_t>(params, i))
// A runner reads its arguments and checks them at the launch; the kernel itself runs when its
// stream gets to it (the returned closure, false on a deadlock).
typedef std::function<bool()> (*Runner)(const char *name, dim3_ G, dim3_ B, void **params);

static std::function<bool()> run_bias_act(const char *, dim3_ G, dim3_ B, void **params) {
  float *z = PTR(float *, 0); const float *b = PTR(const float *, 1);
  int rows = arg<int>(params, 2), cols = arg<int>(params, 3), relu = arg<int>(params, 4);
  in_live(z, (size_t)rows * cols * 4, "bias_act z"); in_live(b, (size_t)cols * 4, "bias_act b");
  return [=] { return simt::launch(G, B, [=] { bias_act_f32(z, b, rows, cols, relu); }, true); };
}
static std::function<bool()> run_relu_backward(const char *, dim3_ G, dim3_ B, void **params) {
  float *d = PTR(float *, 0); const float *a = PTR(const float *, 1); long long len = arg<long long>(params, 2);
  in_live(d, len * 4, "relu d"); in_live(a, len * 4, "relu act");
  return [=] { return simt::launch(G, B, [=] { relu_backward_f32(d, a, len); }, true); };
}
static std::function<bool()> run_softmax_xent(const char *, dim3_ G, dim3_ B, void **params) {
  float *z = PTR(float *, 0); const unsigned char *y = PTR(const unsigned char *, 1);
  float *rl = PTR(float *, 2); int *rc = PTR(int *, 3);
  int rows = arg<int>(params, 4), cols = arg<int>(params, 5); float scale = arg<float>(params, 6);
  in_live(z, (size_t)rows * cols * 4, "softmax z"); in_live(y, rows, "softmax labels");
  in_live(rl, rows * 4, "softmax row_loss"); in_live(rc, rows * 4, "softmax row_correct");
  return [=] {
    // the labels are device memory: read when the kernel runs, after the copies before it
    for (int r = 0; r < rows; ++r) if (y[r] >= cols) err("softmax_xent_f32: label %d >= cols %d", y[r], cols);
    return simt::launch(G, B, [=] { softmax_xent_f32(z, y, rl, rc, rows, cols, scale); });
  };
}
static std::function<bool()> run_argmax_correct(const char *, dim3_ G, dim3_ B, void **params) {
  const float *z = PTR(const float *, 0); const unsigned char *y = PTR(const unsigned char *, 1);
  float *rl = PTR(float *, 2); int *rc = PTR(int *, 3); int rows = arg<int>(params, 4), cols = arg<int>(params, 5);
  in_live(z, (size_t)rows * cols * 4, "argmax z"); in_live(y, rows, "argmax labels");
  in_live(rl, rows * 4, "argmax row_loss"); in_live(rc, rows * 4, "argmax row_correct");
  return [=] { return simt::launch(G, B, [=] { argmax_correct_f32(z, y, rl, rc, rows, cols); }); };
}
static std::function<bool()> run_bias_grad(const char *, dim3_ G, dim3_ B, void **params) {
  const float *dz = PTR(const float *, 0); float *db = PTR(float *, 1); int rows = arg<int>(params, 2), cols = arg<int>(params, 3);
  if (B.x != 32 || B.y != 8 || B.z != 1) err("bias_grad_f32: block (%u,%u,%u), the kernel needs (32,8,1)", B.x, B.y, B.z);
  in_live(dz, (size_t)rows * cols * 4, "bias_grad dz"); in_live(db, cols * 4, "bias_grad db");
  return [=] { return simt::launch(G, B, [=] { bias_grad_f32(dz, db, rows, cols); }); };
}
static std::function<bool()> run_reduce_stats(const char *, dim3_ G, dim3_ B, void **params) {
  const float *rl = PTR(const float *, 0); const int *rc = PTR(const int *, 1); int rows = arg<int>(params, 2); double *out = PTR(double *, 3);
  if (G.x != 1 || B.x != 256 || B.y != 1) err("reduce_stats_f32: grid %u block %u, the kernel needs 1 x 256", G.x, B.x);
  in_live(out, 16, "reduce out"); in_live(rl, rows * 4, "reduce row_loss"); in_live(rc, rows * 4, "reduce row_correct");
  return [=] { return simt::launch(G, B, [=] { reduce_stats_f32(rl, rc, rows, out); }); };
}

static std::function<bool()> run_im2col(const char *, dim3_ G, dim3_ B, void **params) {
  const float *x = PTR(const float *, 0); float *cols = PTR(float *, 1);
  int n = arg<int>(params, 2), c = arg<int>(params, 3), h = arg<int>(params, 4), w = arg<int>(params, 5);
  int k = arg<int>(params, 6), st = arg<int>(params, 7), p = arg<int>(params, 8), oh = arg<int>(params, 9), ow = arg<int>(params, 10);
  if (st < 1 || k < 1 || oh != (h + 2 * p - k) / st + 1 || ow != (w + 2 * p - k) / st + 1) err("im2col_f32: inconsistent geometry");
  in_live(x, (size_t)n * c * h * w * 4, "im2col x"); in_live(cols, (size_t)n * c * k * k * oh * ow * 4, "im2col cols");
  return [=] { return simt::launch(G, B, [=] { im2col_f32(x, cols, n, c, h, w, k, st, p, oh, ow); }, true); };
}
static std::function<bool()> run_col2im(const char *, dim3_ G, dim3_ B, void **params) {
  const float *cols = PTR(const float *, 0); float *dx = PTR(float *, 1);
  int n = arg<int>(params, 2), c = arg<int>(params, 3), h = arg<int>(params, 4), w = arg<int>(params, 5);
  int k = arg<int>(params, 6), st = arg<int>(params, 7), p = arg<int>(params, 8), oh = arg<int>(params, 9), ow = arg<int>(params, 10);
  if (st < 1 || k < 1 || oh != (h + 2 * p - k) / st + 1 || ow != (w + 2 * p - k) / st + 1) err("col2im_f32: inconsistent geometry");
  in_live(cols, (size_t)n * c * k * k * oh * ow * 4, "col2im cols"); in_live(dx, (size_t)n * c * h * w * 4, "col2im dx");
  return [=] { return simt::launch(G, B, [=] { col2im_f32(cols, dx, n, c, h, w, k, st, p, oh, ow); }, true); };
}
static std::function<bool()> run_maxpool2(const char *, dim3_ G, dim3_ B, void **params) {
  const float *x = PTR(const float *, 0); float *y = PTR(float *, 1); float *a = PTR(float *, 2);
  long long pl = arg<long long>(params, 3); int h = arg<int>(params, 4), w = arg<int>(params, 5);
  size_t out = (size_t)pl * (h / 2) * (w / 2);
  in_live(x, (size_t)pl * h * w * 4, "maxpool x"); in_live(y, out * 4, "maxpool y"); in_live(a, out * 4, "maxpool arg");
  return [=] { return simt::launch(G, B, [=] { maxpool2_f32(x, y, a, pl, h, w); }, true); };
}
static std::function<bool()> run_maxpool2_backward(const char *, dim3_ G, dim3_ B, void **params) {
  const float *dy = PTR(const float *, 0); const float *a = PTR(const float *, 1); float *dx = PTR(float *, 2);
  long long pl = arg<long long>(params, 3); int h = arg<int>(params, 4), w = arg<int>(params, 5);
  size_t out = (size_t)pl * (h / 2) * (w / 2);
  in_live(dy, out * 4, "maxpool_backward dy"); in_live(a, out * 4, "maxpool_backward arg"); in_live(dx, (size_t)pl * h * w * 4, "maxpool_backward dx");
  return [=] { return simt::launch(G, B, [=] { maxpool2_backward_f32(dy, a, dx, pl, h, w); }, true); };
}

static std::function<bool()> run_channel_bias_act(const char *, dim3_ G, dim3_ B, void **params) {
  float *z = PTR(float *, 0); const float *b = PTR(const float *, 1);
  long long total = arg<long long>(params, 2); int ch = arg<int>(params, 3), plane = arg<int>(params, 4), relu = arg<int>(params, 5);
  if (ch < 1 || plane < 1 || total % ((long long)ch * plane) != 0) err("channel_bias_act_f32: %lld values are not whole [n, %d, %d] samples", total, ch, plane);
  in_live(z, (size_t)total * 4, "channel_bias_act z"); in_live(b, (size_t)ch * 4, "channel_bias_act b");
  return [=] { return simt::launch(G, B, [=] { channel_bias_act_f32(z, b, total, ch, plane, relu); }, true); };
}
static std::function<bool()> run_channel_bias_grad(const char *, dim3_ G, dim3_ B, void **params) {
  const float *dz = PTR(const float *, 0); float *db = PTR(float *, 1);
  int n = arg<int>(params, 2), ch = arg<int>(params, 3), plane = arg<int>(params, 4);
  if (B.x != 256 || B.y != 1 || B.z != 1) err("channel_bias_grad_f32: block (%u,%u,%u), the kernel needs (256,1,1)", B.x, B.y, B.z);
  in_live(dz, (size_t)n * ch * plane * 4, "channel_bias_grad dz"); in_live(db, (size_t)ch * 4, "channel_bias_grad db");
  return [=] { return simt::launch(G, B, [=] { channel_bias_grad_f32(dz, db, n, ch, plane); }); };
}

struct Kernel { const char *name; Runner run; };
static Kernel KERNELS[] = {
    {"bias_act_f32", run_bias_act},         {"relu_backward_f32", run_relu_backward},
    {"softmax_xent_f32", run_softmax_xent}, {"argmax_correct_f32", run_argmax_correct},
    {"bias_grad_f32", run_bias_grad},       {"reduce_stats_f32", run_reduce_stats},
    {"im2col_f32", run_im2col},             {"col2im_f32", run_col2im},
    {"maxpool2_f32", run_maxpool2},         {"maxpool2_backward_f32", run_maxpool2_backward},
    {"channel_bias_act_f32", run_channel_bias_act}, {"channel_bias_grad_f32", run_channel_bias_grad},
};
static Kernel *find_kernel(const std::string &name) {
  for (auto &k : KERNELS) if (name == k.name) return &k;
  return nullptr;
}

// The kernels of a module image: PTX `.entry NAME(` lines, or a cubin's global function symbols.
static bool image_kernels(const void *image, std::set<std::string> &out, std::string &kind) {
  const unsigned char *b = (const unsigned char *)image;
  if (std::memcmp(b, ELFMAG, SELFMAG) == 0) {
    const Elf64_Ehdr *eh = (const Elf64_Ehdr *)b;
    if (eh->e_ident[EI_CLASS] != ELFCLASS64 || eh->e_shoff == 0) return false;
    const Elf64_Shdr *sh = (const Elf64_Shdr *)(b + eh->e_shoff);
    // the SM version (80, 90, 120) in bits 8..15 of e_flags (CUDA 12.8+ cubins, OS ABI 'A')
    unsigned arch = (eh->e_flags >> 8) & 0xff;
    if (eh->e_machine != 190 /* EM_CUDA */) { err("module image: ELF machine %u is not EM_CUDA", eh->e_machine); return false; }
    kind = "cubin sm_" + std::to_string(arch);
    if (arch != DEVICE_SM) { err("a cubin for sm_%u loaded on this sm_%d device (the driver refuses it)", arch, DEVICE_SM); return false; }
    for (int i = 0; i < eh->e_shnum; ++i) {
      if (sh[i].sh_type != SHT_SYMTAB) continue;
      const Elf64_Sym *sym = (const Elf64_Sym *)(b + sh[i].sh_offset);
      const char *strtab = (const char *)(b + sh[sh[i].sh_link].sh_offset);
      for (size_t s = 0; s < sh[i].sh_size / sizeof(Elf64_Sym); ++s)
        if (ELF64_ST_TYPE(sym[s].st_info) == STT_FUNC && ELF64_ST_BIND(sym[s].st_info) == STB_GLOBAL)
          out.insert(strtab + sym[s].st_name);
    }
    return true;
  }
  std::string ptx = (const char *)image;
  size_t t = ptx.find(".target ");
  if (ptx.find(".version") == std::string::npos || t == std::string::npos) return false;
  kind = "PTX " + ptx.substr(t + 8, ptx.find_first_of("\n ,", t + 8) - t - 8);
  for (size_t p = ptx.find(".entry "); p != std::string::npos; p = ptx.find(".entry ", p + 1)) {
    size_t e = ptx.find('(', p);
    std::string name = ptx.substr(p + 7, e - p - 7);
    name.erase(std::remove_if(name.begin(), name.end(), ::isspace), name.end());
    out.insert(name);
  }
  return true;
}

struct Module { std::set<std::string> kernels; };
static std::map<void *, Module *> live_modules;

extern "C" {
// ---------------- driver ----------------
CUresult cuInit(unsigned) {
  std::lock_guard<std::recursive_mutex> l(mu);
  if (!inited) {
    inited = true; std::atexit(at_exit_report);
  }
  // CUDA_HARNESS_INIT_RESULT=N: cuInit fails with N, as a broken (999, CUDA_ERROR_UNKNOWN) or
  // device-less (100, CUDA_ERROR_NO_DEVICE) driver does; for the tests of --device auto
  if (const char *r = getenv("CUDA_HARNESS_INIT_RESULT")) return atoi(r);
  return OK;
}
CUresult cuDriverGetVersion(int *v) { *v = 13000; return OK; }
CUresult cuDeviceGetCount(int *c) { *c = 1; return OK; }
CUresult cuDeviceGet(int *d, int ordinal) { if (ordinal != 0) return 101; *d = 0; return OK; }
CUresult cuDeviceGetName(char *name, int len, int) { std::snprintf(name, len, "cuda-harness CPU emulation (not a GPU)"); return OK; }
CUresult cuDeviceGetAttribute(int *v, int attr, int) {
  switch (attr) {
    case 75: *v = DEVICE_SM / 10; return OK; // COMPUTE_CAPABILITY_MAJOR
    case 76: *v = DEVICE_SM % 10; return OK; // COMPUTE_CAPABILITY_MINOR
    case 115: *v = 1; return OK;  // MEMORY_POOLS_SUPPORTED
    default: *v = 0; return OK;
  }
}
CUresult cuDevicePrimaryCtxRetain(void **ctx, int) { *ctx = PRIMARY; return OK; }
CUresult cuDevicePrimaryCtxRelease_v2(int) { return OK; }
CUresult cuCtxGetCurrent(void **ctx) { *ctx = current_ctx; return OK; }
CUresult cuCtxSetCurrent(void *ctx) { current_ctx = ctx; return OK; }
CUresult cuCtxSynchronize() { std::lock_guard<std::recursive_mutex> l(mu); need_ctx("cuCtxSynchronize"); run_all(); return OK; }
CUresult cuStreamCreate(void **s, unsigned) {
  std::lock_guard<std::recursive_mutex> l(mu);
  need_ctx("cuStreamCreate"); Stream *st = new Stream; *s = st; streams[st] = st; return OK;
}
CUresult cuStreamDestroy_v2(void *s) {
  std::lock_guard<std::recursive_mutex> l(mu);
  auto it = streams.find(s);
  if (it == streams.end()) { err("cuStreamDestroy of an unknown stream"); return INVALID_HANDLE; }
  run_until(it->second); // the real driver finishes the queued work, then releases the stream
  delete it->second; streams.erase(it);
  return OK;
}
CUresult cuStreamSynchronize(void *s) {
  std::lock_guard<std::recursive_mutex> l(mu);
  run_until(need_stream(s, "cuStreamSynchronize")); return OK;
}
CUresult cuEventCreate(void **e, unsigned flags) {
  std::lock_guard<std::recursive_mutex> l(mu);
  need_ctx("cuEventCreate"); Event *ev = new Event; ev->flags = flags; events.insert(ev); *e = ev; return OK;
}
CUresult cuEventDestroy_v2(void *e) {
  std::lock_guard<std::recursive_mutex> l(mu);
  if (!events.erase(e)) { err("cuEventDestroy of an unknown event"); return INVALID_HANDLE; }
  delete (Event *)e; return OK;
}
CUresult cuEventRecord(void *e, void *s) {
  std::lock_guard<std::recursive_mutex> l(mu);
  need_ctx("cuEventRecord");
  if (!events.count(e)) { err("cuEventRecord of an unknown event"); return INVALID_HANDLE; }
  Stream *st = need_stream(s, "cuEventRecord");
  Event *ev = (Event *)e;
  ev->stream = st; ev->at = st ? st->queued : 0; ev->recorded = true; ev->when = now_ms();
  return OK;
}
// When the work before the event ran (the stream's creation when there was none); the event
// must have completed.
static double event_time(const Event *ev) {
  if (!ev->stream) return ev->when;
  return ev->at == 0 ? ev->stream->created : ev->stream->finished[ev->at - 1];
}
// The emulated time between two completed events: when the operations before each ran here
// (the real driver requires events created without CU_EVENT_DISABLE_TIMING, both recorded).
CUresult cuEventElapsedTime_v2(float *ms, void *a, void *b) {
  std::lock_guard<std::recursive_mutex> l(mu);
  need_ctx("cuEventElapsedTime");
  if (!events.count(a) || !events.count(b)) { err("cuEventElapsedTime of an unknown event"); return INVALID_HANDLE; }
  Event *s = (Event *)a, *e = (Event *)b;
  if ((s->flags | e->flags) & 2) { err("cuEventElapsedTime of an event created with CU_EVENT_DISABLE_TIMING"); return INVALID_HANDLE; }
  if (!s->recorded || !e->recorded) { err("cuEventElapsedTime of an event never recorded"); return INVALID_HANDLE; }
  for (Event *ev : {s, e})
    if (ev->stream && (!streams.count(ev->stream) || ev->stream->done < ev->at)) return 600; // CUDA_ERROR_NOT_READY
  *ms = (float)(event_time(e) - event_time(s));
  return OK;
}
CUresult cuEventSynchronize(void *e) {
  std::lock_guard<std::recursive_mutex> l(mu);
  if (!events.count(e)) { err("cuEventSynchronize of an unknown event"); return INVALID_HANDLE; }
  Event *ev = (Event *)e;
  if (ev->stream && streams.count(ev->stream)) run_until(ev->stream, ev->at);
  return OK;
}
CUresult cuEventQuery(void *e) {
  std::lock_guard<std::recursive_mutex> l(mu);
  if (!events.count(e)) { err("cuEventQuery of an unknown event"); return INVALID_HANDLE; }
  Event *ev = (Event *)e;
  return !ev->stream || !streams.count(ev->stream) || ev->stream->done >= ev->at ? OK : 600; // CUDA_ERROR_NOT_READY
}
// Work queued on `s` after this waits for the event: with one queue per stream and streams run
// only on demand, the event's stream is run up to the event now (a stricter order).
CUresult cuStreamWaitEvent(void *s, void *e, unsigned) {
  std::lock_guard<std::recursive_mutex> l(mu);
  need_stream(s, "cuStreamWaitEvent");
  if (!events.count(e)) { err("cuStreamWaitEvent on an unknown event"); return INVALID_HANDLE; }
  Event *ev = (Event *)e;
  if (ev->stream && ev->stream != s && streams.count(ev->stream)) run_until(ev->stream, ev->at);
  return OK;
}
CUresult cuMemHostAlloc(void **p, size_t bytes, unsigned) {
  std::lock_guard<std::recursive_mutex> l(mu);
  need_ctx("cuMemHostAlloc");
  *p = std::malloc(bytes ? bytes : 1);
  std::memset(*p, 0xA5, bytes);
  pinned[(const char *)*p] = bytes; return OK;
}
CUresult cuMemFreeHost(void *p) {
  std::lock_guard<std::recursive_mutex> l(mu);
  if (!pinned.erase((const char *)p)) { err("cuMemFreeHost of %p: not a cuMemHostAlloc block", p); return INVALID_VALUE; }
  std::free(p); return OK;
}
static bool in_ranges(const std::map<const char *, size_t> &m, const void *ptr, size_t n = 1) {
  const char *p = (const char *)ptr;
  auto it = m.upper_bound(p);
  if (it == m.begin()) return false;
  --it;
  return p + n <= it->first + it->second;
}
static bool overlaps(const std::map<const char *, size_t> &m, const char *p, size_t n) {
  for (auto &kv : m) if (p < kv.first + kv.second && kv.first < p + n) return true;
  return false;
}
static bool is_registered(const void *ptr, size_t n) { return in_ranges(registered, ptr, n); }
// Memory the device reaches by DMA: cuMemHostAlloc'd or registered (the whole copy inside).
static bool is_pinned(const void *ptr, size_t n = 1) { return in_ranges(pinned, ptr, n) || is_registered(ptr, n); }
// Checked when a copy on registered memory runs: still registered and mapped.
static void check_registered(const void *p, size_t n, const char *what) {
  ++registered_copies;
  if (!is_registered(p, n)) err("%s: %p (+%zu) is no longer registered when the copy runs", what, p, n);
  else if (!is_mapped(p, n)) err("%s: registered %p (+%zu) is no longer mapped when the copy runs", what, p, n);
}
CUresult cuMemHostRegister_v2(void *p, size_t bytes, unsigned) {
  std::lock_guard<std::recursive_mutex> l(mu);
  need_ctx("cuMemHostRegister");
  const char *c = (const char *)p;
  if (!p || !bytes) return INVALID_VALUE;
  // CUDA_HARNESS_REGISTER_RESULT=N: every registration refused with N (a driver or an
  // allocation limit that refuses it), for the workers' fallback to their staging memory
  if (const char *r = getenv("CUDA_HARNESS_REGISTER_RESULT")) return atoi(r);
  if (overlaps(registered, c, bytes) || overlaps(pinned, c, bytes)) return 712; // HOST_MEMORY_ALREADY_REGISTERED
  if (!is_mapped(p, bytes)) return INVALID_VALUE;
  registered[c] = bytes;
  return OK;
}
CUresult cuMemHostUnregister(void *p) {
  std::lock_guard<std::recursive_mutex> l(mu);
  auto it = registered.find((const char *)p);
  if (it == registered.end()) return 713; // HOST_MEMORY_NOT_REGISTERED
  if (!is_mapped(p, it->second)) err("cuMemHostUnregister of %p (+%zu): its memory was unmapped first", p, it->second);
  for (auto &kv : streams)
    if (!kv.second->q.empty()) err("cuMemHostUnregister of %p with work still queued on a stream (synchronise first)", p);
  registered.erase(it);
  return OK;
}
CUresult cuGetErrorString(int e, const char **p) { static char b[80]; std::snprintf(b, 80, "cuda-harness error %d", e); *p = b; return OK; }
CUresult cuGetErrorName(int e, const char **p) { static char b[64]; std::snprintf(b, 64, "CUDA_HARNESS_ERROR_%d", e); *p = b; return OK; }

static CUresult alloc(CUdeviceptr *dptr, size_t bytes) {
  std::lock_guard<std::recursive_mutex> l(mu);
  if (bytes == 0) { err("cuMemAlloc of 0 bytes (the real driver refuses it)"); return INVALID_VALUE; }
  size_t data = (bytes + PAGE - 1) / PAGE * PAGE;
  size_t len = data + 2 * PAGE;
  char *r = (char *)mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (r == MAP_FAILED) return 2;
  mprotect(r, PAGE, PROT_NONE);
  mprotect(r + PAGE + data, PAGE, PROT_NONE);
  char *p = r + PAGE + data - bytes; // the last byte touches the guard page
  std::memset(p, 0xA5, bytes);       // garbage, like fresh device memory
  allocs[(uintptr_t)p] = Alloc{r, len, bytes, true};
  *dptr = (CUdeviceptr)p;
  return OK;
}
CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytes, void *s) {
  std::lock_guard<std::recursive_mutex> l(mu);
  need_ctx("cuMemAllocAsync"); need_stream(s, "cuMemAllocAsync"); return alloc(dptr, bytes);
}
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes) { need_ctx("cuMemAlloc_v2"); return alloc(dptr, bytes); }
static CUresult release(CUdeviceptr p, const char *fn) {
  std::lock_guard<std::recursive_mutex> l(mu);
  auto it = allocs.find((uintptr_t)p);
  if (it == allocs.end() || !it->second.live) { err("%s of %#llx: not a live allocation", fn, p); return INVALID_VALUE; }
  Alloc &a = it->second;
  madvise(a.region, a.region_len, MADV_DONTNEED);
  mprotect(a.region, a.region_len, PROT_NONE);
  a.live = false;
  return OK;
}
CUresult cuMemFreeAsync(CUdeviceptr p, void *s) {
  std::lock_guard<std::recursive_mutex> l(mu);
  need_ctx("cuMemFreeAsync");
  auto it = allocs.find((uintptr_t)p);
  if (it == allocs.end() || !it->second.live) { err("cuMemFreeAsync of %#llx: not a live allocation", p); return INVALID_VALUE; }
  enqueue(need_stream(s, "cuMemFreeAsync"), [=] { release(p, "cuMemFreeAsync"); });
  return OK;
}
CUresult cuMemFree_v2(CUdeviceptr p) { std::lock_guard<std::recursive_mutex> l(mu); need_ctx("cuMemFree_v2"); run_all(); return release(p, "cuMemFree_v2"); }
CUresult cuMemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, void *s) {
  std::lock_guard<std::recursive_mutex> l(mu);
  need_ctx("cuMemsetD8Async");
  if (!in_live((void *)p, n, "cuMemsetD8Async")) return INVALID_VALUE;
  enqueue(need_stream(s, "cuMemsetD8Async"), [=] { std::memset((void *)p, v, n); });
  return OK;
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, void *s) {
  std::lock_guard<std::recursive_mutex> l(mu);
  need_ctx("cuMemcpyHtoDAsync");
  if (!in_live((void *)dst, n, "cuMemcpyHtoDAsync")) return INVALID_VALUE;
  Stream *st = need_stream(s, "cuMemcpyHtoDAsync");
  if (is_registered(src, n)) {
    enqueue(st, [=] {
      if (auto hook = before_registered_read) { before_registered_read = nullptr; hook(before_registered_arg); }
      check_registered(src, n, "cuMemcpyHtoDAsync");
      std::memcpy((void *)dst, src, n);
    });
  } else if (is_pinned(src, n)) {
    enqueue(st, [=] { std::memcpy((void *)dst, src, n); });
  } else {
    pageable_h2d += n;
    auto copy = std::make_shared<std::vector<char>>((const char *)src, (const char *)src + n);
    enqueue(st, [=] { std::memcpy((void *)dst, copy->data(), n); });
  }
  return OK;
}
CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, void *s) {
  std::lock_guard<std::recursive_mutex> l(mu);
  need_ctx("cuMemcpyDtoHAsync");
  if (!in_live((void *)src, n, "cuMemcpyDtoHAsync")) return INVALID_VALUE;
  Stream *st = need_stream(s, "cuMemcpyDtoHAsync");
  const bool reg = is_registered(dst, n);
  enqueue(st, [=] {
    if (reg) check_registered(dst, n, "cuMemcpyDtoHAsync");
    std::memcpy(dst, (const void *)src, n);
  });
  if (!is_pinned(dst, n)) { pageable_d2h += n; run_until(st); } // to pageable memory the driver returns once it is done
  return OK;
}

CUresult cuModuleLoadData(void **m, const void *image) {
  std::lock_guard<std::recursive_mutex> l(mu);
  need_ctx("cuModuleLoadData");
  Module *mod = new Module;
  std::string kind;
  if (!image_kernels(image, mod->kernels, kind)) { err("cuModuleLoadData: the image is neither PTX nor a CUDA cubin"); delete mod; return INVALID_IMAGE; }
  for (auto &k : mod->kernels)
    if (!find_kernel(k)) err("module (%s) ships kernel %s, which this harness does not emulate: add it to KERNELS in harness.cpp", kind.c_str(), k.c_str());
  for (auto &k : KERNELS)
    if (!mod->kernels.count(k.name)) err("module (%s) lacks kernel %s, which this harness emulates", kind.c_str(), k.name);
  ++modules; last_image_kind = kind;
  std::fprintf(stderr, "CUDA-HARNESS: module loaded (%s, %zu kernels)\n", kind.c_str(), mod->kernels.size());
  live_modules[mod] = mod; *m = mod; return OK;
}
CUresult cuModuleUnload(void *m) {
  std::lock_guard<std::recursive_mutex> l(mu);
  auto it = live_modules.find(m);
  if (it == live_modules.end()) { err("cuModuleUnload of an unknown module"); return INVALID_HANDLE; }
  delete it->second; live_modules.erase(it); return OK;
}
CUresult cuModuleGetFunction(void **f, void *m, const char *name) {
  std::lock_guard<std::recursive_mutex> l(mu);
  auto it = live_modules.find(m);
  if (it == live_modules.end()) return INVALID_HANDLE;
  if (!it->second->kernels.count(name)) { err("kernel %s not in the loaded module", name); return NOT_FOUND; }
  Kernel *k = find_kernel(name);
  if (!k) return NOT_FOUND;
  *f = k; return OK;
}

CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shmem, void *stream, void **params, void **extra) {
  std::lock_guard<std::recursive_mutex> l(mu);
  need_ctx("cuLaunchKernel");
  Kernel *k = (Kernel *)f;
  if (k < KERNELS || k >= KERNELS + sizeof(KERNELS) / sizeof(KERNELS[0])) { err("launch of an unknown function"); return INVALID_HANDLE; }
  if (extra) err("%s: launch with extra", k->name);
  if (shmem) err("%s: launch with %u bytes of dynamic shared memory", k->name, shmem);
  ++launches; ++launch_count[k->name];
  if ((bx * by * bz) % 32) err("%s: block (%u,%u,%u) is not whole warps", k->name, bx, by, bz);
  if (gx == 0 || gy == 0 || gz == 0 || gx > 2147483647u || gy > 65535 || gz > 65535 || bx * by * bz > 1024 || bx * by * bz == 0)
    { err("%s: bad grid (%u,%u,%u) or block (%u,%u,%u)", k->name, gx, gy, gz, bx, by, bz); return INVALID_VALUE; }
  auto body = k->run(k->name, dim3_{gx, gy, gz}, dim3_{bx, by, bz}, params);
  const char *name = k->name;
  enqueue(need_stream(stream, "cuLaunchKernel"), [=] { if (!body()) err("%s deadlocked", name); });
  return OK;
}

// For tests (found with dlsym): operations queued and run so far in this process.
long cuda_harness_ops_queued() { std::lock_guard<std::recursive_mutex> l(mu); return ops_queued; }
long cuda_harness_ops_run() { std::lock_guard<std::recursive_mutex> l(mu); return ops_run; }
// Bytes copied from (h2d) and to (d2h) pageable host memory so far in this process.
long long cuda_harness_pageable_bytes(int d2h) { std::lock_guard<std::recursive_mutex> l(mu); return d2h ? pageable_d2h : pageable_h2d; }
// Copies run on registered host memory so far, and bytes registered now.
long long cuda_harness_registered_copies() { std::lock_guard<std::recursive_mutex> l(mu); return registered_copies; }
long long cuda_harness_registered_bytes() {
  std::lock_guard<std::recursive_mutex> l(mu);
  long long b = 0; for (auto &kv : registered) b += kv.second; return b;
}
// Runs `hook(arg)` once, right before the next queued copy from registered memory runs.
void cuda_harness_before_registered_read(void (*hook)(void *), void *arg) {
  std::lock_guard<std::recursive_mutex> l(mu); before_registered_read = hook; before_registered_arg = arg;
}

// ---------------- cuBLAS ----------------
struct Handle { void *stream; int math; };
int cublasCreate_v2(Handle **h) { *h = new Handle{nullptr, 0}; return 0; }
int cublasDestroy_v2(Handle *h) { delete h; return 0; }
int cublasSetStream_v2(Handle *h, void *s) { h->stream = s; return 0; }
int cublasSetMathMode(Handle *h, int m) { h->math = m; return 0; }
int cublasGetMathMode(Handle *h, int *m) { *m = h->math; return 0; }
// One call of `count` column-major products C[b] = alpha op(A[b]) op(B[b]) + beta C[b], A[b] at
// A + b * sa (likewise B, C; a stride of 0 reuses one matrix), checked as cuBLAS checks them
// and run in order on the handle's stream: cublasSgemm_v2 is the batch of one.
static int sgemm_batch(const char *what, Handle *h, int ta, int tb, int m, int n, int k, const float *alpha,
                       const float *A, int lda, long long sa, const float *B, int ldb, long long sb,
                       const float *beta, float *C, int ldc, long long sc, int count) {
  std::lock_guard<std::recursive_mutex> l(mu);
  need_ctx(what);
  ++sgemms;
  if (h->math != 0) err("%s with math mode %d (not CUBLAS_DEFAULT_MATH)", what, h->math);
  if ((ta != 0 && ta != 1) || (tb != 0 && tb != 1)) { err("%s: operation %d/%d is neither N nor T", what, ta, tb); return 7; }
  if (m < 0 || n < 0 || k < 0 || count < 0 || sa < 0 || sb < 0 || sc < 0) { err("%s negative size or stride", what); return 7; }
  int arows = ta == 0 ? m : k, acols = ta == 0 ? k : m;
  int brows = tb == 0 ? k : n, bcols = tb == 0 ? n : k;
  if (lda < std::max(1, arows) || ldb < std::max(1, brows) || ldc < std::max(1, m)) {
    err("%s BLAS rule: m %d n %d k %d ta %d tb %d lda %d ldb %d ldc %d", what, m, n, k, ta, tb, lda, ldb, ldc); return 7;
  }
  if (m == 0 || n == 0 || count == 0) return 0;
  const size_t csize = (size_t)(n - 1) * ldc + m;
  // results of a batch may not overlap (cuBLAS computes them in parallel)
  if (count > 1 && (size_t)sc < csize) { err("%s: results %lld apart overlap (each spans %zu)", what, sc, csize); return 7; }
  for (int b = 0; b < count; ++b) {
    if (k > 0) {
      in_live(A + b * sa, ((size_t)(acols - 1) * lda + arows) * 4, "sgemm A");
      in_live(B + b * sb, ((size_t)(bcols - 1) * ldb + brows) * 4, "sgemm B");
    }
    in_live(C + b * sc, csize * 4, "sgemm C");
  }
  // CUDA_HARNESS_FAULT=sgemm: a broken sgemm that drops the last term of every inner product
  // (zero weights cannot tell); for the test that the start-up self-test catches it
  const char *fault = getenv("CUDA_HARNESS_FAULT");
  const int kk = fault && !std::strcmp(fault, "sgemm") && k > 1 ? k - 1 : k;
  const float al = *alpha, be = *beta;
  enqueue(need_stream(h->stream, what), [=] {
  for (int b = 0; b < count; ++b) {
    const float *Ab = A + b * sa, *Bb = B + b * sb;
    float *Cb = C + b * sc;
    for (int j = 0; j < n; ++j)
      for (int i = 0; i < m; ++i) {
        float s = 0;
        for (int p = 0; p < kk; ++p) {
          float a = ta == 0 ? Ab[i + (size_t)p * lda] : Ab[p + (size_t)i * lda];
          float bv = tb == 0 ? Bb[p + (size_t)j * ldb] : Bb[j + (size_t)p * ldb];
          s += a * bv;
        }
        float &c = Cb[i + (size_t)j * ldc];
        c = al * s + (be == 0.0f ? 0.0f : be * c);
      }
  }
  });
  return 0;
}
int cublasSgemm_v2(Handle *h, int ta, int tb, int m, int n, int k, const float *alpha, const float *A, int lda,
                   const float *B, int ldb, const float *beta, float *C, int ldc) {
  return sgemm_batch("cublasSgemm_v2", h, ta, tb, m, n, k, alpha, A, lda, 0, B, ldb, 0, beta, C, ldc, 0, 1);
}
int cublasSgemmStridedBatched(Handle *h, int ta, int tb, int m, int n, int k, const float *alpha, const float *A,
                              int lda, long long sa, const float *B, int ldb, long long sb, const float *beta,
                              float *C, int ldc, long long sc, int count) {
  return sgemm_batch("cublasSgemmStridedBatched", h, ta, tb, m, n, k, alpha, A, lda, sa, B, ldb, sb, beta, C, ldc,
                     sc, count);
}
// cuBLAS calls (one per product or per batch of products) so far
long cuda_harness_sgemm_calls() { std::lock_guard<std::recursive_mutex> l(mu); return sgemms; }
}
