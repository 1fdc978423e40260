//! The gate between a step's pulls and its forward pass (`ps_net::gate`, where the pulls
//! write it); here its tests through a backend's gated forward pass.

pub use ps_net::gate::*;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Backend;
    use ps_config::LossReduction;
    use ps_net::sink::PullSink;
    use std::time::Duration;

    #[test]
    fn a_pull_failing_midway_stops_forward_before_any_gradient_is_handed_on() {
        // shard 1 (the last layers) delivers part of its range, then its pull fails: the step
        // ends with the pull's error and `ready` (what pushes the gradient) is never called
        let layout = ps_model::layout::MlpLayout::new(&[20, 16, 12, 5]);
        let p = layout.num_params();
        let mut m = crate::cpu::CpuBackend::new(layout, 1);
        let shards = vec![0..p / 2, p / 2..p];
        let gate = m
            .open_gate(1, shards.clone(), Duration::from_secs(30))
            .unwrap();
        let x = vec![0.5f32; 4 * 20];
        let y = vec![1u8, 2, 3, 4];
        let mut grad = vec![0f32; p];
        let mut handed = 0;
        let result = std::thread::scope(|s| {
            s.spawn(|| {
                let mut w0 = gate.writer(0);
                let n = w0.len();
                w0.next(n).fill(0.1);
                w0.publish(n);
                w0.finish();
                let mut w1 = gate.writer(1);
                w1.next(10).fill(0.2);
                w1.publish(10);
                std::thread::sleep(Duration::from_millis(20));
                gate.fail(1, "shard 1: connection reset".into());
            });
            m.forward_backward_overlapped(&x, &y, LossReduction::Mean, &mut grad, &mut |_, _, _| {
                handed += 1
            })
        });
        m.close_gate();
        let err = result.unwrap_err();
        assert!(
            matches!(
                &err,
                crate::backend::BackendError::Gate(GateError::PullFailed { shard: 1, .. })
            ),
            "{err}"
        );
        assert!(err.to_string().contains("connection reset"), "{err}");
        assert_eq!(handed, 0, "a gradient was handed on after a failed pull");
    }

    #[test]
    fn forward_through_an_open_gate_computes_what_set_weights_gives() {
        // an MLP whose weights arrive while its step computes: the last shard slowly, piece
        // by piece; the gradient must be that of the complete weights, bit for bit
        let layout = ps_model::layout::MlpLayout::new(&[20, 16, 12, 5]);
        let p = layout.num_params();
        let w: Vec<f32> = (0..p)
            .map(|i| ((i * 13 % 29) as f32 - 14.0) / 40.0)
            .collect();
        let x: Vec<f32> = (0..8 * 20)
            .map(|i| ((i * 7 % 11) as f32 - 5.0) / 5.0)
            .collect();
        let y: Vec<u8> = (0..8).map(|i| (i % 5) as u8).collect();
        let mut want = vec![0f32; p];
        let mut m = crate::cpu::CpuBackend::new(layout.clone(), 1);
        m.set_weights(&w).unwrap();
        m.forward_backward(&x, &y, LossReduction::Mean, &mut want)
            .unwrap();

        let mut gated = crate::cpu::CpuBackend::new(layout, 1);
        // the previous version's weights: all different
        let old: Vec<f32> = w.iter().map(|v| v * 3.0 + 1.0).collect();
        gated.set_weights(&old).unwrap();
        let shards = vec![0..p / 3, p / 3..p];
        let gate = gated
            .open_gate(1, shards.clone(), Duration::from_secs(30))
            .expect("the CPU model has host weights");
        let mut got = vec![0f32; p];
        std::thread::scope(|s| {
            for (i, pause) in [(0, 0), (1, 300)] {
                let (g, w) = (&gate, &w);
                s.spawn(move || g.deliver(i, w, 17, Duration::from_micros(pause)));
            }
            gated
                .forward_backward(&x, &y, LossReduction::Mean, &mut got)
                .unwrap();
        });
        gated.close_gate();
        assert_eq!(
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        assert_eq!(gate.waits().len(), 3);
    }
}
