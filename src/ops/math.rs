//! Scalar math of the f64 reference; `shaders/common/ssm_math.slang` is its f32 twin.

/// softplus(x) = log(1 + e^x), the identity above 20 (torch's and the official kernels' threshold).
pub fn softplus(x: f64) -> f64 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

pub fn sigmoid(x: f64) -> f64 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

/// d softplus / dx: sigmoid below the threshold, 1 above it.
pub fn softplus_derivative(x: f64) -> f64 {
    if x > 20.0 {
        1.0
    } else {
        sigmoid(x)
    }
}

pub fn silu(x: f64) -> f64 {
    x * sigmoid(x)
}

/// silu'(x) = sigmoid(x) (1 + x (1 - sigmoid(x))).
pub fn silu_derivative(x: f64) -> f64 {
    let s = sigmoid(x);
    s * (1.0 + x * (1.0 - s))
}

/// heavy_tail(x) = 1 + x (x >= 0), 1 / (1 - x) (x < 0).
pub fn heavy_tail(x: f64) -> f64 {
    if x >= 0.0 {
        1.0 + x
    } else {
        1.0 / (1.0 - x)
    }
}

/// heavy_tail'(x), 1 at x = 0.
pub fn heavy_tail_derivative(x: f64) -> f64 {
    if x >= 0.0 {
        1.0
    } else {
        1.0 / ((1.0 - x) * (1.0 - x))
    }
}

/// x mod 2π in [0, 2π): the angle wrap of the Mamba-3 rotary state (twin of `ssm_wrap_angle`).
pub fn wrap_angle(x: f64) -> f64 {
    x.rem_euclid(std::f64::consts::TAU)
}
