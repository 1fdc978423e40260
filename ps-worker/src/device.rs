//! Choosing the compute backend from a `--device` spec: `cpu`, `cuda` (the GPU of this
//! worker's local rank), `cuda:N`, or `auto` (CUDA when a GPU is usable, else the CPU).

use crate::backend::{Backend, BackendError};
use crate::cpu::cpu_model;
use crate::cuda::device_count;
use ps_model::layout::ModelLayout;

/// A parsed `--device` value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceSpec {
    /// `cpu`
    Cpu,
    /// `cuda` (`None`: device `local_rank % count`) or `cuda:N`
    Cuda(Option<usize>),
    /// `auto`: CUDA as `cuda` when a GPU is usable, else the CPU
    Auto,
}

impl std::str::FromStr for DeviceSpec {
    type Err = BackendError;

    fn from_str(spec: &str) -> Result<Self, Self::Err> {
        parse_spec(spec)
    }
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Cuda(None) => f.write_str("cuda"),
            DeviceSpec::Cuda(Some(n)) => write!(f, "cuda:{n}"),
            DeviceSpec::Auto => f.write_str("auto"),
        }
    }
}

/// Parses `cpu`, `cuda`, `cuda:N` or `auto` (ASCII case and surrounding blanks ignored).
pub fn parse_spec(spec: &str) -> Result<DeviceSpec, BackendError> {
    let s = spec.trim().to_ascii_lowercase();
    let bad = || {
        BackendError::BadDevice(format!(
            "device {spec:?}: expected cpu, cuda, cuda:N or auto"
        ))
    };
    match s.as_str() {
        "cpu" => Ok(DeviceSpec::Cpu),
        "cuda" => Ok(DeviceSpec::Cuda(None)),
        "auto" => Ok(DeviceSpec::Auto),
        _ => {
            let n = s.strip_prefix("cuda:").ok_or_else(bad)?;
            if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
                return Err(bad());
            }
            n.parse()
                .map(|n| DeviceSpec::Cuda(Some(n)))
                .map_err(|_| bad())
        }
    }
}

/// The model on CUDA device `ordinal`, or `local_rank % count` when `None`; with what the
/// kernels loaded as and the reason for the choice.
fn open_cuda(
    ordinal: Option<usize>,
    local_rank: usize,
    layout: &ModelLayout,
) -> Result<(Box<dyn Backend>, String, String), BackendError> {
    let (ordinal, why) = match ordinal {
        Some(n) => (n, "as requested".to_string()),
        None => {
            let count = device_count()?;
            if count == 0 {
                return Err(BackendError::NoGpu(
                    "CUDA driver found but it sees no device (check CUDA_VISIBLE_DEVICES)".into(),
                ));
            }
            let n = local_rank % count;
            (
                n,
                format!("local rank {local_rank} of {count} visible GPU(s)"),
            )
        }
    };
    let (b, arch) = crate::cuda::open(ordinal, layout)?;
    Ok((b, arch, why))
}

