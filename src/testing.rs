//! Comparison helpers shared by the parity suite, the reference's finite-difference checks, the
//! runner's `demo` and `bench`.

use crate::tensor::{Tensor, TensorMap};

/// max|got - want| / max(max|want|, 1e-30): the error measure of `spec/ops.md`. Infinite when
/// `got` has a NaN or Inf where `want` is finite, or the shapes differ.
pub fn relative_error(got: &Tensor, want: &Tensor) -> f64 {
    if got.shape() != want.shape() {
        return f64::INFINITY;
    }
    let mut scale = 0.0f64;
    let mut worst = 0.0f64;
    for (&g, &w) in got.data().iter().zip(want.data()) {
        let (g, w) = (f64::from(g), f64::from(w));
        if w.is_finite() && !g.is_finite() {
            return f64::INFINITY;
        }
        scale = scale.max(w.abs());
        worst = worst.max((g - w).abs());
    }
    worst / scale.max(1e-30)
}

/// Whether two tensors hold the same bits.
pub fn bitwise_equal(a: &Tensor, b: &Tensor) -> bool {
    a.shape() == b.shape() && a.data().iter().zip(b.data()).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Central finite differences of a scalar `loss` against the analytic gradients in `gradients`
/// (keyed `d<input>`), at up to `samples` entries of each named input. Returns the largest
/// normalised error |fd - analytic| / max(1, |fd|) and where it occurred.
pub fn finite_difference_error(
    loss: &dyn Fn(&TensorMap<f64>) -> f64,
    inputs: &TensorMap<f64>,
    gradients: &TensorMap<f64>,
    names: &[&str],
    samples: usize,
    step: f64,
) -> (f64, String) {
    let mut worst = (0.0f64, String::new());
    for &name in names {
        let analytic = gradients
            .get(&format!("d{name}"))
            .unwrap_or_else(|| panic!("no gradient d{name} among {:?}", gradients.keys().collect::<Vec<_>>()));
        let Some(count) = inputs.get(name).map(Tensor::len) else { panic!("no input {name}") };
        let stride = (count / samples.max(1)).max(1);
        for index in (0..count).step_by(stride).take(samples) {
            let mut plus = inputs.clone();
            let mut minus = inputs.clone();
            if let (Some(p), Some(m)) = (plus.get_mut(name), minus.get_mut(name)) {
                p.data_mut()[index] += step;
                m.data_mut()[index] -= step;
            }
            let numeric = (loss(&plus) - loss(&minus)) / (2.0 * step);
            let error = (numeric - analytic.data()[index]).abs() / numeric.abs().max(1.0);
            if error > worst.0 || error.is_nan() {
                worst = (error, format!("d{name}[{index}]: fd {numeric:e}, analytic {:e}", analytic.data()[index]));
            }
        }
    }
    worst
}

/// sum_i w_i * t_i over matching tensors: a random linear loss whose gradient is `weights`.
pub fn weighted_sum(outputs: &TensorMap<f64>, weights: &TensorMap<f64>) -> f64 {
    weights
        .iter()
        .map(|(name, w)| {
            let t = &outputs[name];
            t.data().iter().zip(w.data()).map(|(a, b)| a * b).sum::<f64>()
        })
        .sum()
}
