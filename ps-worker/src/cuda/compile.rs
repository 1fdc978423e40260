//! The NVRTC kernels of `cuda/kernels.cu`: compiling them for the device's architecture (a
//! cubin for exactly this GPU, or PTX for the driver to JIT-compile) and loading their entry
//! points into a context.

use super::{BackendError, BackendResult, KERNELS, cuda_err, one_line};
use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::{CompileError, CompileOptions, Ptx, compile_ptx_with_opts};
use std::sync::Arc;

/// The compiled kernels.
#[derive(Debug)]
pub(super) struct Kernels {
    pub(super) bias_act: CudaFunction,
    pub(super) relu_backward: CudaFunction,
    pub(super) softmax_xent: CudaFunction,
    pub(super) argmax_correct: CudaFunction,
    pub(super) bias_grad: CudaFunction,
    pub(super) reduce_stats: CudaFunction,
    pub(super) im2col: CudaFunction,
    pub(super) col2im: CudaFunction,
    pub(super) maxpool2: CudaFunction,
    pub(super) maxpool2_backward: CudaFunction,
    pub(super) channel_bias_act: CudaFunction,
    pub(super) channel_bias_grad: CudaFunction,
}

/// Names of the kernels' entry points in [`KERNELS`].
#[cfg(test)]
pub(super) const ENTRY_POINTS: [&str; 12] = [
    "bias_act_f32",
    "relu_backward_f32",
    "softmax_xent_f32",
    "argmax_correct_f32",
    "bias_grad_f32",
    "reduce_stats_f32",
    "im2col_f32",
    "col2im_f32",
    "maxpool2_f32",
    "maxpool2_backward_f32",
    "channel_bias_act_f32",
    "channel_bias_grad_f32",
];

/// Compiles [`KERNELS`] for the device's virtual architecture (`compute_90` on Hopper); if
/// this NVRTC does not know that architecture, falls back to its default one (the driver then
/// JIT-compiles the PTX).
pub(super) fn compile_kernels(major: i32, minor: i32) -> BackendResult<(Ptx, String)> {
    let arch = format!("compute_{major}{minor}");
    let opts = |arch: Option<&str>| CompileOptions {
        name: Some("ps_worker_kernels.cu".into()),
        options: arch
            .map(|a| vec![format!("--gpu-architecture={a}")])
            .unwrap_or_default(),
        ..Default::default()
    };
    let describe = |e: CompileError| match e {
        CompileError::CompileError {
            nvrtc,
            options,
            log,
        } => {
            format!(
                "{nvrtc:?} with options {options:?}: {}",
                log.to_string_lossy()
            )
        }
        other => format!("{other:?}"),
    };
    match compile_ptx_with_opts(KERNELS, opts(Some(&arch))) {
        Ok(ptx) => Ok((ptx, arch)),
        Err(first) => match compile_ptx_with_opts(KERNELS, opts(None)) {
            Ok(ptx) => Ok((ptx, "nvrtc default".into())),
            Err(_) => Err(BackendError::Cuda(one_line(&format!(
                "compiling the kernels with NVRTC for {arch}: {}",
                describe(first)
            )))),
        },
    }
}

/// Compiles [`KERNELS`] with NVRTC into a cubin for exactly `sm_{major}{minor}` (machine code:
/// no JIT by the driver, so the driver need not be newer than NVRTC).
pub(super) fn compile_cubin(major: i32, minor: i32) -> Result<Vec<u8>, String> {
    use cudarc::nvrtc::{result, sys};
    let src = std::ffi::CString::new(KERNELS).map_err(|e| e.to_string())?;
    let prog = result::create_program(&src, Some(c"ps_worker_kernels.cu"))
        .map_err(|e| format!("creating the NVRTC program: {e:?}"))?;
    let opts = [format!("--gpu-architecture=sm_{major}{minor}")];
    // SAFETY: `prog` was created above from `src`, which outlives it, and is destroyed once,
    // below; the size is read before the buffer of that size is filled.
    let out = unsafe {
        let r = match result::compile_program(prog, &opts) {
            Err(e) => {
                let log = result::get_program_log(prog)
                    .map(|l| {
                        std::ffi::CStr::from_ptr(l.as_ptr())
                            .to_string_lossy()
                            .into_owned()
                    })
                    .unwrap_or_default();
                Err(format!("NVRTC for sm_{major}{minor}: {e:?}: {log}"))
            }
            Ok(()) => {
                let mut size = 0usize;
                match sys::nvrtcGetCUBINSize(prog, &mut size).result() {
                    Err(e) => Err(format!("NVRTC's cubin size: {e:?}")),
                    Ok(()) => {
                        let mut bin = vec![0u8; size];
                        sys::nvrtcGetCUBIN(prog, bin.as_mut_ptr().cast())
                            .result()
                            .map(|()| bin)
                            .map_err(|e| format!("NVRTC's cubin: {e:?}"))
                    }
                }
            }
        };
        let _ = result::destroy_program(prog);
        r
    };
    out.map_err(|e| one_line(&e))
}

/// The project's kernels loaded into `ctx` (device `ordinal`): machine code for this device
/// first; PTX (JIT-compiled by the driver, which must then be at least as new as NVRTC) when
/// NVRTC cannot make a cubin or the driver refuses it. With what they were loaded as.
pub(super) fn load_kernels(
    ctx: &Arc<CudaContext>,
    ordinal: usize,
) -> BackendResult<(Kernels, String)> {
    let (major, minor) = ctx
        .compute_capability()
        .map_err(cuda_err("reading the compute capability"))?;
    // Machine code for this device first; PTX (JIT-compiled by the driver, which must then
    // be at least as new as NVRTC) when NVRTC cannot make a cubin or the driver refuses it.
    let cubin = compile_cubin(major, minor).and_then(|bin| {
        ctx.load_module(Ptx::from_binary(bin))
            .map_err(|e| format!("the driver refused the sm_{major}{minor} cubin: {e}"))
    });
    let (module, arch) = match cubin {
        Ok(m) => (m, format!("sm_{major}{minor} cubin")),
        Err(why) => {
            let (ptx, arch) = compile_kernels(major, minor)?;
            let m = ctx.load_module(ptx).map_err(cuda_err(format_args!(
                "loading the NVRTC kernels ({arch} PTX, after: {why}) into cuda:{ordinal} \
             (an UNSUPPORTED_PTX_VERSION error means libnvrtc is newer than the driver)"
            )))?;
            (
                m,
                format!("{arch} PTX, JIT-compiled by the driver (no cubin: {why})"),
            )
        }
    };
    let f = |name: &str| {
        module
            .load_function(name)
            .map_err(cuda_err(format_args!("loading kernel {name}")))
    };
    let k = Kernels {
        bias_act: f("bias_act_f32")?,
        relu_backward: f("relu_backward_f32")?,
        softmax_xent: f("softmax_xent_f32")?,
        argmax_correct: f("argmax_correct_f32")?,
        bias_grad: f("bias_grad_f32")?,
        reduce_stats: f("reduce_stats_f32")?,
        im2col: f("im2col_f32")?,
        col2im: f("col2im_f32")?,
        maxpool2: f("maxpool2_f32")?,
        maxpool2_backward: f("maxpool2_backward_f32")?,
        channel_bias_act: f("channel_bias_act_f32")?,
        channel_bias_grad: f("channel_bias_grad_f32")?,
    };
    Ok((k, arch))
}