/// Opens the backend named by `spec` (`cpu`, `cuda`, `cuda:N`, `auto`) for this worker:
/// `cuda` uses GPU `local_rank % count`; `auto` does the same and falls back to the CPU
/// (`cpu_threads` matmul threads, only reported) when no GPU is usable ([`BackendError::NoGpu`]:
/// no driver, no device, NVRTC or cuBLAS missing). A GPU that is present but fails
/// ([`BackendError::Cuda`]) is an error even for `auto`, so a broken GPU is never silently
/// replaced by a CPU a hundred times slower. Returns the backend and a one-line log message
/// saying what was chosen and why.
pub fn open_backend(
    spec: &str,
    local_rank: usize,
    layout: &ModelLayout,
    cpu_threads: usize,
) -> Result<(Box<dyn Backend>, String), BackendError> {
    let cpu = || cpu_model(layout, cpu_threads);
    let parsed = parse_spec(spec)?;
    match parsed {
        DeviceSpec::Cpu => {
            let b = cpu();
            let msg = format!("device cpu: using {}", b.name());
            Ok((b, msg))
        }
        DeviceSpec::Cuda(ordinal) => {
            let (b, arch, why) = open_cuda(ordinal, local_rank, layout)?;
            let msg = format!("device {parsed}: using {} [{arch}], {why}", b.name());
            Ok((b, msg))
        }
        DeviceSpec::Auto => match open_cuda(None, local_rank, layout) {
            Ok((b, arch, why)) => {
                let msg = format!("device auto: using {} [{arch}], {why}", b.name());
                Ok((b, msg))
            }
            Err(BackendError::NoGpu(reason)) => {
                let b = cpu();
                let msg = format!("device auto: no GPU ({reason}); using {}", b.name());
                Ok((b, msg))
            }
            Err(e) => Err(e),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ps_config::LossReduction;
    use ps_model::layout::MlpLayout;

    #[test]
    fn parses_specs() {
        assert_eq!(parse_spec("cpu").unwrap(), DeviceSpec::Cpu);
        assert_eq!(parse_spec(" CUDA ").unwrap(), DeviceSpec::Cuda(None));
        assert_eq!(parse_spec("cuda:0").unwrap(), DeviceSpec::Cuda(Some(0)));
        assert_eq!(parse_spec("cuda:13").unwrap(), DeviceSpec::Cuda(Some(13)));
        assert_eq!(parse_spec("auto").unwrap(), DeviceSpec::Auto);
        assert_eq!(
            "cuda:2".parse::<DeviceSpec>().unwrap().to_string(),
            "cuda:2"
        );
        for s in ["cuda:2", "cuda", "cpu", "auto"] {
            assert_eq!(parse_spec(s).unwrap().to_string(), s);
        }
        for bad in [
            "", "gpu", "gpu:0", "cuda:", "cuda:-1", "cuda:+1", "cuda:x", "cuda:1:2", "tpu", "cpu:0",
        ] {
            let e = parse_spec(bad).unwrap_err();
            assert!(matches!(e, BackendError::BadDevice(_)), "{bad}: {e}");
            assert_eq!(
                e.to_string(),
                format!("device {bad:?}: expected cpu, cuda, cuda:N or auto")
            );
        }
        assert!(open_backend("tpu", 0, &ModelLayout::from(MlpLayout::new(&[2, 2])), 1).is_err());
    }

    #[test]
    fn cpu_works() {
        let layout = ModelLayout::from(MlpLayout::new(&[4, 3, 2]));
        let (mut b, msg) = open_backend("cpu", 3, &layout, 2).unwrap();
        assert_eq!(msg, "device cpu: using cpu (2 matmul threads)");
        b.set_weights(&layout.init_range(1, 0..layout.num_params()))
            .unwrap();
        let mut g = vec![0.0; layout.num_params()];
        let s = b
            .forward_backward(&[0.5; 8], &[0, 1], LossReduction::Mean, &mut g)
            .unwrap();
        assert!(s.loss_sum > 0.0 && g.iter().any(|&v| v != 0.0));
    }

    /// Passes with and without a GPU: on a GPU machine `auto` picks CUDA.
    #[test]
    fn auto_falls_back_to_cpu_without_a_gpu() {
        let layout = ModelLayout::from(MlpLayout::new(&[4, 3, 2]));
        let (b, msg) = open_backend("auto", 0, &layout, 2).unwrap();
        assert!(!msg.contains('\n'), "{msg:?}");
        if b.name().starts_with("cpu") {
            assert!(msg.starts_with("device auto: no GPU ("), "{msg}");
            assert!(msg.ends_with("; using cpu (2 matmul threads)"), "{msg}");
        } else {
            assert!(msg.starts_with("device auto: using cuda:0"), "{msg}");
        }
    }

    /// Passes with and without a GPU: without one, `cuda` is a one-line "no GPU" error.
    #[test]
    fn cuda_without_a_gpu_is_a_one_line_error() {
        let layout = ModelLayout::from(MlpLayout::new(&[4, 3, 2]));
        for spec in ["cuda", "cuda:0"] {
            match open_backend(spec, 5, &layout, 1) {
                Ok((b, msg)) => {
                    assert!(b.name().starts_with("cuda:"), "{}", b.name());
                    assert!(!msg.is_empty() && !msg.contains('\n'), "{msg:?}");
                }
                Err(e) => {
                    let m = e.to_string();
                    assert!(!m.is_empty() && !m.contains('\n'), "{m:?}");
                    assert!(m.starts_with("no GPU"), "{m}");
                }
            }
        }
        // An ordinal past the last device is always an error, with or without a GPU.
        let e = open_backend("cuda:4096", 0, &layout, 1)
            .err()
            .expect("no machine has 4097 GPUs");
        let m = e.to_string();
        assert!(m.starts_with("no GPU") && !m.contains('\n'), "{m}");
    }
}
