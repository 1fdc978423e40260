//! The CPU MLP's single-process step, timed in wall clock and in this thread's CPU time (which
//! other processes on a loaded machine move much less), for before/after comparisons of the
//! CPU device across commits: it uses only the API that `827aab1` already had, so the same
//! file builds in a `git worktree` of an older commit.
//!
//! ```sh
//! cargo build --release -p ps-worker --example mlp_step
//! target/release/examples/mlp_step 1024 100      # small model, 100 timed steps
//! target/release/examples/mlp_step 4096 15 1     # large model, forward+backward only
//! ```
//!
//! Arguments: the hidden width `H` of the 784-H-H-10 MLP (1024), the timed steps (100) after 5
//! untimed ones, and `1` to time forward+backward only. Without it a step is ps-bench's
//! single-process step: set the weights, forward+backward at batch 64 on one matmul thread,
//! a plain SGD update. Prints the medians and minima and a hash of the last gradient's bits
//! (equal hashes: bit-identical gradients).

use ps_config::LossReduction;
use ps_model::layout::MlpLayout;
use ps_worker::backend::Backend;
use ps_worker::cpu::CpuBackend;
use std::time::Instant;

/// Milliseconds of CPU time this thread has used.
fn thread_cpu_ms() -> f64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a valid pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    t.tv_sec as f64 * 1e3 + t.tv_nsec as f64 / 1e6
}

fn main() {
    // SAFETY: the first statement of main: no other thread exists yet (matrixmultiply reads it
    // at its first product).
    unsafe { std::env::set_var("MATMUL_NUM_THREADS", "1") };
    ps_process::tune_allocator();
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|s| s.parse().expect("arguments: HIDDEN STEPS [1]"))
        .collect();
    let hidden = args.first().copied().unwrap_or(1024);
    let steps = args.get(1).copied().unwrap_or(100).max(1);
    let fb_only = args.get(2) == Some(&1);
    let layout = MlpLayout::new(&[784, hidden, hidden, 10]);
    let n = layout.num_params();
    let mut params = layout.init_range(1, 0..n);
    let mut b = CpuBackend::new(layout, 1);
    b.set_weights(&params).expect("weights");
    // synthetic pixels in [0, 1], as ps-bench's (the cost does not depend on the data)
    let x: Vec<f32> = (0..64 * 784)
        .map(|i| ((i * 7919) % 256) as f32 / 255.0)
        .collect();
    let y: Vec<u8> = (0..64).map(|i| (i % 10) as u8).collect();
    let mut g = vec![0f32; n];
    let (mut wall, mut cpu) = (Vec::new(), Vec::new());
    for r in 0..steps + 5 {
        let (t, c) = (Instant::now(), thread_cpu_ms());
        if !fb_only {
            b.set_weights(&params).expect("weights");
        }
        b.forward_backward(&x, &y, LossReduction::Mean, &mut g)
            .expect("step");
        if !fb_only {
            for (p, g) in params.iter_mut().zip(&g) {
                *p -= 0.01 * g;
            }
        }
        if r >= 5 {
            wall.push(t.elapsed().as_secs_f64() * 1e3);
            cpu.push(thread_cpu_ms() - c);
        }
    }
    for v in [&mut wall, &mut cpu] {
        v.sort_by(f64::total_cmp);
    }
    let hash = g.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, v| {
        (h ^ u64::from(v.to_bits())).wrapping_mul(0x100_0000_01b3)
    });
    println!(
        "784-{hidden}-{hidden}-10 {}: wall median {:.2} ms min {:.2}, thread CPU median {:.2} ms min {:.2} ({steps} steps; gradient bits hash {hash:016x})",
        if fb_only { "forward+backward" } else { "step" },
        wall[steps / 2],
        wall[0],
        cpu[steps / 2],
        cpu[0],
    );
}
